"""The fp8 kernel with 1x128 block scales on both operands (a weight gradient's: per-row
and per-column scales at every step of K) at its default and given CTA tiles, beside bf16
jnp.dot, rounds in rotated order (CUPTI).

    PYTHONPATH=. python benchmarks/results/2026-11-25-h200/fp8_cols.py ROUNDS \
        16384x4096x8192,... 128x128s5,...

Shapes are MxNxK, tiles BMxBNsSTAGES.
"""
import statistics, sys
import jax, jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler
from pallas_gemm.fp8 import mosaic, config as C, scales

ROUNDS = int(sys.argv[1])
SHAPES = [tuple(int(v) for v in s.split("x")) for s in sys.argv[2].split(",")]
def parse(s):
  bm, rest = s.split("x"); bn, st = rest.split("s")
  return C.Config(block_m=int(bm), block_n=int(bn), epi_block_n=64 if int(bn) % 64 == 0 else 32, stages=int(st))
CFGS = {s: parse(s) for s in sys.argv[3].split(",")}

def t(f, *a):
  _, runs = profiler.measure(f, aggregate=False, iterations=10)(*a)
  return statistics.median(sum(x for _, x in r) for r in runs)

print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
print("| M N K | variant | median ms | TFLOP/s | x bf16 (min-max over rounds) |")
for m, n, k in SHAPES:
  ka, kb = jax.random.split(jax.random.key(m + n + k))
  a = jax.random.normal(ka, (m, k), jnp.bfloat16); b = jax.random.normal(kb, (n, k), jnp.bfloat16)
  a8, sa = scales.quantize(a[None]); b8, sb = scales.quantize(b[None])
  dims = (((1,), (1,)), ((), ()))
  K = lambda cfg: jax.jit(lambda v, w, s, u: mosaic.scaled_gemm(v, w, s, u, out_dtype=jnp.bfloat16, config=cfg)[0])
  variants = {"bf16 jnp.dot": (jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims)), (a, b)),
              "cols default": (K(None), (a8, b8, sa, sb))}
  for s, cfg in CFGS.items():
    variants[f"cols {s}"] = (K(cfg), (a8, b8, sa, sb))
  ref = None
  for nm, (f, args) in list(variants.items()):
    try:
      out = jax.block_until_ready(f(*args)).astype(jnp.float32)
    except Exception as e:
      print(nm, "FAILED", str(e)[:300], flush=True); del variants[nm]; continue
    if ref is None: ref = out
    print(nm, "rel diff vs bf16", float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)), flush=True)
  names = list(variants); times = {nm: [] for nm in names}
  for r in range(ROUNDS):
    for nm in names[r % len(names):] + names[:r % len(names)]:
      times[nm].append(t(variants[nm][0], *variants[nm][1]))
  for nm in names:
    ratios = [x / y for x, y in zip(times["bf16 jnp.dot"], times[nm])]
    med = statistics.median(times[nm])
    print(f"| {m} {n} {k} | {nm} | {med:.4f} | {2.0*m*n*k/med/1e9:.0f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |", flush=True)
