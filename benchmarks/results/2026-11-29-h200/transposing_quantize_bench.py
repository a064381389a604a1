"""The transposing quantize against XLA's transpose then the quantize kernel, and a weight's
two fp8 layouts from one read against quantize then XLA's fp8 transpose; CUPTI, rounds in
turns, bit for bit compared."""
import statistics, json, os
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
import pallas_gemm
from pallas_gemm.fp8 import quantize_weights

def t(f, x):
  _, runs = profiler.measure(f, aggregate=False, iterations=10)(x)
  return statistics.median(sum(d for _, d in r) for r in runs)

def rand(shape, key):
  return (jax.random.normal(jax.random.key(key), shape, jnp.float32)
          * jnp.exp2(jax.random.randint(jax.random.key(key + 1), shape[:-1] + (1,), -30, 30)
                     .astype(jnp.float32))).astype(jnp.bfloat16)

def same(a, b):
  return all(np.array_equal(np.asarray(u).view(np.uint8) if u.dtype.itemsize == 1 else np.asarray(u),
                            np.asarray(v).view(np.uint8) if v.dtype.itemsize == 1 else np.asarray(v))
             for u, v in zip(a, b))

res = {}
print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
print("| case | shape (bf16) | old ms | new ms | old / new (min-max) | new TB/s | bitwise |")
print("|---|---|---:|---:|---:|---:|---|")
cases = [("x^T 1x128", (8192, 4096)), ("x^T 1x128", (8192, 16384)), ("x^T 1x128", (4096, 7168)),
         ("w both 128x128", (1, 4096, 16384)), ("w both 128x128", (1, 16384, 4096)),
         ("w both 128x128", (8, 4096, 28672)), ("w both 128x128", (32, 7168, 4096))]
for i, (case, shape) in enumerate(cases):
  x = rand(shape, 3 * i)
  if case.startswith("x^T"):
    old = jax.jit(lambda x: pallas_gemm.quantize(jnp.swapaxes(x, 0, 1)))
    new = jax.jit(lambda x: pallas_gemm.quantize(x, transpose=True))
    nbytes = x.size * (2 + 1) + x.size // 32
  else:
    def old(x):
      v, s = pallas_gemm.quantize(x, block_shape=(128, 128))
      return v, s, jnp.swapaxes(v, 1, 2)
    old = jax.jit(old)
    new = jax.jit(quantize_weights)
    nbytes = x.size * (2 + 1 + 1)
  ok = same(old(x), new(x))
  to, tn = [], []
  for r in range(4):
    for name in (("o", "n") if r % 2 == 0 else ("n", "o")):
      (to if name == "o" else tn).append(t(old if name == "o" else new, x))
  rat = sorted(a / b for a, b in zip(to, tn))
  res[f"{case} {shape}"] = dict(old_ms=statistics.median(to), new_ms=statistics.median(tn),
                                ratio=statistics.median(rat), lo=rat[0], hi=rat[-1], bitwise=ok)
  print(f"| {case} | {shape} | {statistics.median(to):.4f} | {statistics.median(tn):.4f} | "
        f"{statistics.median(rat):.2f} ({rat[0]:.2f}-{rat[-1]:.2f}) | "
        f"{nbytes / statistics.median(tn) / 1e9:.2f} | {ok} |", flush=True)
  del x
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/tq_bench.json", "w"))
