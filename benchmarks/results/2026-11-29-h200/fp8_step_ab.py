"""A/B: fp8_dot_general quantizing W as stored (new) vs transposing bf16 W first (old),
in the fp8_mlp example's training step (Adam), models stepping in turns."""
import functools, importlib.util, statistics, sys, time, json, os
sys.path.insert(0, "examples")
import jax, jax.numpy as jnp, numpy as np
import optax
import fp8_mlp as ex
from pallas_gemm import fp8_dot_general as new_dg

spec = importlib.util.spec_from_file_location("old_fp8_layer", "build/ab/old_fp8_layer.py")
old = importlib.util.module_from_spec(spec); sys.modules[spec.name] = old; spec.loader.exec_module(old)

cfg = dict(ex.SMALL if os.environ.get("AB_SMALL") else ex.FULL)
steps = int(os.environ.get("AB_STEPS", 40))

def trainer(dg):
  kx, kt, kp = jax.random.split(jax.random.key(0), 3)
  model = ex.MLP(cfg["hidden"], cfg["d_out"], dg)
  teacher = ex.MLP(cfg["hidden"], cfg["d_out"])
  x = jax.random.normal(kx, (cfg["batch"], cfg["d_in"]), jnp.float32)
  y = teacher.apply(teacher.init(kt, x), x).astype(jnp.float32)
  x = x.astype(jnp.bfloat16)
  params = ex.MLP(cfg["hidden"], cfg["d_out"]).init(kp, x)
  opt = optax.adam(1e-3); state = opt.init(params)
  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  carry = [params, state]
  def run():
    t = time.perf_counter()
    carry[0], carry[1], loss = step(*carry)
    loss = float(loss)
    return loss, (time.perf_counter() - t) * 1e3
  return run

V = {
  "bf16": None,
  "fp8/new": functools.partial(new_dg, wgrad="fp8"),
  "fp8/old": functools.partial(old.fp8_dot_general, wgrad="fp8"),
  "fp8-wgrad-input/new": functools.partial(new_dg, wgrad="input"),
  "fp8-wgrad-input/old": functools.partial(old.fp8_dot_general, wgrad="input"),
}
runs = {v: [] for v in V}
fns = {v: trainer(dg) for v, dg in V.items()}
names = list(V)
for i in range(steps + 1):
  order = names[i % len(names):] + names[:i % len(names)]
  for v in order:
    runs[v].append(fns[v]())
print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, {cfg}, {steps} steps")
base = [t for _, t in runs["bf16"][1:]]
res = {}
for v in names:
  ms = [t for _, t in runs[v][1:]]
  rat = sorted(b / m for b, m in zip(base, ms))
  q = lambda p: rat[int(p * (len(rat) - 1))]
  res[v] = dict(ms=statistics.median(ms), x_bf16=statistics.median(rat),
                spread=(q(0.75) - q(0.25)) / 2, losses=[l for l, _ in runs[v]])
  print(f"{v:22s} {res[v]['ms']:8.3f} ms  x bf16 {res[v]['x_bf16']:.3f} +-{res[v]['spread']:.3f}"
        f"  loss {runs[v][0][0]:.5f} -> {runs[v][-1][0]:.5f}")
for a, b in (("fp8/new", "fp8/old"), ("fp8-wgrad-input/new", "fp8-wgrad-input/old")):
  r = sorted(o / n for (_, n), (_, o) in zip(runs[a][1:], runs[b][1:]))
  same = res[a]["losses"] == res[b]["losses"]
  print(f"{a} over {b}: {statistics.median(r):.3f}x (+-{(r[3*len(r)//4]-r[len(r)//4])/2:.3f}),"
        f" losses identical: {same}")
  res[f"{a} over {b}"] = dict(median=statistics.median(r), identical_losses=same)
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/fp8_step_ab.json", "w"))
