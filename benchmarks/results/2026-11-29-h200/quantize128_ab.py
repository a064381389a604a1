"""quantize with 128x128 blocks: XLA's two passes against the one-pass Mosaic kernel, CUPTI,
rounds in turns; values and scales compared bit for bit."""
import statistics, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
import pallas_gemm
q = pallas_gemm

def t(f, x):
  _, runs = profiler.measure(f, aggregate=False, iterations=10)(x)
  return statistics.median(sum(d for _, d in r) for r in runs)

print("| x shape (bf16) | xla ms | mosaic ms | xla / mosaic (min-max) | mosaic TB/s | bitwise |")
print("|---|---:|---:|---:|---:|---|")
for shape in [(8192, 8192), (32, 4096, 7168), (8, 28672, 4096)]:
  x = (jax.random.normal(jax.random.key(len(shape)), shape, jnp.float32)
       * jnp.exp2(jax.random.randint(jax.random.key(1), shape[:-1] + (1,), -30, 30).astype(jnp.float32))).astype(jnp.bfloat16)
  fx = jax.jit(lambda x: q.quantize(x, block_shape=(128, 128), backend="xla"))
  fm = jax.jit(lambda x: q.quantize(x, block_shape=(128, 128), backend="mosaic"))
  vx, sx = fx(x); vm, sm = fm(x)
  same = bool(np.array_equal(np.asarray(sx), np.asarray(sm)) and np.array_equal(
      np.asarray(vx).view(np.uint8), np.asarray(vm).view(np.uint8)))
  tx, tm = [], []
  for r in range(3):
    for name in (("x", "m") if r % 2 == 0 else ("m", "x")):
      (tx if name == "x" else tm).append(t(fx if name == "x" else fm, x))
  ratios = [a / b for a, b in zip(tx, tm)]
  nbytes = x.size * 3
  print(f"| {shape} | {statistics.median(tx):.4f} | {statistics.median(tm):.4f} | "
        f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
        f"{nbytes / statistics.median(tm) / 1e9:.2f} | {same} |", flush=True)
