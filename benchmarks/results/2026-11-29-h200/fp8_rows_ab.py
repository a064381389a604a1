"""Same-run A/B: the fp8 kernel launcher before (padding rows to 8) and after (row views)."""
import importlib.util, statistics, sys
import jax, jax.numpy as jnp, numpy as np
from benchmarks.timing import Timer, rounds_ms, ratio_stats
from pallas_gemm.fp8 import mosaic_gemm as new
spec = importlib.util.spec_from_file_location("old_mosaic_gemm", "build/ab/old_mosaic_gemm.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_mosaic_gemm"] = old; spec.loader.exec_module(old)
E4M3 = jnp.float8_e4m3fn
def operands(key, m, n, k):
  ka, kb, ks, kt = jax.random.split(key, 4)
  a = jax.random.normal(ka, (1, m, k), jnp.float32).astype(E4M3)
  b = jax.random.normal(kb, (1, n, k), jnp.float32).astype(E4M3)
  sa = jnp.exp2(jax.random.randint(ks, (1, m, k // 128), -4, 4).astype(jnp.float32))
  sb = jnp.exp2(jax.random.randint(kt, (1, -(-n // 128), k // 128), -4, 4).astype(jnp.float32))
  return a, b, sa, sb
print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
print("| M x N x K | before ms | after ms | TFLOP/s before / after | after x before | bitwise equal |")
print("|---|---|---|---|---|---|")
for m, n, k in [(4096, 4096, 4096), (4097, 4096, 4096), (4097, 4097, 4096), (8193, 8192, 8192)]:
  sets = [operands(jax.random.key(i), m, n, k) for i in range(2)]
  fns = {"before": jax.jit(old.scaled_gemm), "after": jax.jit(new.scaled_gemm)}
  same = all(bool(jnp.array_equal(fns["before"](*s), fns["after"](*s))) for s in sets)
  t = rounds_ms(Timer(), fns, sets, rounds=9, calls=10)
  r = ratio_stats(t["before"], t["after"])
  mb, ma = statistics.median(t["before"]), statistics.median(t["after"])
  f = 2 * m * n * k / 1e9
  print(f"| {m}x{n}x{k} | {mb:.4f} | {ma:.4f} | {f / mb:.0f} / {f / ma:.0f} |"
        f" {r.median:.3f} ±{r.spread:.3f} | {same} |", flush=True)
