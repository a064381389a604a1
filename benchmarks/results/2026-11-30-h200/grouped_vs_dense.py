"""The block-scaled fp8 grouped kernel against the dense one at the same product: M rows
in G groups (G = 1: one group, the dense product) against scaled_gemm with 128x128 tiles
(the grouped kernel's) and with its default tiles; CUPTI, rotated rounds x 10 calls."""
import statistics, sys
import jax, jax.numpy as jnp
from benchmarks.timing import Timer, rounds_ms
from pallas_gemm.fp8 import quantize, mosaic_gemm, mosaic_ragged
from pallas_gemm.fp8.config import Config

for spec in sys.argv[1].split(","):
  m, n, k, g = (int(v) for v in spec.split("x"))
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (n, k), jnp.bfloat16)
  a8, sa = quantize(x)
  b8, sb = quantize(w, block_shape=(128, 128))
  sizes = jnp.full((g,), m // g, jnp.int32)
  wg8 = jnp.broadcast_to(b8[None], (g, n, k)).copy()
  sg = jnp.broadcast_to(sb[None], (g,) + sb.shape).copy()
  c128 = Config(block_m=128, block_n=128, stages=5, epi_block_n=64)
  progs = {
      "dense default": (jax.jit(lambda a, b, s1, s2: mosaic_gemm.scaled_gemm(a[None], b[None], s1[None], s2[None])), (a8, b8, sa, sb)),
      "dense 128x128 s5": (jax.jit(lambda a, b, s1, s2: mosaic_gemm.scaled_gemm(a[None], b[None], s1[None], s2[None], config=c128)), (a8, b8, sa, sb)),
      f"grouped G={g}": (jax.jit(lambda a, b, gs, s1, s2: mosaic_ragged.ragged_gemm(a, b, gs, s1, s2)), (a8, wg8, sizes, sa, sg)),
  }
  outs = {kk: jax.block_until_ready(f(*a)) for kk, (f, a) in progs.items()}
  o = [v.reshape(m, n).astype(jnp.float32) for v in outs.values()]
  same = [float(jnp.max(jnp.abs(o[0] - v))) for v in o[1:]]
  bound = {kk: (lambda f=f, a=a: f(*a)) for kk, (f, a) in progs.items()}
  t = rounds_ms(Timer(), bound, [()], 7, 10)
  base = t["dense default"]
  line = []
  for kk, v in t.items():
    r = sorted(b / x for b, x in zip(base, v))
    line.append(f"{kk} {statistics.median(v):.4f} ms ({2 * m * n * k / statistics.median(v) / 1e9:.0f} TFLOP/s, x dense default {statistics.median(r):.3f})")
  print(f"{spec}: " + "; ".join(line) + f"; max |diff| vs dense default {same}", flush=True)
