"""The grouped forward kernel at gpt-oss-like shapes (N = 2880 = 11.25 x 256 = 15 x 192):
128x256 tiles (the default) against 128x192 and 128x128, CUPTI, rounds in turns; outputs
compared bit for bit. PYTHONPATH=. ; prints a table."""
import statistics
import jax, jax.numpy as jnp
import numpy as np
from benchmarks.timing import Timer, ratio_stats, rounds_ms
from pallas_gemm import ragged_dot
from pallas_gemm.grouped import config as gconfig

G = 128
for name, m, k, n in (("down, gpt-oss-like", 32768, 2880, 2880), ("Qwen3 N=2048 control", 65536, 768, 2048)):
  key = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key[0], (m, k), jnp.bfloat16)
  w = (jax.random.normal(key[1], (G, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  p = np.random.default_rng(0).dirichlet(np.ones(G) * 8)
  sizes = np.random.default_rng(1).multinomial(m, p).astype(np.int32)
  sizes = jnp.asarray(sizes)
  base = gconfig.default_config(m, n, k, G)
  cfgs = {"default " + f"{base.block_m}x{base.block_n}": base,
          "128x192": gconfig.Config(block_m=128, block_n=192, block_k=64, stages=4, num_compute_wgs=2,
                                    wg_split="m", epi_slots=3),
          "128x128": gconfig.Config(block_m=128, block_n=128, block_k=64, stages=4, num_compute_wgs=2,
                                    wg_split="m")}
  fns = {}
  for label, c in cfgs.items():
    try:
      fns[label] = jax.jit(lambda a, b, s, c=c: ragged_dot(a, b, s, config=c, backend="mosaic"))
      fns[label](x, w, sizes).block_until_ready()
    except Exception as e:
      print(f"{name} {label}: fails: {str(e)[:300]}", flush=True); fns.pop(label, None)
  outs = {l: f(x, w, sizes) for l, f in fns.items()}
  first = list(outs)[0]
  t = rounds_ms(Timer(), {l: f for l, f in fns.items()}, [(x, w, sizes)], 7, 10)
  flops = 2 * m * k * n
  for l in fns:
    r = ratio_stats(t[first], t[l])
    print(f"{name} {l}: {statistics.median(t[l]) * 1e3:.1f} us, {flops / statistics.median(t[l]) / 1e9:.0f}"
          f" TFLOP/s, {r.median:.3f}x ±{r.spread:.3f} the default; equal: {bool(jnp.array_equal(outs[l], outs[first]))}",
          flush=True)
