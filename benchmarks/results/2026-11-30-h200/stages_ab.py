"""The fp8 grouped kernels' ring depth: 6 stages with one epilogue slot per warpgroup (the
shared memory 5 stages and two slots take) against the defaults (5 stages, two slots) and
5 stages with one slot; patched in while tracing. CUPTI, rotated rounds x 10 calls; the
outputs of every form compared bit for bit with the default's."""
import statistics, sys
import jax, jax.numpy as jnp
from benchmarks.timing import Timer, rounds_ms
from pallas_gemm import fp8 as fp8_ops
from pallas_gemm.fp8 import quantize, mosaic_ragged, mosaic_gated
from pallas_gemm.fp8.config import Config

FORMS = {"5 stages, 2 slots": (5, 2), "6 stages, 1 slot": (6, 1), "5 stages, 1 slot": (5, 1)}
saved = (mosaic_ragged._epi_slots, mosaic_ragged.check, mosaic_gated.tiles, mosaic_gated.OUT_SLOTS)

def patch(stages, slots):
  mosaic_ragged._epi_slots = lambda cfg: slots
  mosaic_ragged.check = lambda *a, **k: None
  mosaic_gated.tiles = lambda m, g: (128, stages)
  mosaic_gated.OUT_SLOTS = slots

def restore():
  (mosaic_ragged._epi_slots, mosaic_ragged.check, mosaic_gated.tiles, mosaic_gated.OUT_SLOTS) = saved

for spec in sys.argv[1].split(","):
  kind, dims = spec.split(":")
  m, n, k, g = (int(v) for v in dims.split("x"))  # gated: n = 2F
  kx, kw = jax.random.split(jax.random.key(0))
  a8, sa = quantize(jax.random.normal(kx, (m, k), jnp.bfloat16))
  w8, sw = quantize(jax.random.normal(kw, (g, n, k), jnp.bfloat16), block_shape=(128, 128))
  sizes = jnp.full((g,), m // g, jnp.int32)
  args = (a8, w8, sizes, sa, sw)
  progs = {}
  for name, (stages, slots) in FORMS.items():
    if kind == "ragged":
      cfg = Config(block_m=128, block_n=128, stages=stages, epi_block_n=64)
      fn = lambda a, b, gs, s1, s2, cfg=cfg: mosaic_ragged.ragged_gemm(a, b, gs, s1, s2, config=cfg)
    else:
      fn = lambda a, b, gs, s1, s2: fp8_ops.gated_quantized(a, b, gs, s1, s2, "silu", backend="mosaic")
    patch(stages, slots)
    try:
      progs[name] = jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001
      print(f"{spec} {name}: failed to build: {type(e).__name__}: {str(e)[:300]}", flush=True)
    finally:
      restore()
  outs = {n_: jax.block_until_ready(p(*args)) for n_, p in progs.items()}
  ref = jax.tree.leaves(outs["5 stages, 2 slots"])
  same = {n_: all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(o), ref)) for n_, o in outs.items()}
  bound = {n_: (lambda p=p: p(*args)) for n_, p in progs.items()}
  t = rounds_ms(Timer(), bound, [()], 7, 10)
  base = t["5 stages, 2 slots"]
  parts = []
  for n_, v in t.items():
    r = sorted(b / x for b, x in zip(base, v))
    q = statistics.quantiles(r, n=4)
    parts.append(f"{n_}: {statistics.median(v):.4f} ms {2 * m * n * k / statistics.median(v) / 1e9:.0f} TF/s"
                 f" x{statistics.median(r):.3f} +-{(q[2] - q[0]) / 2:.3f} equal {same[n_]}")
  print(f"{spec}: " + "; ".join(parts), flush=True)
