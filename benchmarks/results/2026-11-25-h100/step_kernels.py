"""Where one training step of examples/fp8_mlp.py (--full) spends its device time: the
CUPTI kernels of each model's step (the example's variant names; by default bf16 and fp8),
grouped and largest first, then the kernels of at least 0.03 ms in launch order.

    PYTHONPATH=. python benchmarks/results/2026-11-25-h100/step_kernels.py [VARIANT ...]
"""
import collections, sys
sys.path.insert(0, "examples")
import jax, jax.numpy as jnp, optax
from jax.experimental.mosaic.gpu import profiler
import fp8_mlp as ex

cfg = ex.FULL
print("device", jax.devices()[0].device_kind, "jax", jax.__version__, cfg, flush=True)
kx, kt, kp = jax.random.split(jax.random.key(0), 3)
teacher = ex.MLP(cfg["hidden"], cfg["d_out"])
x = jax.random.normal(kx, (cfg["batch"], cfg["d_in"]), jnp.float32)
y = teacher.apply(teacher.init(kt, x), x).astype(jnp.float32)
x = x.astype(jnp.bfloat16)
params = teacher.init(kp, x)
opt = optax.adam(1e-3)
state = opt.init(params)
for v in sys.argv[1:] or ("bf16", "fp8"):
  model = ex.MLP(cfg["hidden"], cfg["d_out"], ex._dot_general(v, "auto"))
  def step(params, state, x, y):
    def loss_fn(p):
      return jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  f = jax.jit(step)
  jax.block_until_ready(f(params, state, x, y))
  _, runs = profiler.measure(f, aggregate=False, iterations=3)(params, state, x, y)
  run = runs[-1]
  total = sum(t for _, t in run)
  by_name = collections.defaultdict(lambda: [0.0, 0])
  for name, t in run:
    by_name[name][0] += t; by_name[name][1] += 1
  cats = collections.defaultdict(float)
  for name, (t, c) in by_name.items():
    cat = ("pallas fp8 GEMM" if "scaled_fp8" in name else "pallas other" if "pallas" in name
           else "cuBLAS GEMM" if any(s in name for s in ("nvjet", "gemm", "cutlass", "sm90_xmma")) else "XLA fusion/other")
    cats[cat] += t
  print(f"== {v}: {len(run)} kernels, {total:.3f} ms of kernel time", flush=True)
  for cat, t in sorted(cats.items(), key=lambda kv: -kv[1]):
    print(f"   {cat:20s} {t:8.3f} ms", flush=True)
  for name, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:18]:
    print(f"   {t:8.3f} ms x{c:2d}  {name[:110]}", flush=True)
  print("   launch order (>= 0.03 ms):")
  for i, (name, t) in enumerate(run):
    if t >= 0.03:
      print(f"   #{i:3d} {t:7.3f} ms  {name[:100]}", flush=True)
