"""Grouped forward at routed sizes: 128-row tiles (default) vs 64-row tiles."""
import statistics, sys
import jax, jax.numpy as jnp
from benchmarks.timing import Timer, rounds_ms, ratio_stats
from pallas_gemm.grouped import mosaic_forward as mf
from pallas_gemm.grouped.config import Config, smem_bytes
from pallas_gemm.mgpu.tiles import deepest_ring
from pallas_gemm.moe import softmax_topk
print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
B = jnp.bfloat16
CASES = [("gpt-oss gated", 8192, 4, 128, 2880, 2880, True), ("gpt-oss down", 8192, 4, 128, 2880, 2880, False),
         ("deepseek gated", 8192, 8, 256, 7168, 2048, True), ("deepseek down", 8192, 8, 256, 2048, 7168, False),
         ("qwen3 gated", 8192, 8, 128, 2048, 768, True), ("qwen3 down", 8192, 8, 128, 768, 2048, False)]
def ring(cfg, gated):
  b = (cfg.block_k, 2 * cfg.block_n) if gated else (cfg.block_k, cfg.block_n)
  return deepest_ring(cfg.replace(stages=8), lambda c: smem_bytes(c, a_tile=(c.block_m, c.block_k), b_tile=b, dtype=B, out_dtype=B))
for name, t, k, e, kk, n, gated in CASES:
  r = t * k
  _, ids = softmax_topk(jax.random.normal(jax.random.key(7), (t, e)), k)
  gs = jnp.bincount(ids.reshape(-1), length=e).astype(jnp.int32)
  keys = jax.random.split(jax.random.key(1), 4)
  ncols = 2 * n if gated else n
  x = jax.random.normal(keys[0], (r, kk), B)
  w = (jax.random.normal(keys[1], (e, kk, ncols), jnp.float32) * 0.02).astype(B)
  if gated:
    cfgs = {"128x128m": Config(block_m=128, block_n=128, wg_split="m", stages=4),
            "64x128n": ring(Config(block_m=64, block_n=128, wg_split="n"), True)}
    fns = {c: jax.jit(lambda x, w, gs, cfg=cfg: mf.gated_forward(x, w, gs, activation="silu", config=cfg)[0]) for c, cfg in cfgs.items()}
  else:
    cfgs = {"128x256n": Config(block_m=128, block_n=256, wg_split="n", stages=4),
            "64x256n": ring(Config(block_m=64, block_n=256, wg_split="n"), False)}
    fns = {c: jax.jit(lambda x, w, gs, cfg=cfg: mf.forward(x, w, gs, config=cfg)) for c, cfg in cfgs.items()}
  fns["dense"] = jax.jit(lambda x, w, gs: jnp.dot(x, w[0]))
  outs = {c: fns[c](x, w, gs) for c in cfgs}
  a, b = list(outs.values())
  diff = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
  times = rounds_ms(Timer(), fns, [(x, w, gs)], rounds=7, calls=10)
  base = list(cfgs)[0]
  print(f"-- {name} R={r} K={kk} N={ncols} sizes {int(gs.min())}-{int(gs.max())}; max |diff| {diff:.2e}; {cfgs}", flush=True)
  for c in fns:
    ms = statistics.median(times[c])
    rb, rd = ratio_stats(times[base], times[c]), ratio_stats(times["dense"], times[c])
    print(f"   {c:10s} {ms:.3f} ms {2 * r * kk * ncols / ms / 1e9:5.0f} TFLOP/s  x {base} {rb.median:.3f} ±{rb.spread:.3f}"
          f"  x dense {rd.median:.3f} ±{rd.spread:.3f}", flush=True)
