"""Same-process A/B of fp8 block-scaled tiles over shapes (M,N,K), rounds rotated (CUPTI)."""
import statistics, sys
import jax, jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler
from benchmarks.fp8_kernel_probe import _quantize
from pallas_gemm.fp8 import mosaic, config as C, xla as sm_xla

ROUNDS = int(sys.argv[1])
SHAPES = [tuple(int(v) for v in s.split("x")) for s in sys.argv[2].split(",")]
CFGS = {s: C.Config(block_m=int(s.split("x")[0]), block_n=int(s.split("x")[1].split("s")[0]), epi_block_n=64 if int(s.split("x")[1].split("s")[0]) % 64 == 0 else 32,
                    stages=int(s.split("s")[1])) for s in sys.argv[3].split(",")}

def t(f, *a):
  _, runs = profiler.measure(f, aggregate=False, iterations=10)(*a)
  return statistics.median(sum(x for _, x in r) for r in runs)

print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
print("| M N K | variant | median ms | TFLOP/s | x bf16 (min-max over rounds) |")
for m, n, k in SHAPES:
  ka, kb = jax.random.split(jax.random.key(m + n + k))
  a = jax.random.normal(ka, (m, k), jnp.float32); b = jax.random.normal(kb, (n, k), jnp.float32)
  a8, sa = _quantize(a, 1, 128); b8, sb = _quantize(b, 128, 128)
  a8t, sat = _quantize(a, 0, 0); b8t, sbt = _quantize(b, 0, 0)
  ab, bb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  del a, b
  dims = (((1,), (1,)), ((), ()))
  K = lambda cfg: jax.jit(lambda v, w, s, u: mosaic.scaled_gemm(v[None], w[None], s[None], u[None], out_dtype=jnp.bfloat16, config=cfg)[0])
  xt = jax.jit(sm_xla.per_tensor_pattern)
  rew = sm_xla.is_cublaslt_fp8(xt.lower(a8t, b8t, sat.reshape(()), sbt.reshape(())).compile().as_text())
  variants = {"bf16 jnp.dot": (jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims)), (ab, bb)),
              f"xla per-tensor (cublaslt={rew})": (xt, (a8t, b8t, sat.reshape(()), sbt.reshape(())))}
  for s, cfg in CFGS.items():
    variants[f"blocks {s}"] = (K(cfg), (a8, b8, sa, sb))
  for s, cfg in list(CFGS.items())[:2]:
    variants[f"tensor {s}"] = (K(cfg), (a8t, b8t, sat, sbt))
  ref = None
  for nm, (f, args) in list(variants.items()):
    try:
      out = jax.block_until_ready(f(*args))
    except Exception as e:
      print(nm, "FAILED", str(e)[:200], flush=True); del variants[nm]; continue
    if nm.startswith("blocks"):
      if ref is None: ref = out.astype(jnp.float32)
      d = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
      if d > 1e-2: print(nm, "DIFFERS from first config", d, flush=True)
  names = list(variants); times = {nm: [] for nm in names}
  for r in range(ROUNDS):
    for nm in names[r % len(names):] + names[:r % len(names)]:
      times[nm].append(t(variants[nm][0], *variants[nm][1]))
  for nm in names:
    ratios = [x / y for x, y in zip(times["bf16 jnp.dot"], times[nm])]
    med = statistics.median(times[nm])
    print(f"| {m} {n} {k} | {nm} | {med:.4f} | {2.0*m*n*k/med/1e9:.0f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |", flush=True)
