"""A/B of fp8 kernel variants over shapes (M x N x K), rounds in rotated order (CUPTI).

    git apply benchmarks/results/2026-11-25-h200/promotion_overlap.patch
    PYTHONPATH=. python benchmarks/results/2026-11-25-h200/promotion_overlap.py ROUNDS \
        SHAPES BLOCK_SPECS TENSOR_SPECS

A spec is BMxBNsS[:OPT...], OPT one of the patch's Config fields: a turns value (issue,
done, alternate) or aN (acc_buffers=N). Each variant is checked bit for bit against the
first of its kind (blocks / per tensor) before timing.
"""
import statistics, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.mosaic.gpu import profiler
from benchmarks.fp8_kernel_probe import _quantize
from pallas_gemm.fp8 import mosaic, config as C, xla as sm_xla

ROUNDS = int(sys.argv[1])
SHAPES = [tuple(int(v) for v in s.split("x")) for s in sys.argv[2].split(",")]
def cfg(spec):
  tile, *opts = spec.split(":")
  bm, rest = tile.split("x"); bn, st = rest.split("s")
  kw = {}
  for o in opts:
    if o.startswith("a"): kw["acc_buffers"] = int(o[1:])
    else: kw["turns"] = o
  return C.Config(block_m=int(bm), block_n=int(bn), stages=int(st), epi_block_n=64 if int(bn) % 64 == 0 else 32, **kw)
BLK = {s: cfg(s) for s in sys.argv[3].split(",") if s}
TEN = {s: cfg(s) for s in sys.argv[4].split(",") if s}

def t(f, *a):
  _, runs = profiler.measure(f, aggregate=False, iterations=10)(*a)
  return statistics.median(sum(x for _, x in r) for r in runs)

print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
print("| M N K | variant | median ms | TFLOP/s | x bf16 (min-max) |")
for m, n, k in SHAPES:
  ka, kb = jax.random.split(jax.random.key(m + n + k))
  a = jax.random.normal(ka, (m, k), jnp.float32); b = jax.random.normal(kb, (n, k), jnp.float32)
  a8, sa = _quantize(a, 1, 128); b8, sb = _quantize(b, 128, 128)
  a8t, sat = _quantize(a, 0, 0); b8t, sbt = _quantize(b, 0, 0)
  ab, bb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  del a, b
  dims = (((1,), (1,)), ((), ()))
  K = lambda c: jax.jit(lambda v, w, s, u: mosaic.scaled_gemm(v[None], w[None], s[None], u[None], out_dtype=jnp.bfloat16, config=c)[0])
  xt = jax.jit(sm_xla.per_tensor_pattern)
  variants = {"bf16 jnp.dot": (jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims)), (ab, bb)),
              "cuBLASLt per-tensor": (xt, (a8t, b8t, sat.reshape(()), sbt.reshape(())))}
  for s, c in BLK.items():
    variants[f"blocks {s}"] = (K(c), (a8, b8, sa, sb))
  for s, c in TEN.items():
    variants[f"tensor {s}"] = (K(c), (a8t, b8t, sat, sbt))
  refs = {}
  for nm, (f, args) in list(variants.items()):
    try:
      out = np.asarray(jax.block_until_ready(f(*args)).astype(jnp.float32))
    except Exception as e:
      print(nm, "FAILED", str(e)[:300], flush=True); del variants[nm]; continue
    kind = nm.split()[0]
    if kind in ("blocks", "tensor"):
      if kind not in refs: refs[kind] = out
      elif not np.array_equal(out, refs[kind]): print(nm, "NOT BITWISE EQUAL to first", kind, flush=True)
  names = list(variants); times = {nm: [] for nm in names}
  for r in range(ROUNDS):
    for nm in names[r % len(names):] + names[:r % len(names)]:
      times[nm].append(t(variants[nm][0], *variants[nm][1]))
  for nm in names:
    ratios = [x / y for x, y in zip(times["bf16 jnp.dot"], times[nm])]
    med = statistics.median(times[nm])
    print(f"| {m} {n} {k} | {nm} | {med:.4f} | {2.0*m*n*k/med/1e9:.0f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |", flush=True)
