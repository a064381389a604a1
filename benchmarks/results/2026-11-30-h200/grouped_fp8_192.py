"""The grouped fp8 kernel with 128x192 tiles on the GPU (its launcher refuses them): does it
run, and where does it fault? Patched launcher, small routed shape."""
import inspect, sys, numpy as np, jax, jax.numpy as jnp
from pallas_gemm.fp8 import mosaic_ragged as mr
from pallas_gemm.fp8.config import Config
from pallas_gemm import quantize
src = inspect.getsource(mr.ragged_gemm).replace(
    'if config.wg_split != "m" or config.cluster_size != 1 or 128 % config.block_n:', "if False:")
ns = dict(mr.__dict__); exec(src, ns); rg = ns["ragged_gemm"]
M, K, N, G = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stages = int(sys.argv[5])
rng = np.random.default_rng(0)
a8, sa = quantize(jnp.asarray(rng.standard_normal((M, K)), jnp.float32))
b8, sb = quantize(jnp.asarray(rng.standard_normal((G, N, K)), jnp.float32), block_shape=(128, 128))
sizes = jnp.asarray(np.diff(np.linspace(0, M, G + 1).astype(int)), jnp.int32)
outs = {}
for bn in (128, 192):
  cfg = Config(block_m=128, block_n=bn, stages=stages, epi_block_n=64)
  outs[bn] = jax.block_until_ready(jax.jit(lambda *a: rg(*a, out_dtype=jnp.bfloat16, config=cfg))(a8, b8, sizes, sa, sb))
  print(bn, "ran", flush=True)
print("max diff 192 vs 128:", float(jnp.max(jnp.abs(outs[192].astype(jnp.float32) - outs[128].astype(jnp.float32)))))
if len(sys.argv) > 6:  # time the two tiles: rounds of 30 pipelined calls, in turns
  import time
  fns = {bn: jax.jit(lambda *a, bn=bn: rg(*a, out_dtype=jnp.bfloat16, config=Config(
      block_m=128, block_n=bn, stages=stages, epi_block_n=64))) for bn in (128, 192)}
  ms = {128: [], 192: []}
  for r in range(6):
    for bn in ((128, 192) if r % 2 == 0 else (192, 128)):
      t0 = time.perf_counter()
      jax.block_until_ready([fns[bn](a8, b8, sizes, sa, sb) for _ in range(30)])
      ms[bn].append((time.perf_counter() - t0) * 1e3 / 30)
  ratios = sorted(a / b for a, b in zip(ms[128], ms[192]))
  tf = lambda t: 2 * M * N * K / t / 1e9
  print(f"128: {sorted(ms[128])[3]:.3f} ms ({tf(sorted(ms[128])[3]):.0f} TFLOP/s), 192:"
        f" {sorted(ms[192])[3]:.3f} ms; 192 over 128 median {ratios[3]:.3f} range"
        f" {ratios[0]:.3f}-{ratios[-1]:.3f}", flush=True)
