"""Grouped forward: the kernel before / after the idle-warpgroup skip, routed sizes."""
import importlib.util, statistics, sys
import jax, jax.numpy as jnp
from benchmarks.timing import Timer, rounds_ms, ratio_stats
from pallas_gemm.grouped import mosaic_forward as new
from pallas_gemm.grouped.config import Config
from pallas_gemm.moe import softmax_topk
spec = importlib.util.spec_from_file_location("old_mosaic_forward", "build/ab/old_mosaic_forward.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_mosaic_forward"] = old; spec.loader.exec_module(old)
print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
B = jnp.bfloat16
CASES = [("gpt-oss gated", 8192, 4, 128, 2880, 2880, True), ("gpt-oss down", 8192, 4, 128, 2880, 2880, False),
         ("qwen3 gated", 8192, 8, 128, 2048, 768, True), ("qwen3 down", 8192, 8, 128, 768, 2048, False),
         ("mixtral gated", 8192, 2, 8, 4096, 14336, True), ("mixtral down", 8192, 2, 8, 14336, 4096, False),
         ("deepseek gated", 8192, 8, 256, 7168, 2048, True), ("deepseek down", 8192, 8, 256, 2048, 7168, False)]
G128 = Config(block_m=128, block_n=128, wg_split="m", stages=4)
N256 = Config(block_m=128, block_n=256, wg_split="n", stages=4)
M256 = Config(block_m=128, block_n=256, wg_split="m", stages=4)
for name, t, k, e, kk, n, gated in CASES:
  r = t * k
  _, ids = softmax_topk(jax.random.normal(jax.random.key(7), (t, e)), k)
  gs = jnp.bincount(ids.reshape(-1), length=e).astype(jnp.int32)
  keys = jax.random.split(jax.random.key(1), 4)
  ncols = 2 * n if gated else n
  x = jax.random.normal(keys[0], (r, kk), B)
  w = (jax.random.normal(keys[1], (e, kk, ncols), jnp.float32) * 0.02).astype(B)
  if gated:
    fns = {f"{m}": jax.jit(lambda x, w, gs, mod=mod: mod.gated_forward(x, w, gs, activation="silu", config=G128)[0])
           for m, mod in (("before", old), ("after", new))}
  else:
    fns = {"before 256n": jax.jit(lambda x, w, gs: old.forward(x, w, gs, config=N256)),
           "after 256n": jax.jit(lambda x, w, gs: new.forward(x, w, gs, config=N256)),
           "after 256m": jax.jit(lambda x, w, gs: new.forward(x, w, gs, config=M256))}
  fns["dense"] = jax.jit(lambda x, w, gs: jnp.dot(x, w[0]))
  outs = {c: f(x, w, gs) for c, f in fns.items()}
  base = [c for c in fns if c.startswith("before")][0]
  same = {c: bool(jnp.array_equal(outs[c], outs[base])) for c in fns if c != "dense"}
  times = rounds_ms(Timer(), fns, [(x, w, gs)], rounds=7, calls=10)
  flops = 2 * r * kk * ncols
  print(f"-- {name} R={r} K={kk} N={ncols} sizes {int(gs.min())}-{int(gs.max())}; equal to {base}: {same}", flush=True)
  for c in fns:
    ms = statistics.median(times[c])
    rb, rd = ratio_stats(times[base], times[c]), ratio_stats(times["dense"], times[c])
    print(f"   {c:12s} {ms:.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  x {base} {rb.median:.3f} ±{rb.spread:.3f}"
          f"  x dense {rd.median:.3f} ±{rd.spread:.3f}", flush=True)
