"""The fp8 Mosaic GPU kernel (pallas_gemm/fp8/mosaic_gemm.py), called directly.

Config validation, every scale layout the kernel reads, fp8 dtypes and their edges
(saturated values, NaN / Inf, blocks of zeros, scales over 2^-20..2^20), ragged and
batched shapes, against the float64 product of the dequantized operands. On the CPU in
interpret mode (small shapes), lowered for CUDA at the real tiles, and on the GPU at
real sizes with NaN-poisoned outputs. The front door's suite is test_scaled_matmul.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_gemm.testing.reference import relative_error, scaled_reference, tolerance
from pallas_gemm.fp8 import config as fp8_config
from pallas_gemm.fp8 import mosaic_gemm as mosaic

Config = fp8_config.Config
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_m=96, num_compute_wgs=1), "block_m"),  # not 64-row wgmma
    (dict(block_n=264, wg_split="m"), "block_n"),  # > 256
    (dict(block_n=132, wg_split="m", epi_block_n=16), "block_n"),  # not a multiple of 8
    (dict(stages=0), "stages"),
    (dict(stages=1, wgmma_wait=1), "stages"),
    (dict(num_compute_wgs=3), "num_compute_wgs"),
    (dict(wg_split="k"), "wg_split"),
    (dict(grid_minor_dim="x"), "grid_minor_dim"),
    (dict(grid_tile_width=0), "grid_tile_width"),
    (dict(epi_block_m=32), "epi_block_m"),
    (dict(epi_block_n=24), "epi_block_n"),
    (dict(wgmma_wait=2), "wgmma_wait"),
    (dict(fast_accumulation=1), "fast_accumulation"),
    (dict(num_sms=0), "num_sms"),
    (dict(cluster_m=3), "cluster_m"),
    (dict(cluster_m=2, cluster_n=2), "cluster_n"),
    (dict(cluster_n=2, num_sms=1), "num_sms"),
])
def test_config_rejects_invalid_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    Config(**kwargs)


def test_config_is_frozen_and_keyword_only():
  cfg = Config()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.block_m = 64  # type: ignore[misc]
  with pytest.raises(TypeError):
    Config(128)  # type: ignore[misc]


def test_check_names_registers_and_shared_memory():
  # 128x128 per warpgroup: 128 + 128 accumulator registers in the promoted loop.
  wide = Config(block_m=128, block_n=256, wg_split="n", stages=3)
  fp8_config.check(wide, jnp.bfloat16, promoted=False)
  with pytest.raises(ValueError, match="registers"):
    fp8_config.check(wide, jnp.bfloat16, promoted=True)
  deep = Config(block_m=128, block_n=128, stages=8)
  with pytest.raises(ValueError, match="232448"):
    fp8_config.check(deep, jnp.float32, promoted=True, row_scales=True)
  # Per-column step scales add the (wg_block_n,) vector: 96 + 96 + 48 for 64x192.
  tile192 = Config(block_m=128, block_n=192, stages=4)
  fp8_config.check(tile192, jnp.bfloat16, promoted=True, row_scales=True)
  with pytest.raises(ValueError, match="48 for the step's per-column scales"):
    fp8_config.check(tile192, jnp.bfloat16, promoted=True, row_scales=True,
                     column_scales=True)


@pytest.mark.parametrize("m", [1, 64, 4096, 8192])
@pytest.mark.parametrize("promoted, step_scales, column_scales", [
    (True, True, False), (True, True, True), (True, False, False), (False, False, False)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_default_configs_fit(m, promoted, step_scales, column_scales, out_dtype):
  cfg = fp8_config.default_config(m, 8192, 4096, out_dtype=out_dtype, promoted=promoted,
                                  step_scales=step_scales, column_scales=column_scales)
  fp8_config.check(cfg, out_dtype, promoted=promoted, row_scales=promoted,
                   column_scales=column_scales)


@pytest.mark.parametrize("m, n, step_scales, column_scales, tile", [
    (4096, 4096, True, False, (128, 192)),    # block scales: 128x192 wherever N allows
    (4096, 7168, True, False, (128, 192)),
    (4096, 200, True, False, (128, 128)),     # 192-wide would compute 384 of 200 columns
    (4096, 4096, False, False, (128, 176)),   # constant scales: 128x192 from ~11 waves,
    (4096, 7168, False, False, (128, 176)),   # 128x176 below that
    (8192, 8192, False, False, (128, 192)),
    (4096, 24576, False, False, (128, 192)),
    (4096, 768, False, False, (128, 128)),    # 176-wide would compute 880 of 768 columns
    (4097, 4096, False, False, (128, 176)),   # a bf16 output by the single-row view
    (16384, 4096, True, True, (128, 128)),    # per-column steps: their vector's registers
    (4096, 16384, True, True, (128, 128)),
])
def test_default_tiles(m, n, step_scales, column_scales, tile):
  cfg = fp8_config.default_config(m, n, 4096, out_dtype=jnp.bfloat16, promoted=True,
                                  step_scales=step_scales, column_scales=column_scales)
  assert (cfg.block_m, cfg.block_n) == tile
  fp8_config.check(cfg, jnp.bfloat16, promoted=True, row_scales=step_scales,
                   column_scales=column_scales)


def test_default_tiles_float32_rows_by_row():
  # A float32 output whose rows 8 does not divide keeps 128x128 with constant scales.
  def tile(m):
    cfg = fp8_config.default_config(m, 4096, 4096, out_dtype=jnp.float32, promoted=True,
                                    step_scales=False)
    return cfg.block_m, cfg.block_n

  assert tile(4096) == (128, 176)
  assert tile(4097) == (128, 128)


# ----------------------------------------------------------------------------
# Inputs and the check
# ----------------------------------------------------------------------------


def _scales(rng, kind, batch, rows, k, exps):
  """f32 scales of one operand: 2^e * u, e uniform in exps, u in [1, 2)."""
  kb = -(-k // 128)
  shape = {"tensor": (batch, 1, 1), "row": (batch, rows, 1), "step": (batch, rows, kb),
           "block": (batch, -(-rows // 128), kb)}[kind]
  e = rng.integers(exps[0], exps[1] + 1, shape)
  return jnp.asarray(np.ldexp(rng.uniform(1, 2, shape), e), jnp.float32)


def _expanded(s, rows, k):
  """Scales repeated to one per element (rows, k): blocks of 128 (the last partial)."""
  s = np.asarray(s, np.float64)
  if s.shape[1] not in (1, rows):
    s = np.repeat(s, 128, axis=1)[:, :rows]
  if s.shape[2] not in (1, k):
    s = np.repeat(s, 128, axis=2)[:, :, :k]
  return np.broadcast_to(s, (s.shape[0], rows, k))


def _operand(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def _check(rng, batch, m, n, k, *, lhs_kind="step", rhs_kind="block", dtypes=(E4M3, E4M3),
           out_dtype=jnp.float32, config=None, exps=None, batch_r=None, edit=None,
           interpret=True):
  """scaled_gemm against float64; edit(lhs, rhs) may change the operands (numpy f32).

  exps: the scales' exponent range; by default (-4, 4), and (-4, 0) for float16
  results: a sum of K products of N(0, 1) values reaches ~5 sqrt(K) (226 at K = 2048),
  and two scales of up to 2^5 each would carry it past float16's largest 65504."""
  if exps is None:
    exps = (-4, 0) if jnp.dtype(out_dtype) == jnp.float16 else (-4, 4)
  batch_r = batch if batch_r is None else batch_r
  lhs = _operand(rng, (batch, m, k), dtypes[0])
  rhs = _operand(rng, (batch_r, n, k), dtypes[1])
  if edit is not None:
    lhs, rhs = (jnp.asarray(x, d) for x, d in zip(
        edit(np.asarray(lhs, np.float32), np.asarray(rhs, np.float32)), dtypes))
  ls = _scales(rng, lhs_kind, batch, m, k, exps)
  rs = _scales(rng, rhs_kind, batch_r, n, k, exps)
  if config is None and interpret:
    # The kernel's default: promoted, for constant scales too.
    config = mosaic.default_config_for(m, n, k, out_dtype, lhs_kind, rhs_kind)
    config = config.replace(num_sms=3)
  if not interpret:  # a NaN block freed last, so that the output likely reuses it
    nbytes = batch * m * n * jnp.dtype(out_dtype).itemsize
    jnp.full((nbytes // 4 + 1,), jnp.nan, jnp.float32).block_until_ready().delete()
  out = mosaic.scaled_gemm(lhs, rhs, ls, rs, out_dtype=out_dtype, config=config,
                           interpret=interpret)
  assert out.shape == (batch, m, n) and out.dtype == jnp.dtype(out_dtype)
  if k % 128 == 0:  # blocks along K are K // K_b long: the reference's own convention
    ref = scaled_reference(lhs, rhs, ls, rs)
  else:  # a partial last block: scales expanded per element
    ref = scaled_reference(lhs, rhs, _expanded(ls, m, k), _expanded(rs, n, k))
  ref = np.broadcast_to(ref, (batch, m, n)) if not hasattr(ref, "devices") else ref
  finite = np.abs(np.asarray(ref))[np.isfinite(ref)]
  assert finite.size == 0 or finite.max() <= jnp.finfo(out_dtype).max, (
      "the inputs' true product does not fit the output dtype: draw smaller scales")
  err = relative_error(out.astype(jnp.float32), ref)
  fast = (lhs_kind != "step" and rhs_kind not in ("step", "block")
          and config is not None and config.fast_accumulation)
  bound = tolerance(dtypes[0], "fast_accumulation" if fast and not interpret else None,
                    k, out_dtype)
  assert err <= bound, (err, bound, config)
  return out


# ----------------------------------------------------------------------------
# Interpret mode (CPU)
# ----------------------------------------------------------------------------

LHS_KINDS = ["step", "row", "tensor"]
RHS_KINDS = ["step", "block", "row", "tensor"]


@pytest.mark.parametrize("lhs_kind", LHS_KINDS)
@pytest.mark.parametrize("rhs_kind", RHS_KINDS)
def test_every_scale_layout(rng, lhs_kind, rhs_kind):
  # ragged M, N and K (a partial last scale block), two batch entries
  _check(rng, 2, 72, 136, 300, lhs_kind=lhs_kind, rhs_kind=rhs_kind)


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2), (E5M2, E4M3)],
                         ids=["e4m3", "e5m2", "e4m3xe5m2", "e5m2xe4m3"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dtypes(rng, dtypes, out_dtype):
  _check(rng, 1, 64, 128, 256, dtypes=dtypes, out_dtype=out_dtype)


def test_scales_across_2_pow_20_and_zero_blocks(rng):
  def zero_blocks(lhs, rhs):
    lhs[:, :, 128:256] = 0  # a whole K block of lhs
    rhs[:, 64:, 256:] = 0   # part of rhs
    return lhs, rhs

  _check(rng, 1, 72, 192, 384, exps=(-20, 20), edit=zero_blocks)
  _check(rng, 1, 72, 192, 384, rhs_kind="step", exps=(-20, 20), edit=zero_blocks)


@pytest.mark.parametrize("dtypes, top", [((E4M3, E4M3), 448.0), ((E5M2, E5M2), 57344.0)],
                         ids=["e4m3", "e5m2"])
def test_saturated_values(rng, dtypes, top):
  def saturate(lhs, rhs):
    return np.where(lhs > 0, top, -top), np.where(rhs > 0.5, top, rhs)

  _check(rng, 1, 64, 128, 256, dtypes=dtypes, edit=saturate)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf * 0 on the host
@pytest.mark.parametrize("dtypes, bad", [((E4M3, E4M3), np.nan), ((E5M2, E5M2), np.inf),
                                         ((E5M2, E4M3), -np.inf)], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("lhs_kind, rhs_kind", [("step", "block"), ("tensor", "tensor")])
def test_nan_and_inf_propagate(rng, dtypes, bad, lhs_kind, rhs_kind):
  def plant(lhs, rhs):
    lhs[0, 3, 200] = bad  # row 3 of the output: NaN, or +-inf (NaN where rhs is 0)
    if np.isnan(bad):
      rhs[0, 5, 17] = np.nan  # column 5: NaN
    else:
      rhs[0, 5, 200] = 0.0  # (3, 5): inf * 0 = NaN
    return lhs, rhs

  out = _check(rng, 1, 64, 128, 256, dtypes=dtypes, lhs_kind=lhs_kind, rhs_kind=rhs_kind,
               edit=plant)
  assert not np.isfinite(np.asarray(out[0, 3])).any()
  assert np.isfinite(np.asarray(out[0, 4])).all() == (not np.isnan(bad))


def test_shared_rhs_batch(rng):
  _check(rng, 3, 64, 72, 256, batch_r=1)
  _check(rng, 2, 64, 72, 256, batch_r=1, lhs_kind="tensor", rhs_kind="row")


@pytest.mark.parametrize("m, n, k", [(1, 8, 16), (7, 130, 32), (65, 200, 128), (200, 72, 1000)])
def test_ragged_and_short(rng, m, n, k):
  _check(rng, 1, m, n, k)


@pytest.mark.parametrize("config, rhs_kind", [
    # several tiles per CTA: the ring wraps across tiles
    (Config(block_m=64, block_n=128, wg_split="n", stages=3, num_sms=2), "block"),
    # one consumer warpgroup
    (Config(block_m=64, block_n=128, num_compute_wgs=1, stages=2, num_sms=3), "block"),
    # 96-column warpgroups straddle 128-column scale blocks: three 32-column pieces
    (Config(block_m=64, block_n=192, wg_split="n", stages=2, epi_block_n=32, num_sms=3),
     "block"),
    # 192-column warpgroups: three 64-column pieces
    (Config(block_m=128, block_n=192, stages=2, num_sms=3), "block"),
    # 160-column warpgroups: five 32-column pieces, in clusters sharing lhs tiles
    (Config(block_m=128, block_n=160, stages=2, epi_block_n=32, cluster_n=2, num_sms=4),
     "block"),
    # per-column steps with a 256-wide tile split by columns
    (Config(block_m=64, block_n=256, wg_split="n", stages=2, num_sms=3), "step"),
    # clusters sharing rhs tiles, an odd tile count (the last pair's second CTA idles)
    (Config(block_m=64, block_n=128, wg_split="n", stages=3, cluster_m=2, num_sms=4),
     "block"),
    # clusters sharing lhs tiles, per-column steps
    (Config(block_m=64, block_n=128, wg_split="n", stages=2, cluster_n=2, num_sms=4),
     "step"),
], ids=["wrap", "one_wg", "pieces96", "pieces192", "pieces160", "columns", "cluster_m",
        "cluster_n"])
def test_configs_promoted(rng, config, rhs_kind):
  _check(rng, 1, 130, 260, 384, rhs_kind=rhs_kind, config=config)


@pytest.mark.parametrize("config", [
    Config(block_m=128, block_n=256, wg_split="n", stages=2, wgmma_wait=1,
           fast_accumulation=True, num_sms=3),
    Config(block_m=128, block_n=128, stages=3, wgmma_wait=0, fast_accumulation=True,
           num_sms=3),
    Config(block_m=128, block_n=128, stages=3, num_sms=3),  # promoted (the default)
    Config(block_m=128, block_n=192, stages=2, num_sms=3),  # promoted, 3 column pieces
    # promoted, the constant-scale default's width (N = 260: a partial second tile)
    Config(block_m=128, block_n=176, stages=2, epi_block_n=16, num_sms=3),
    Config(block_m=256, block_n=128, stages=2, cluster_n=2, fast_accumulation=True,
           num_sms=4),
], ids=["wait1", "wait0", "promoted", "promoted192", "promoted176", "cluster_n"])
@pytest.mark.parametrize("lhs_kind, rhs_kind", [("tensor", "tensor"), ("row", "row")])
def test_configs_constant_scales(rng, config, lhs_kind, rhs_kind):
  _check(rng, 2, 130, 260, 384, lhs_kind=lhs_kind, rhs_kind=rhs_kind, config=config,
         out_dtype=jnp.bfloat16)


def test_empty():
  e = jnp.zeros((1, 0, 256), E4M3)
  out = mosaic.scaled_gemm(e, jnp.zeros((1, 64, 256), E4M3), jnp.ones((1, 1, 1)),
                           jnp.ones((1, 1, 1)), out_dtype=jnp.bfloat16, interpret=True)
  assert out.shape == (1, 0, 64)
  z = jnp.zeros((1, 8, 0), E4M3)
  out = mosaic.scaled_gemm(z, jnp.zeros((1, 16, 0), E4M3), jnp.ones((1, 1, 1)),
                           jnp.ones((1, 1, 1)), out_dtype=jnp.float32, interpret=True)
  assert out.shape == (1, 8, 16) and not np.asarray(out).any()


@pytest.mark.parametrize("args, error, match", [
    (dict(lhs=jnp.zeros((1, 8, 256), jnp.bfloat16)), TypeError, "lhs.dtype"),
    (dict(rhs=jnp.zeros((8, 256), E4M3)), ValueError, "rhs.shape"),
    (dict(rhs=jnp.zeros((1, 16, 128), E4M3)), ValueError, "K=128"),
    (dict(lhs_scales=jnp.ones((1, 8, 3))), ValueError, "lhs_scales.shape"),
    (dict(rhs_scales=jnp.ones((1, 2, 2))), ValueError, "rhs_scales.shape"),
    (dict(rhs_scales=jnp.ones((1, 1, 1), jnp.bfloat16)), TypeError, "rhs_scales.dtype"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype"),
])
def test_bad_input(args, error, match):
  kwargs = dict(lhs=jnp.zeros((1, 8, 256), E4M3), rhs=jnp.zeros((1, 16, 256), E4M3),
                lhs_scales=jnp.ones((1, 8, 2)), rhs_scales=jnp.ones((1, 1, 2)),
                out_dtype=jnp.float32)
  kwargs.update(args)
  with pytest.raises(error, match=match):
    mosaic.scaled_gemm(kwargs.pop("lhs"), kwargs.pop("rhs"), kwargs.pop("lhs_scales"),
                       kwargs.pop("rhs_scales"), interpret=True, **kwargs)


# ----------------------------------------------------------------------------
# Lowered for CUDA at the real tiles (on the CPU: catches lowering errors)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("m, n, k, lhs_shape, rhs_shape, promoted", [
    (4096, 4096, 4096, (1, 4096, 32), (1, 32, 32), True),     # 1x128 and 128x128 blocks
    (4096, 4096, 4096, (1, 4096, 32), (1, 4096, 32), True),   # 1x128 both
    (4096, 4096, 4096, (1, 1, 1), (1, 1, 1), True),           # per tensor (default)
    (4096, 4096, 4096, (1, 1, 1), (1, 1, 1), False),          # fast accumulation
    (8192, 8192, 8192, (1, 1, 1), (1, 1, 1), True),           # per tensor, 128x192 tiles
    (4096, 7168, 2048, (1, 1, 1), (1, 1, 1), True),           # per tensor, 128x176 tiles
    (4096, 200, 4096, (1, 4096, 32), (1, 2, 32), True),       # N = 200: 128x128 tiles
    (4097, 4095, 4000, (1, 4097, 1), (1, 4095, 1), True),     # per row / column, ragged
    (4097, 4095, 4000, (1, 4097, 1), (1, 4095, 1), False),
    (64, 7168, 2048, (1, 64, 16), (1, 56, 16), True),         # short M
])
def test_lowers_for_cuda(m, n, k, lhs_shape, rhs_shape, promoted):
  cfg = fp8_config.default_config(m, n, k, out_dtype=jnp.bfloat16, promoted=promoted,
                                  step_scales=lhs_shape[2] > 1 or rhs_shape[2] > 1,
                                  column_scales=rhs_shape[1] == n and rhs_shape[2] > 1)
  cfg = cfg.replace(num_sms=132)
  args = (jax.ShapeDtypeStruct((1, m, k), E4M3), jax.ShapeDtypeStruct((1, n, k), E4M3),
          jax.ShapeDtypeStruct(lhs_shape, jnp.float32),
          jax.ShapeDtypeStruct(rhs_shape, jnp.float32))
  _lower(args, cfg)


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_quantize_kernel_lowers_for_cuda(block_rows, x_dtype):
  # 128x128 blocks reduce a whole tile to one amax across the warpgroup's warps.
  from pallas_gemm.fp8 import mosaic_quantize  # noqa: PLC0415
  f = lambda x: mosaic_quantize.quantize_rows(x, E4M3, block_rows=block_rows,  # noqa: E731
                                              num_sms=132)
  text = jax.jit(f).trace(jax.ShapeDtypeStruct((1024, 512), x_dtype)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "pallas_gemm_quantize_fp8" in text


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", ["transposed", "transposed-batched", "transposed-128"])
def test_transposing_quantize_lowers_for_cuda(case, x_dtype):
  # The tile read through a transposed view (the transposed wgmma layout, then a shuffle
  # to the wgmma layout).
  from pallas_gemm.fp8 import mosaic_quantize  # noqa: PLC0415
  f, shape = {
      "transposed": (lambda x: mosaic_quantize.quantize_rows(
          x, E4M3, read_transposed=True, num_sms=132), (512, 1024)),
      "transposed-batched": (lambda x: mosaic_quantize.quantize_rows(
          x, E4M3, read_transposed=True, num_sms=132), (3, 512, 256)),
      "transposed-128": (lambda x: mosaic_quantize.quantize_rows(
          x, E4M3, block_rows=128, read_transposed=True, num_sms=132), (512, 1024)),
  }[case]
  text = jax.jit(f).trace(jax.ShapeDtypeStruct(shape, x_dtype)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "pallas_gemm_quantize_fp8" in text


def _lower(args, config):
  f = lambda *a: mosaic.scaled_gemm(*a, out_dtype=jnp.bfloat16, config=config)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_rows_not_a_multiple_of_8_are_not_copied():
  # 4097 rows of lhs and of the result: loaded and stored through the single-row view, so
  # the program holds neither an 8-row-padded operand (4104 rows) nor a padded result.
  args = (jax.ShapeDtypeStruct((1, 4097, 4096), E4M3), jax.ShapeDtypeStruct((1, 4096, 4096), E4M3),
          jax.ShapeDtypeStruct((1, 4097, 32), jnp.float32),
          jax.ShapeDtypeStruct((1, 32, 32), jnp.float32))
  cfg = mosaic.default_config_for(4097, 4096, 4096, jnp.bfloat16, "step", "block")
  f = lambda *a: mosaic.scaled_gemm(*a, out_dtype=jnp.bfloat16, config=cfg.replace(num_sms=132))
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "4104x" not in text
  assert "tensor<1x4097x4096xbf16>" in text


@pytest.mark.parametrize("config", [
    Config(block_m=128, block_n=192, stages=4, cluster_n=2),   # 96 + 96 registers
    Config(block_m=128, block_n=160, stages=4, epi_block_n=32, cluster_m=2),
    Config(block_m=64, block_n=256, wg_split="n", stages=4),  # 64x128 warpgroups by n
    Config(block_m=128, block_n=128, stages=5, cluster_n=2),
], ids=["128x192", "128x160", "64x256", "128x128cn"])
def test_probe_configs_lower_for_cuda(config):
  # Tiles benchmarks/fp8_kernel_probe.py sweeps: blocks straddling 128-column scale blocks.
  m = n = k = 4096
  args = (jax.ShapeDtypeStruct((1, m, k), E4M3), jax.ShapeDtypeStruct((1, n, k), E4M3),
          jax.ShapeDtypeStruct((1, m, 32), jnp.float32),
          jax.ShapeDtypeStruct((1, 32, 32), jnp.float32))
  _lower(args, config.replace(num_sms=132))


def _kernel_texts(lowered) -> list[str]:
  """The Mosaic GPU modules inside a lowered function's custom calls, as text."""
  from jax._src.interpreters import mlir as jax_mlir  # noqa: PLC0415
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import dialect as mgpu_dialect  # noqa: PLC0415

  ctx = jax_mlir.make_ir_context()
  mgpu_dialect.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True
  texts = []

  def visit(op):
    op = op.operation
    if (op.name == "stablehlo.custom_call"
        and "mosaic_gpu" in str(op.attributes["call_target_name"])):
      blob = ir.StringAttr(op.attributes["mhlo.backend_config"]["module"]).value_bytes
      texts.append(str(ir.Module.parse(blob, context=ctx)))
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          visit(inner)

  visit(lowered.compiler_ir("stablehlo").operation)
  return texts


@pytest.mark.parametrize("config, rhs_shape", [
    (Config(block_m=128, block_n=128, stages=5), (1, 32, 32)),  # 128x128 block scales
    (Config(block_m=128, block_n=192, stages=4), (1, 32, 32)),  # two column pieces
    (Config(block_m=128, block_n=128, stages=5), (1, 1, 1)),    # per tensor, promoted
    (Config(block_m=128, block_n=176, stages=4, epi_block_n=16), (1, 1, 1)),  # its default
], ids=["128x128-blocks", "128x192-blocks", "128x128-tensor", "128x176-tensor"])
def test_promoted_step_waits_for_its_stage_before_the_wgmma_fence(config, rhs_shape):
  # A barrier spin loop between wgmma.fence and the wgmma keeps the zeroed block
  # accumulator's registers live across the loop; the promoted step waits for its stage
  # first, then zeroes the accumulator, fences and issues the products.
  m = n = k = 4096
  lhs_shape = (1, 1, 1) if rhs_shape == (1, 1, 1) else (1, m, 32)
  args = (jax.ShapeDtypeStruct((1, m, k), E4M3), jax.ShapeDtypeStruct((1, n, k), E4M3),
          jax.ShapeDtypeStruct(lhs_shape, jnp.float32),
          jax.ShapeDtypeStruct(rhs_shape, jnp.float32))
  f = lambda *a: mosaic.scaled_gemm(*a, out_dtype=jnp.bfloat16,  # noqa: E731
                                    config=config.replace(num_sms=132))
  (text,) = _kernel_texts(jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)))
  fences = 0
  fenced = False
  for line in text.splitlines():
    if "wgmma.fence.sync.aligned" in line:
      fenced, fences = True, fences + 1
    elif "wgmma.mma_async" in line:
      fenced = False
    elif fenced:
      assert "mbarrier.try_wait" not in line, "a barrier wait between wgmma.fence and wgmma"
  assert fences >= 1


# ----------------------------------------------------------------------------
# On the GPU, real sizes, NaN-poisoned outputs
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch, m, n, k, lhs_kind, rhs_kind, out_dtype", [
    (1, 4096, 4096, 4096, "step", "block", jnp.bfloat16),
    (1, 4096, 4096, 4096, "tensor", "tensor", jnp.bfloat16),
    (1, 4097, 4095, 4000, "step", "step", jnp.float32),   # ragged, partial last block
    (2, 1000, 1300, 2048, "row", "row", jnp.float16),
    (1, 64, 7168, 2048, "step", "block", jnp.bfloat16),   # short M
    (1, 4096, 7168, 16384, "step", "block", jnp.bfloat16),  # DeepSeek-V3 layer shape
    (1, 4097, 4096, 4096, "step", "block", jnp.bfloat16),   # rows by the single-row view
    (3, 1001, 640, 1024, "step", "block", jnp.float32),     # the same, batched
    (1, 5, 1001, 256, "tensor", "tensor", jnp.bfloat16),    # rhs by row, 5 rows padded
])
def test_on_the_gpu(rng, batch, m, n, k, lhs_kind, rhs_kind, out_dtype):
  _check(rng, batch, m, n, k, lhs_kind=lhs_kind, rhs_kind=rhs_kind, out_dtype=out_dtype,
         interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, m, n, k, lhs_kind, rhs_kind, config, out_dtype", [
    # ragged, batched, several tiles per CTA; one step per tile; clusters; fast accumulation
    (2, 1000, 1300, 1152, "step", "block", Config(), jnp.bfloat16),
    (1, 300, 500, 128, "step", "block", Config(block_n=192, stages=4), jnp.bfloat16),
    (1, 777, 4095, 1024, "step", "step", Config(block_m=64, block_n=256, wg_split="n",
                                                stages=4, cluster_n=2), jnp.bfloat16),
    (1, 4096, 4096, 4096, "tensor", "tensor", Config(block_m=256, stages=4, cluster_n=2,
                                                     fast_accumulation=True), jnp.bfloat16),
    # a float32 output by the single-row view at 176's 16-column sub-tiles (64-byte
    # swizzle), which the defaults do not take yet (fp8/config.py)
    (1, 4097, 4095, 1024, "row", "row", Config(block_n=176, stages=4, epi_block_n=16),
     jnp.float32),
])
def test_configs_on_the_gpu(rng, batch, m, n, k, lhs_kind, rhs_kind, config, out_dtype):
  _check(rng, batch, m, n, k, lhs_kind=lhs_kind, rhs_kind=rhs_kind, config=config,
         out_dtype=out_dtype, interpret=False)


@pytest.mark.gpu
def test_wide_scales_and_nan_on_the_gpu(rng):
  def plant(lhs, rhs):
    lhs[0, 7, 1000] = np.nan
    lhs[0, 300:, 512:640] = 0
    return lhs, rhs

  out = _check(rng, 1, 1000, 2000, 1536, exps=(-20, 20), edit=plant, interpret=False)
  assert np.isnan(np.asarray(out[0, 7])).all()
  _check(rng, 1, 1000, 2000, 1536, dtypes=(E5M2, E4M3), rhs_kind="step", exps=(-20, 20),
         interpret=False)


@pytest.mark.parametrize("m, n, g, tile", [(1024, 2048, 128, (64, 128)),
                                            (65536, 2048, 128, (128, 192)),
                                            (65536, 200, 128, (128, 128))],
                         ids=["decode", "prefill", "prefill-narrow"])
def test_ragged_kernel_lowers_for_cuda(m, n, g, tile):
  # The grouped kernel's default tiles: 64 rows on one warpgroup where groups average
  # under 64 rows (a decode step), else 128 x 192 on two, or 128 x 128 where 192-wide
  # tiles would pad N by over 5% (N = 200).
  from pallas_gemm.fp8 import mosaic_ragged  # noqa: PLC0415
  k = 768
  cfg = mosaic_ragged.default_config(m, n, g, jnp.bfloat16)
  assert (cfg.block_m, cfg.block_n) == tile and cfg.num_compute_wgs == tile[0] // 64
  args = (jax.ShapeDtypeStruct((m, k), E4M3), jax.ShapeDtypeStruct((g, n, k), E4M3),
          jax.ShapeDtypeStruct((g,), jnp.int32), jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
          jax.ShapeDtypeStruct((g, -(-n // 128), k // 128), jnp.float32))
  fn = lambda *a: mosaic_ragged.ragged_gemm(*a, config=cfg.replace(num_sms=132))  # noqa: E731
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("m, k, f, g, block_m", [(4096, 2048, 768, 16, 128),
                                                  (100, 128, 128, 3, 64),
                                                  (1024, 2048, 768, 128, 64)])
def test_gated_kernel_lowers_for_cuda(m, k, f, g, block_m):
  # moe_mlp's fp8 first GEMM + SwiGLU + quantize of a ([gate | up] in one N = 128 wgmma),
  # in its two tile shapes: 64 rows on one warpgroup where groups average under 64 rows.
  from pallas_gemm.fp8 import mosaic_gated  # noqa: PLC0415
  assert mosaic_gated.tiles(m, g)[0] == block_m
  fn = lambda *a: mosaic_gated.gated_ragged_gemm(*a, activation="silu",  # noqa: E731
                                                 num_sms=132)
  args = (jax.ShapeDtypeStruct((m, k), E4M3), jax.ShapeDtypeStruct((g, 2 * f, k), E4M3),
          jax.ShapeDtypeStruct((g,), jnp.int32),
          jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
          jax.ShapeDtypeStruct((g, 2 * f // 128, k // 128), jnp.float32))
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "pallas_gemm_scaled_gated_fp8" in text


@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("sizes", [(50, 0, 130, 97), (1, 1, 200, 0, 59), (0, 0, 5), (300,)])
def test_gated_kernel_scales_gather_each_row_from_its_item(sizes, block_m):
  # The gated kernel writes a's scales per work item (F/128, T, block_m); each row's come
  # from the one item whose rows [lo, hi) hold it, rows of no group included.
  from pallas_gemm.fp8 import mosaic_gated  # noqa: PLC0415
  from pallas_gemm.mgpu import rows  # noqa: PLC0415
  m = 300
  starts, ends = rows.local_rows(jnp.asarray(sizes, jnp.int32), None, len(sizes), m)
  items, count = rows.row_items(starts, ends, m, block_m)
  t = items.shape[1]
  item_scales = jnp.arange(2 * t * block_m, dtype=jnp.float32).reshape(2, t, block_m)
  got = np.asarray(mosaic_gated._row_scales_of_items(item_scales, items, count, m))
  table, want = np.asarray(items), np.full((m, 2), np.nan)
  for i in range(int(count[0])):
    for r in range(table[rows.LO, i], table[rows.HI, i]):
      want[r] = np.asarray(item_scales)[:, i, r - table[rows.ROW8, i] * rows.ROW_ALIGN]
  np.testing.assert_array_equal(got, want)
