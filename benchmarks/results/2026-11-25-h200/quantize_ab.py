"""quantize (1x128 blocks): the Hopper kernel against the xla path, bit-for-bit check,
CUPTI, 5 rounds alternating the order.

    PYTHONPATH=. python benchmarks/results/2026-11-25-h200/quantize_ab.py RxKxDTYPE,...
"""
import statistics, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
import pallas_gemm as sm
print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
def t(f, *a):
  _, runs = profiler.measure(f, aggregate=False, iterations=10)(*a)
  return statistics.median(sum(x for _, x in r) for r in runs)
print("| shape | dtype | xla ms | mosaic ms | xla/mosaic (min-max) | mosaic TB/s (min bytes) | bitwise |")
for spec in sys.argv[1].split(","):
  r, k, dt = spec.split("x")
  r, k, dt = int(r), int(k), {"bf16": jnp.bfloat16, "f32": jnp.float32}[dt]
  x = (jax.random.normal(jax.random.key(r + k), (r, k), jnp.float32) * jnp.exp2(jax.random.randint(jax.random.key(1), (r, 1), -40, 40).astype(jnp.float32))).astype(dt)
  fx = jax.jit(lambda x: sm.quantize(x, backend="xla")); fm = jax.jit(lambda x: sm.quantize(x, backend="mosaic"))
  vx, sx = fx(x); vm, sm_ = fm(x)
  same = bool(np.array_equal(np.asarray(sx), np.asarray(sm_)) and np.array_equal(np.asarray(vx).view(np.uint8), np.asarray(vm).view(np.uint8)))
  tx, tm = [], []
  for i in range(5):
    for nm in (["x", "m"] if i % 2 == 0 else ["m", "x"]):
      (tx if nm == "x" else tm).append(t(fx if nm == "x" else fm, x))
  ratios = [a / b for a, b in zip(tx, tm)]
  nbytes = r * k * (jnp.dtype(dt).itemsize + 1) + r * k // 128 * 4
  print(f"| {r}x{k} | {jnp.dtype(dt).name} | {statistics.median(tx):.4f} | {statistics.median(tm):.4f} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {nbytes / statistics.median(tm) / 1e9:.2f} | {same} |", flush=True)
