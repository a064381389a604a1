"""Grouped kernels' tile walk: plgpu.planar_snake's (minor_dim, tile_width) over the
(items, column tiles) space, patched in while tracing; CUPTI, rotated rounds x 10 calls.
minor 1: bands of w column tiles, items in row order within a band (the kernels' order);
minor 0: bands of w items (row tiles), the columns swept within a band."""
import statistics, sys
import jax, jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from benchmarks.timing import Timer, rounds_ms
from pallas_gemm.fp8 import quantize, mosaic_ragged
from pallas_gemm.grouped import mosaic_forward

orig = plgpu.planar_snake
ORDERS = [(1, 8), (1, 16), (1, 4), (0, 4), (0, 8), (0, 16), (0, 32)]

def patched(order):
  def snake(lin, shape, minor, width):
    return orig(lin, shape, order[0], order[1])
  return snake

for spec in sys.argv[1].split(","):
  kind, dims = spec.split(":")
  m, n, k, g = (int(v) for v in dims.split("x"))
  kx, kw = jax.random.split(jax.random.key(0))
  sizes = jnp.full((g,), m // g, jnp.int32)
  if kind == "fp8":
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (g, n, k), jnp.bfloat16)
    a8, sa = quantize(x)
    w8, sw = quantize(w, block_shape=(128, 128))
    args = (a8, w8, sizes, sa, sw)
    fn = lambda a, b, gs, s1, s2: mosaic_ragged.ragged_gemm(a, b, gs, s1, s2)
  else:
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (g, k, n), jnp.bfloat16)
    args = (x, w, sizes)
    fn = lambda a, b, gs: mosaic_forward.forward(a, b, gs, out_dtype=jnp.bfloat16)
  progs = {}
  for order in ORDERS:
    plgpu.planar_snake = patched(order)
    try:
      progs[order] = jax.jit(fn).lower(*args).compile()
    finally:
      plgpu.planar_snake = orig
  outs = {o: jax.block_until_ready(p(*args)) for o, p in progs.items()}
  ref = outs[ORDERS[0]]
  same = all(bool((v == ref).all()) for v in outs.values())
  bound = {o: (lambda p=p: p(*args)) for o, p in progs.items()}
  t = rounds_ms(Timer(), bound, [()], 5, 10)
  base = t[ORDERS[0]]
  parts = []
  for o, v in t.items():
    r = sorted(b / x for b, x in zip(base, v))
    parts.append(f"{o}: {statistics.median(v):.4f} ms {2 * m * n * k / statistics.median(v) / 1e9:.0f} TF/s x{statistics.median(r):.3f}")
  print(f"{spec} (bit-equal {same}): " + "; ".join(parts), flush=True)
