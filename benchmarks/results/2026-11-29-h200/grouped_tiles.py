"""Grouped forward kernels' tiles at MoE shapes, routed group sizes, vs cuBLAS dense."""
import statistics, sys
import jax, jax.numpy as jnp
from benchmarks.timing import Timer, rounds_ms, ratio_stats
from pallas_gemm.grouped import mosaic_forward as mf
from pallas_gemm.grouped.config import Config, default_config
from pallas_gemm.moe import softmax_topk
print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
B = jnp.bfloat16
def sizes(t, e, k, uniform):
  if uniform:
    return jnp.full((e,), t * k // e, jnp.int32)
  _, ids = softmax_topk(jax.random.normal(jax.random.key(7), (t, e)), k)
  return jnp.bincount(ids.reshape(-1), length=e).astype(jnp.int32)
CASES = [  # name, T, k, E, K, N, gated
  ("gpt-oss gated", 8192, 4, 128, 2880, 2880, True),
  ("gpt-oss down", 8192, 4, 128, 2880, 2880, False),
  ("qwen3 gated", 8192, 8, 128, 2048, 768, True),
  ("qwen3 down", 8192, 8, 128, 768, 2048, False),
]
PLAIN = {"128x256n": Config(block_m=128, block_n=256, wg_split="n", stages=4),
         "128x192m": Config(block_m=128, block_n=192, wg_split="m", stages=5),
         "128x128m": Config(block_m=128, block_n=128, wg_split="m", stages=6),
         "64x256n": Config(block_m=64, block_n=256, wg_split="n", stages=6)}
GATED = {"128x128m": Config(block_m=128, block_n=128, wg_split="m", stages=4),
         "64x128n": Config(block_m=64, block_n=128, wg_split="n", stages=6),
         "128x64m": Config(block_m=128, block_n=64, wg_split="m", stages=6)}
only = sys.argv[1:] or None
for name, t, k, e, kk, n, gated in CASES:
  if only and not any(o in name for o in only):
    continue
  r = t * k
  for uniform in (False, True):
    gs = sizes(t, e, k, uniform)
    keys = jax.random.split(jax.random.key(1), 4)
    ncols = 2 * n if gated else n
    x = jax.random.normal(keys[0], (r, kk), B)
    w = (jax.random.normal(keys[1], (e, kk, ncols), jnp.float32) * 0.02).astype(B)
    fns = {"dense": jax.jit(lambda x, w, gs: jnp.dot(x, w[0]))}
    cfgs = GATED if gated else PLAIN
    dflt = default_config(r, ncols if not gated else n, kk, e, gated=gated)
    print(f"-- {name} R={r} K={kk} N={ncols} {'uniform' if uniform else 'routed'} sizes"
          f" (min {int(gs.min())}, max {int(gs.max())}); default {dflt}", flush=True)
    for c, cfg in cfgs.items():
      if gated:
        fns[c] = jax.jit(lambda x, w, gs, cfg=cfg: mf.gated_forward(x, w, gs, activation="silu", config=cfg)[0])
      else:
        fns[c] = jax.jit(lambda x, w, gs, cfg=cfg: mf.forward(x, w, gs, config=cfg))
    ok = {}
    for c, f in list(fns.items()):
      try:
        jax.block_until_ready(f(x, w, gs))
      except Exception as ex:
        print(f"   {c}: failed {type(ex).__name__}: {str(ex)[:150]}")
        del fns[c]
    times = rounds_ms(Timer(), fns, [(x, w, gs)], rounds=5, calls=10)
    flops = 2 * r * kk * ncols
    for c in fns:
      ms = statistics.median(times[c])
      rr = ratio_stats(times["dense"], times[c])
      print(f"   {c:10s} {ms:.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  dense/this {rr.median:.3f} ±{rr.spread:.3f}", flush=True)
