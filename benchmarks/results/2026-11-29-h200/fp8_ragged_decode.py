"""fp8 grouped kernel (scaled_ragged_dot's) at decode shapes: tiles and ring depth."""
import statistics, sys
import jax, jax.numpy as jnp
from benchmarks.timing import Timer, rounds_ms, ratio_stats
from pallas_gemm.fp8 import mosaic_ragged as mr
from pallas_gemm.fp8.config import Config
from pallas_gemm.moe import softmax_topk
print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
E4M3 = jnp.float8_e4m3fn
CASES = [("decode qwen3 down", 128, 8, 128, 768, 2048), ("decode deepseek down", 128, 8, 256, 2048, 7168),
         ("decode qwen3 gate_up", 128, 8, 128, 2048, 1536)]
CFGS = {"128x128 s5 (default)": Config(block_m=128, block_n=128, stages=5),
        "128x64 s8": Config(block_m=128, block_n=64, stages=8),
        "64x128 1wg s8": Config(block_m=64, block_n=128, stages=8, num_compute_wgs=1),
        "64x64 1wg s10": Config(block_m=64, block_n=64, stages=10, num_compute_wgs=1)}
for name, t, k, e, kk, n in CASES:
  r = t * k
  _, ids = softmax_topk(jax.random.normal(jax.random.key(7), (t, e)), k)
  gs = jnp.bincount(ids.reshape(-1), length=e).astype(jnp.int32)
  keys = jax.random.split(jax.random.key(1), 4)
  x = jax.random.normal(keys[0], (r, kk), jnp.float32).astype(E4M3)
  w = jax.random.normal(keys[1], (e, n, kk), jnp.float32).astype(E4M3)
  sx = jnp.exp2(jax.random.randint(keys[2], (r, kk // 128), -3, 3).astype(jnp.float32))
  sw = jnp.exp2(jax.random.randint(keys[3], (e, -(-n // 128), kk // 128), -3, 3).astype(jnp.float32))
  fns = {}
  for c, cfg in CFGS.items():
    f = jax.jit(lambda x, w, gs, sx, sw, cfg=cfg: mr.ragged_gemm(x, w, gs, sx, sw, config=cfg))
    try:
      jax.block_until_ready(f(x, w, gs, sx, sw)); fns[c] = f
    except Exception as ex:
      print(f"   {c}: failed {type(ex).__name__}: {str(ex)[:160]}", flush=True)
  base = list(fns)[0]
  ref = fns[base](x, w, gs, sx, sw)
  same = {c: bool(jnp.array_equal(f(x, w, gs, sx, sw), ref)) for c, f in fns.items()}
  times = rounds_ms(Timer(), fns, [(x, w, gs, sx, sw)], rounds=7, calls=20)
  wbytes = e * n * kk  # fp8 weights, every expert touched at decode
  print(f"-- {name}: R={r} K={kk} N={n} G={e}, sizes {int(gs.min())}-{int(gs.max())}; equal to {base}: {same}", flush=True)
  for c in fns:
    ms = statistics.median(times[c]); rb = ratio_stats(times[base], times[c])
    print(f"   {c:22s} {ms * 1e3:7.1f} us  weights {wbytes / ms / 1e9:5.2f} TB/s  x default {rb.median:.3f} ±{rb.spread:.3f}", flush=True)
