"""scaled_matmul, quantize and fp8_dot_general: one suite over the backends.

Reference: the float64 product of the dequantized operands (reference.scaled_reference),
tolerance reference.tolerance(fp8 dtype, ...). "xla" runs every case; "mosaic" runs the
layouts its kernel takes, in interpret mode on a CPU (seconds a call, so fewer cases)
and at real sizes on a GPU (@pytest.mark.gpu).
"""

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_gemm
from conftest import ON_GPU, jax_config, random
from pallas_gemm.testing import reference
from pallas_gemm.fp8 import api, checks, scales
from pallas_gemm.fp8 import xla as sm_xla
from pallas_gemm.fp8.config import Config

sm = pallas_gemm  # the public names: sm.scaled_matmul, sm.quantize, ...

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def _skip_backend(backend):
  """The one place this suite decides that a backend cannot run here."""
  if backend == "mosaic" and (why := checks.mosaic_unavailable_reason()) is not None:
    pytest.skip(f"mosaic unavailable: {why}")


# Layout name -> scale shape for an operand (b, r, k).
def _scale_shape(layout, b, r, k):
  return {"1x128": (b, r, k // 128), "1x32": (b, r, k // 32), "1xK": (b, r, 1),
          "128x128": (b, -(-r // 128), k // 128), "128xK": (b, -(-r // 128), 1),
          "tensor": (b, 1, 1)}[layout]


def _scales(rng, shape, low=-20, high=20):
  """float32 scales 2^u, u uniform in [low, high]: not powers of two, spanning 2^40."""
  return np.exp2(rng.uniform(low, high, shape)).astype(np.float32)


def _fp8(rng, shape, dtype):
  return np.asarray(random(rng, shape, np.float32) * 8, dtype)


def _check(out, lhs, rhs, ls, rs, out_dtype=np.float32, *, forward_error=False):
  """out against the float64 product, normwise. forward_error: measured against the
  product of the operands' absolute values (scales are positive), the scale a summation's
  forward error has, for outputs so small that a few cancelling elements dominate their
  norm (8 x 16 with scales spanning 2^40 measured 2.5e-4 against their own norm with the
  fp8 wgmma's ~14 accumulated bits, above the table's 2.3e-4 at K = 256). It is ~sqrt(K)
  looser on N(0, 1) data, so larger outputs keep the plain norm."""
  ref = reference.scaled_reference(lhs, rhs, ls, rs)
  scale = (reference.scaled_reference(np.abs(lhs), np.abs(rhs), ls, rs) if forward_error
           else None)
  tol = reference.tolerance(lhs.dtype, None, lhs.shape[-1], out_dtype)
  assert out.dtype == out_dtype and out.shape == ref.shape
  err = reference.relative_error(out, ref, scale=scale)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def _run(rng, backend, b, m, n, k, lhs_layout, rhs_layout, lhs_dtype=E4M3, rhs_dtype=E4M3,
         out_dtype=np.float32):
  lhs, rhs = _fp8(rng, (b, m, k), lhs_dtype), _fp8(rng, (b, n, k), rhs_dtype)
  # float16 results: scales that keep the products below its 65504.
  low, high = (-6, 0) if out_dtype == np.float16 else (-20, 20)
  ls = _scales(rng, _scale_shape(lhs_layout, b, m, k), low, high)
  rs = _scales(rng, _scale_shape(rhs_layout, b, n, k), low, high)
  out = sm.scaled_matmul(lhs, rhs, ls, rs, out_dtype, backend=backend)
  _check(out, lhs, rhs, ls, rs, out_dtype)


LAYOUTS = ("1x128", "1x32", "1xK", "128x128", "128xK", "tensor")


@pytest.mark.parametrize("lhs_layout", LAYOUTS)
@pytest.mark.parametrize("rhs_layout", LAYOUTS)
def test_layouts_xla(rng, lhs_layout, rhs_layout):
  # Ragged M and N (a partial last 128-row block), batched.
  _run(rng, "xla", 2, 130, 200, 256, lhs_layout, rhs_layout)


# What the kernel takes (natively or repeated per 128 / per row by api.py).
MOSAIC_CASES = [
    ("1x128", "128x128", (1, 136, 200, 256)),
    ("1x128", "1x128", (2, 64, 72, 384)),
    ("tensor", "tensor", (1, 100, 130, 200)),   # K not a multiple of 128
    ("1xK", "128xK", (1, 64, 136, 256)),
    ("128x128", "tensor", (1, 200, 64, 128)),
]


@pytest.mark.parametrize("lhs_layout, rhs_layout, shape", MOSAIC_CASES)
def test_layouts_mosaic(rng, lhs_layout, rhs_layout, shape):
  _skip_backend("mosaic")
  _run(rng, "mosaic", *shape, lhs_layout, rhs_layout)


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_fp8_dtypes(rng, backend):
  # e5m2, both mixes, and the three output dtypes, in one call each.
  _skip_backend(backend)
  cases = [(E5M2, E5M2, np.float32), (E4M3, E5M2, jnp.bfloat16), (E5M2, E4M3, np.float16)]
  for lhs_dtype, rhs_dtype, out_dtype in cases[:1 if backend == "mosaic" and not ON_GPU else 3]:
    _run(rng, backend, 1, 64, 72, 256, "1x128", "128x128", lhs_dtype, rhs_dtype,
         np.dtype(out_dtype))


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_zero_and_saturated_blocks(rng, backend):
  _skip_backend(backend)
  b, m, n, k = 1, 64, 136, 384
  lhs, rhs = _fp8(rng, (b, m, k), E4M3), _fp8(rng, (b, n, k), E5M2)
  lhs[:, :, 128:256] = 0                      # a zero block of every row
  lhs[:, 7, :] = np.asarray(np.sign(rng.standard_normal(k)) * FMAX[E4M3], E4M3)  # saturated
  rhs[:, 128:, 256:] = np.asarray(FMAX[E5M2], E5M2)                # saturated 128x128 block
  ls = _scales(rng, (b, m, 3))
  rs = _scales(rng, (b, 2, 3))
  ls[:, 5, :] = 0.0                                                # a zero scale
  _check(sm.scaled_matmul(lhs, rhs, ls, rs, backend=backend), lhs, rhs, ls, rs)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_nan_and_inf_propagate(rng, backend):
  _skip_backend(backend)
  b, m, n, k = 1, 64, 72, 256
  lhs, rhs = _fp8(rng, (b, m, k), E4M3), _fp8(rng, (b, n, k), E5M2)
  lhs[0, 3, 5] = np.nan                   # row 3 NaN
  rhs[0, 9, 200] = np.inf                 # column 9 +-inf (NaN where lhs has a zero there)
  rhs[0, 11, 17] = -np.inf
  ls, rs = _scales(rng, (b, m, 2)), _scales(rng, (b, 1, 2))
  out = sm.scaled_matmul(lhs, rhs, ls, rs, backend=backend)
  ref = reference.scaled_reference(lhs, rhs, ls, rs)
  assert np.isnan(ref[0, 3]).all() and np.isinf(ref[0, :, 9]).any()
  _check(out, lhs, rhs, ls, rs)  # relative_error demands the same NaN / Inf elements


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_x64(rng, backend):
  # jax_enable_x64 on: the same product (the kernel's index arithmetic is 32-bit).
  _skip_backend(backend)
  with jax_config("jax_enable_x64", True):
    _run(rng, backend, 1, 64, 72, 256, "1x128", "128x128")
    _run(rng, backend, 1, 64, 72, 256, "1xK", "tensor")


@pytest.mark.parametrize("m, n, k", [(1, 1, 128), (1, 5, 32), (3, 1, 1), (0, 4, 128),
                                     (4, 0, 128), (4, 5, 0)])
def test_tiny_and_empty(rng, m, n, k):
  lhs, rhs = _fp8(rng, (2, m, k), E4M3), _fp8(rng, (2, n, k), E4M3)
  ls, rs = _scales(rng, (2, m, 1)), _scales(rng, (2, 1, 1))
  out = sm.scaled_matmul(lhs, rhs, ls, rs)
  assert out.shape == (2, m, n) and out.dtype == np.float32
  if m * n and k == 0:  # the empty sum
    assert np.all(np.asarray(out) == 0)
  elif m * n:
    # A handful of dot products can cancel to near zero, where any float32 sum loses its
    # relative accuracy (the kernel's tensor-core sum within a 128 block most): the error
    # is bounded against the sum of the products' magnitudes, |lhs| . |rhs|, instead.
    ref = reference.scaled_reference(lhs, rhs, ls, rs)
    mag = reference.scaled_reference(np.abs(np.asarray(lhs, np.float32)),
                                     np.abs(np.asarray(rhs, np.float32)), ls, rs)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(mag)
    tol = reference.tolerance(lhs.dtype, None, k, np.float32)
    assert err <= tol, f"error {err:.3g} of |lhs| . |rhs| > {tol:.3g}"


def test_two_d_and_jit(rng):
  lhs, rhs = _fp8(rng, (130, 256), E4M3), _fp8(rng, (200, 256), E4M3)
  ls, rs = _scales(rng, (130, 2)), _scales(rng, (2, 2))
  out = jax.jit(sm.scaled_matmul)(lhs, rhs, ls, rs)
  _check(out, lhs, rhs, ls, rs)


def test_auto_and_mosaic_routing(rng):
  lhs, rhs = _fp8(rng, (1, 8, 256), E4M3), _fp8(rng, (1, 8, 256), E4M3)
  fine = _scales(rng, (1, 8, 8))  # 1x32: no kernel takes it
  with pytest.raises(ValueError, match="lhs_scales in 1x32 blocks.*backend='xla' can"):
    sm.scaled_matmul(lhs, rhs, fine, fine, backend="mosaic")
  _check(sm.scaled_matmul(lhs, rhs, fine, fine), lhs, rhs, fine, fine)  # auto: xla
  # Per-row scales stay per row (the kernel's epilogue applies them); 1x256 blocks are
  # repeated per 128 of K; lhs 128-row blocks per row; rhs 128-row blocks stay.
  layout = lambda s, x: scales.scale_layout(s.shape, x.shape, name="s", rows_name="r")  # noqa: E731
  kernel = lambda s, x, rhs: api._for_kernel(s, layout(s, x), x.shape, row_blocks=rhs)  # noqa: E731
  ls, rs = _scales(rng, (1, 8, 1)), _scales(rng, (1, 1, 1))
  assert kernel(ls, lhs, False).shape == (1, 8, 1) and kernel(rs, rhs, True).shape == (1, 1, 1)
  lhs, rhs = _fp8(rng, (1, 130, 512), E4M3), _fp8(rng, (1, 136, 512), E4M3)
  ls, rs = _scales(rng, (1, 2, 2)), _scales(rng, (1, 2, 2))
  np.testing.assert_array_equal(kernel(ls, lhs, False),
                                np.repeat(np.repeat(ls, 128, 1)[:, :130], 2, 2))
  np.testing.assert_array_equal(kernel(rs, rhs, True), np.repeat(rs, 2, 2))
  rs = _scales(rng, (1, 2, 1))  # 128xK: per row
  np.testing.assert_array_equal(kernel(rs, rhs, True), np.repeat(rs, 128, 1)[:, :136])
  with pytest.raises(TypeError, match="config must be a pallas_gemm.fp8.config"):
    sm.scaled_matmul(lhs, rhs, ls, rs, backend="mosaic", config=object())


def test_per_tensor_pattern_computes_the_product(rng):
  # The XLA expression the benchmark times as cuBLASLt fp8 (here, computed as written).
  lhs, rhs = _fp8(rng, (64, 256), E4M3), _fp8(rng, (72, 256), E4M3)
  sa, sb = np.float32(0.25), np.float32(8.0)
  out = sm_xla.per_tensor_pattern(lhs, rhs, sa, sb, out_dtype=jnp.float32, wide=jnp.float32)
  _check(out, lhs, rhs, sa.reshape(1, 1), sb.reshape(1, 1))


@pytest.mark.parametrize("scale, what", [(np.ones((1, 1), np.float32), "shape=(1, 1)"),
                                         (jnp.bfloat16(2), "dtype=bfloat16"),
                                         (2.0, "float")])
def test_per_tensor_pattern_takes_0d_float32_scales(rng, scale, what):
  # XLA rewrites only a float32 scalar multiply: other scales are refused, not reshaped.
  lhs, rhs = _fp8(rng, (8, 128), E4M3), _fp8(rng, (8, 128), E4M3)
  with pytest.raises(TypeError, match=rf"rhs_scale must be a 0-d float32 array.*{re.escape(what)}"):
    sm_xla.per_tensor_pattern(lhs, rhs, np.float32(1), scale)


# ----------------------------------------------------------------------------- scales


E8M0 = np.dtype(jnp.float8_e8m0fnu)
BF16, F16 = np.dtype(jnp.bfloat16), np.dtype(np.float16)


def _narrow(rng, shape, dtype):
  """(scales in dtype, the same numbers in float32). Drawn as `_scales` and rounded to
  dtype (e8m0: to a power of two), within float16's normal range for float16."""
  low, high = (-10, 10) if dtype == F16 else (-20, 20)
  narrow = _scales(rng, shape, low, high).astype(dtype)
  return narrow, narrow.astype(np.float32)


def _scaled_pair(rng, backend, shape, lhs_layout, rhs_layout, lhs_dtype, rhs_dtype, *,
                 forward_error=False):
  """scaled_matmul with narrow scales, and with their float32 values: (out, out_f32)."""
  b, m, n, k = shape
  lhs, rhs = _fp8(rng, (b, m, k), E4M3), _fp8(rng, (b, n, k), E4M3)
  ls, ls32 = _narrow(rng, _scale_shape(lhs_layout, b, m, k), lhs_dtype)
  rs, rs32 = _narrow(rng, _scale_shape(rhs_layout, b, n, k), rhs_dtype)
  out = sm.scaled_matmul(lhs, rhs, ls, rs, backend=backend)
  _check(out, lhs, rhs, ls, rs, forward_error=forward_error)
  return out, sm.scaled_matmul(lhs, rhs, ls32, rs32, backend=backend)


@pytest.mark.parametrize("lhs_dtype, rhs_dtype", [(BF16, BF16), (F16, F16), (E8M0, E8M0),
                                                  (BF16, E8M0)], ids=str)
@pytest.mark.parametrize("lhs_layout, rhs_layout", [("1x128", "128x128"), ("1x32", "tensor"),
                                                    ("128xK", "1xK")])
def test_scale_dtypes_xla(rng, lhs_dtype, rhs_dtype, lhs_layout, rhs_layout):
  # A narrow scale is read as its float32 value (an exact conversion): the same result,
  # bit for bit, as float32 scales holding the same numbers. The sides' dtypes may differ.
  out, out_f32 = _scaled_pair(rng, "xla", (2, 130, 72, 256), lhs_layout, rhs_layout,
                              lhs_dtype, rhs_dtype)
  np.testing.assert_array_equal(out, out_f32)


@pytest.mark.parametrize("dtype", [BF16, F16, E8M0], ids=str)
def test_scale_dtypes_mosaic(rng, dtype):
  # The kernel reads float32 scales: narrow ones are converted before it, so the result
  # equals float32 scales' bit for bit, for step scales and for epilogue scales alike.
  _skip_backend("mosaic")
  for layouts in (("1x128", "128x128"), ("1xK", "tensor")):
    out, out_f32 = _scaled_pair(rng, "mosaic", (1, 8, 16, 256), *layouts, dtype, dtype,
                                forward_error=True)
    np.testing.assert_array_equal(out, out_f32)


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_e8m0_scales_cover_their_range(backend):
  # Every finite e8m0 scale, 2^-127 to 2^127, gives the product the float32 scale of the
  # same value gives: row i of lhs is one 1.0 scaled by 2^(i - 127). 2^-127 is a float32
  # subnormal, read as zero where the backend flushes subnormals (XLA on a CPU does),
  # the same for either dtype; from 2^-126 up the products are the scales, exactly.
  _skip_backend(backend)
  e = np.arange(-127, 128)
  lhs = np.zeros((1, e.size, 128), E4M3)
  lhs[:, :, 0] = 1.0
  rhs = lhs[:, :8]
  ls32 = np.ldexp(np.float32(1), e).reshape(1, -1, 1)
  rs = np.ones((1, 1, 1), E8M0)
  out = sm.scaled_matmul(lhs, rhs, ls32.astype(E8M0), rs, backend=backend)
  np.testing.assert_array_equal(out, sm.scaled_matmul(lhs, rhs, ls32, rs, backend=backend))
  np.testing.assert_array_equal(np.asarray(out)[0, 1:], np.broadcast_to(ls32[0, 1:], (254, 8)))
  assert np.asarray(out)[0, 0, 0] in (0.0, ls32[0, 0, 0])


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
@pytest.mark.parametrize("lhs_layout, rhs_layout", [("1x256", "128x256"), ("128x256", "1x256")])
def test_k_blocks_of_256(rng, backend, lhs_layout, rhs_layout):
  # Blocks 256 long along K: the product they define, and on either path the same numbers
  # as the equivalent 128-long blocks (each scale repeated twice along K).
  _skip_backend(backend)
  b, m, n, k = (1, 8, 16, 512) if backend == "mosaic" and not ON_GPU else (2, 130, 200, 512)
  lhs, rhs = _fp8(rng, (b, m, k), E4M3), _fp8(rng, (b, n, k), E4M3)
  shape = {"1x256": lambda r: (b, r, k // 256), "128x256": lambda r: (b, -(-r // 128), k // 256)}
  ls, rs = _scales(rng, shape[lhs_layout](m)), _scales(rng, shape[rhs_layout](n))
  out = sm.scaled_matmul(lhs, rhs, ls, rs, backend=backend)
  _check(out, lhs, rhs, ls, rs)
  per_128 = sm.scaled_matmul(lhs, rhs, np.repeat(ls, 2, axis=2), np.repeat(rs, 2, axis=2),
                             backend=backend)
  np.testing.assert_array_equal(out, per_128)


@pytest.mark.parametrize("k, k_s, block", [(256, 4, 64), (384, 2, 192)])
def test_k_blocks_the_kernel_refuses(rng, k, k_s, block):
  # Blocks along K shorter than 128, or not a multiple of it (and not K itself): the
  # kernel refuses them naming the argument, auto and xla compute them.
  _skip_backend("mosaic")
  lhs, rhs = _fp8(rng, (1, 8, k), E4M3), _fp8(rng, (1, 16, k), E4M3)
  ls, rs = _scales(rng, (1, 8, 1)), _scales(rng, (1, 16, k_s))
  with pytest.raises(ValueError, match=rf"backend='mosaic' cannot run this call: rhs_scales"
                                       rf" in 1x{block} blocks: .* a multiple of 128 long"
                                       r" \(or K itself\) \(backend='xla' can\)"):
    sm.scaled_matmul(lhs, rhs, ls, rs, backend="mosaic")
  out = sm.scaled_matmul(lhs, rhs, ls, rs)
  _check(out, lhs, rhs, ls, rs)
  np.testing.assert_array_equal(out, sm.scaled_matmul(lhs, rhs, ls, rs, backend="xla"))


@pytest.mark.parametrize("dtype", [np.dtype(np.float64), E4M3, E5M2, np.dtype(np.int8)],
                         ids=str)
def test_scale_dtypes_refused(dtype):
  lhs, rhs = np.ones((1, 8, 256), E4M3), np.ones((1, 16, 256), E4M3)
  with pytest.raises(TypeError, match=rf"lhs_scales.dtype must be float32 \(or bfloat16,"
                                      rf" float16, float8_e8m0fnu\); got {np.dtype(dtype)}"):
    sm.scaled_matmul(lhs, rhs, np.ones((1, 8, 2), dtype), np.ones((1, 1, 1), np.float32))


@pytest.mark.parametrize("lhs_scales_shape, rows", [((1, 4, 2), 4), ((1, 1, 2), 1)],
                         ids=["64-row blocks", "all rows"])
def test_row_blocks_refused(lhs_scales_shape, rows):
  # Rows come per row, per 128 rows or per tensor: 64-row blocks, and one scale per K block
  # shared by more than 128 rows, are shapes no layout reads.
  lhs, rhs = np.ones((1, 256, 256), E4M3), np.ones((1, 16, 256), E4M3)
  with pytest.raises(ValueError, match=rf"lhs_scales has {rows} rows for an operand of 256"
                                       r" rows \(M\).*Accepted: \(1, 256, K_s\)"):
    sm.scaled_matmul(lhs, rhs, np.ones(lhs_scales_shape, np.float32),
                     np.ones((1, 1, 1), np.float32))


# ----------------------------------------------------------------------------- quantize


def _exact_fp8(x, scales_full, dtype):
  """x / scale rounded to the nearest fp8 (ml_dtypes, host), saturated."""
  fmax = FMAX[np.dtype(dtype)]
  return np.clip(np.asarray(x, np.float64) / scales_full, -fmax, fmax).astype(dtype)


# The Hopper kernel takes (1, 128) blocks over B * M rows in multiples of 8 and (128, 128)
# blocks with M in multiples of 128; xla all.
_QUANTIZE_CASES = [("xla", (1, 128), (2, 130, 256)), ("mosaic", (1, 128), (2, 132, 256)),
                   ("xla", (128, 128), (200, 384)), ("mosaic", (128, 128), (2, 256, 384)),
                   ("xla", (1, 32), (3, 64)),
                   ("xla", None, (2, 33, 40)), ("xla", (1, 40), (5, 40))]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("backend, block_shape, x_shape", _QUANTIZE_CASES)
def test_quantize_round_trip(rng, dtype, backend, block_shape, x_shape):
  _skip_backend(backend)
  x = random(rng, x_shape, np.float32) * np.exp2(rng.integers(-30, 30, x_shape[:-1] + (1,)))
  x = x.astype(np.float32)
  values, scales = sm.quantize(jnp.asarray(x), dtype, block_shape, backend=backend)
  assert values.dtype == dtype and values.shape == x.shape
  assert scales.dtype == np.float32 and scales.ndim == x.ndim
  scales = np.asarray(scales)
  # The layout scaled_matmul reads: dequantize expands it.
  full = np.asarray(sm.dequantize(jnp.ones(x.shape, dtype), scales))
  # Powers of two: the smallest with amax <= 2^e * max, so the block's amax lands in
  # (max / 2, max].
  assert np.all(np.frexp(scales)[0] == 0.5)
  # Every element is x / scale rounded to nearest fp8: the only rounding.
  np.testing.assert_array_equal(np.asarray(values).view(np.uint8),
                                _exact_fp8(x, full, dtype).view(np.uint8))
  # Minimal: each block's largest |value| lies in [max / 2, max] (zero blocks aside).
  x3, s3 = x.reshape((-1,) + x.shape[-2:]), scales.reshape((-1,) + scales.shape[-2:])
  b, r, k = np.indices(x3.shape)
  rows = r if s3.shape[1] == x3.shape[1] else (0 * r if s3.shape[1] == 1 else r // 128)
  top = np.zeros(s3.shape)
  np.maximum.at(top, (b, rows, k // (x3.shape[2] // s3.shape[2])),
                np.abs(np.asarray(values, np.float64).reshape(x3.shape)))
  assert np.all((top >= FMAX[dtype] / 2) & (top <= FMAX[dtype]))


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_quantize_edges(backend):
  _skip_backend(backend)
  q = functools.partial(sm.quantize, backend=backend)
  fmax = FMAX[E4M3]
  x = np.ones((8, 256), np.float32)
  x[0] = 0.0                                # a zero block: scale 1, values 0
  x[1, 0], x[1, 1] = np.inf, -np.inf        # saturates to +-max * scale
  x[2, 3] = np.nan                          # kept
  x[3, :128] = 448.0 * 2.0**20              # amax exactly max * 2^20: scale 2^20
  x[4, :128] = 2.0**-120                    # scale clipped at 2^-126: values 2^6
  x[5, 128:] = np.nan                       # a block of NaN: scale 1
  values, scales = q(jnp.asarray(x))
  values, scales = np.asarray(values, np.float32), np.asarray(scales)
  assert np.all(values[0] == 0) and np.all(scales[0] == 1)
  assert values[1, 0] == fmax and values[1, 1] == -fmax and scales[1, 0] == 2.0**-8
  assert np.isnan(values[2, 3]) and np.isfinite(np.delete(values[2], 3)).all()
  assert scales[3, 0] == 2.0**20 and np.all(values[3, :128] == fmax)
  assert scales[4, 0] == 2.0**-126 and np.all(values[4, :128] == 2.0**6)
  assert scales[5, 1] == 1 and np.isnan(values[5, 128:]).all()
  # bfloat16 / float16 inputs, and 2-D/3-D agree.
  xb = jnp.asarray(x[:8], jnp.bfloat16)
  v2, s2 = q(xb)
  v3, s3 = q(xb[None])
  np.testing.assert_array_equal(np.asarray(v3[0], np.float32), np.asarray(v2, np.float32))
  np.testing.assert_array_equal(s3[0], s2)


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_near_float32_max_stays_finite(dtype, backend):
  _skip_backend(backend)
  # A block's amax near 2^128 (float32 or bfloat16 max) can round up to 2^128 / scale,
  # an fp8 value whose product with the scale overflows: such values saturate at the
  # largest product below 2^128 with fp8's mantissa, (2 - 2^-nmant) * 2^127.
  top = (2.0 - 2.0 ** -jnp.finfo(dtype).nmant) * 2.0**127
  x = np.ones((8, 128), np.float32)  # rows 3-7: ones (8 rows, as the kernel takes)
  x[0, :2] = np.finfo(np.float32).max, -np.finfo(np.float32).max
  x[1, 0] = float(jnp.finfo(jnp.bfloat16).max)
  x[2, 0] = top                                         # representable: kept as it is
  x[3:, 0] = top
  for xs in (jnp.asarray(x), jnp.asarray(np.roll(x, -1, axis=0), jnp.bfloat16)):
    out = np.asarray(sm.dequantize(*sm.quantize(xs, dtype, backend=backend)))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[:-1, 0], top)
  out = np.asarray(sm.dequantize(*sm.quantize(jnp.asarray(x), dtype, backend=backend)))
  assert out[0, 1] == -top


@pytest.mark.parametrize("x_dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("block_shape", [(1, 128), (128, 128)])
def test_quantize_kernel_matches_xla_bitwise(rng, x_dtype, block_shape):
  # The kernel and xla compute the same arithmetic: equal values and scales, bit for bit,
  # on wide-range rows with zeros, infinities, NaN, tiny and huge values, rows that are
  # not whole tiles (1x128), a zero 128x128 block and one whose amax is a lone
  # subnormal.
  _skip_backend("mosaic")
  whole_blocks = block_shape[0] == 128  # M in 128s; 1x128 blocks: rows not whole tiles
  if ON_GPU:
    shape = (3, 1024 if whole_blocks else 1000, 1024)
  else:
    shape = (2, 256 if whole_blocks else 68, 256)
  x = random(rng, shape, np.float32) * np.exp2(rng.integers(-60, 60, shape[:-1] + (1,)))
  x[0, 1], x[0, 2, :5] = 0.0, [np.inf, -np.inf, np.nan, 1e-40, -1e-45]
  x[1, :128, :128] = 0.0
  x[1, :128, 128:256] = 0.0
  x[1, 7, 200] = -float(jnp.finfo(x_dtype).smallest_subnormal)  # exact in float32 too
  x = jnp.asarray(x, x_dtype)
  for dtype in (E4M3, E5M2):
    v_k, s_k = sm.quantize(x, dtype, block_shape, backend="mosaic")
    v_x, s_x = sm.quantize(x, dtype, block_shape, backend="xla")
    np.testing.assert_array_equal(np.asarray(s_k), np.asarray(s_x))
    np.testing.assert_array_equal(np.asarray(v_k).view(np.uint8), np.asarray(v_x).view(np.uint8))


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
@pytest.mark.parametrize("x_dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_shape, shape", [
    ((1, 128), (384, 256)),
    ((1, 128), (2, 256, 384)),    # batched: each entry's own transpose
    ((1, 128), (2, 128, 200)),    # x^T's rows not whole tiles: transposed copy first
    ((128, 128), (256, 384)),
    ((128, 128), (2, 384, 256)),  # batched 128x128 blocks of each entry's transpose
])
def test_quantize_transpose_is_quantize_of_the_transpose(rng, backend, x_dtype, block_shape,
                                                         shape):
  # transpose=True reads x in place on the kernel: bit for bit the values and scales of
  # quantize(swapaxes(x)), with infinities, NaN, zeros and wide-range columns.
  _skip_backend(backend)
  x = random(rng, shape, np.float32) * np.exp2(rng.integers(-60, 60, shape[:-2] + (1, shape[-1])))
  x[..., 1, :] = 0.0
  x[..., 2, :3] = [np.inf, -np.inf, np.nan]
  x = jnp.asarray(x, x_dtype)
  for dtype in (E4M3, E5M2):
    values, got_scales = sm.quantize(x, dtype, block_shape, transpose=True, backend=backend)
    want, want_scales = sm.quantize(jnp.swapaxes(x, -1, -2), dtype, block_shape, backend="xla")
    assert values.shape == want.shape and got_scales.shape == want_scales.shape
    np.testing.assert_array_equal(np.asarray(got_scales), np.asarray(want_scales))
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8),
                                  np.asarray(want).view(np.uint8))


def test_quantize_transpose_bad_input():
  with pytest.raises(TypeError, match="transpose must be a bool"):
    sm.quantize(jnp.zeros((256, 256), jnp.bfloat16), transpose=1)
  # The contraction is x's second-to-last dim here: the message names that one.
  with pytest.raises(ValueError, match="must divide x's second-to-last .contraction. dim 200"):
    sm.quantize(jnp.zeros((200, 256), jnp.bfloat16), transpose=True)


def test_quantize_kernel_choice(monkeypatch):
  # "auto" takes the kernel on a GPU for 1x128 blocks, and for 128x128 blocks in whole
  # blocks of rows (others stay on XLA; "mosaic" by name refuses them: test_bad_input).
  quantize_module = importlib.import_module("pallas_gemm.fp8.quantize")
  monkeypatch.setattr(quantize_module.hw, "on_gpu", lambda: True)
  x = jnp.zeros((2, 256, 256), jnp.bfloat16)
  choose = quantize_module._choose
  assert choose("auto", (1, 128), 2, 256, 256, x) == (
      "mosaic" if checks.mosaic_unavailable_reason() is None else "xla")
  assert choose("auto", (128, 128), 2, 256, 256, x) == (
      "mosaic" if checks.mosaic_unavailable_reason() is None else "xla")
  assert choose("auto", (128, 128), 2, 200, 256, x) == "xla"
  if checks.mosaic_unavailable_reason() is None:
    assert choose("mosaic", (128, 128), 2, 256, 256, x) == "mosaic"


def test_quantize_feeds_scaled_matmul(rng):
  x, w = random(rng, (130, 256), np.float32), random(rng, (200, 256), np.float32)
  x8, sx = sm.quantize(x)
  w8, sw = sm.quantize(w, block_shape=(128, 128))
  out = sm.scaled_matmul(x8, w8, sx, sw)
  _check(out, x8, w8, sx, sw)
  np.testing.assert_array_equal(sm.dequantize(x8, sx),
                                np.asarray(x8, np.float32) * np.repeat(sx, 128, axis=1))


# ----------------------------------------------------------------------------- scaled_ragged_dot


def _ragged_operands(rng, m, k, n, sizes, dtypes=(E4M3, E4M3), wide=False):
  """Quantized (x8, w8, sizes, sx, sw): x (M, K) in 1x128 blocks, w (G, N, K) in 128x128
  blocks per group; wide: every group's weight and every row scaled by 2^u, u in
  [-20, 20], so the scales span 2^40."""
  g = len(sizes)
  x = random(rng, (m, k), np.float32)
  w = random(rng, (g, n, k), np.float32)
  if wide:
    x = x * np.exp2(rng.integers(-20, 20, (m, 1)))
    w = w * np.exp2(rng.integers(-20, 20, (g, 1, 1)))
  x8, sx = sm.quantize(jnp.asarray(x, np.float32), dtypes[0])
  w8, sw = sm.quantize(jnp.asarray(w, np.float32), dtypes[1], block_shape=(128, 128))
  return x8, w8, np.asarray(sizes, np.int32), sx, sw


def _check_ragged(out, x8, w8, sizes, sx, sw, out_dtype):
  ref = reference.scaled_ragged_reference(x8, w8, sizes, sx, sw)
  assert out.dtype == out_dtype and out.shape == ref.shape
  tol = reference.tolerance(x8.dtype, None, x8.shape[1], out_dtype)
  err = reference.relative_error(out, ref)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"
  past = int(np.sum(sizes))  # rows in no group are zeros
  assert np.all(np.asarray(out, np.float32)[past:] == 0)


# (M, K, N, group sizes): an empty group, 1-row groups, groups that are no multiple of 8
# or of the 128-row tile, rows past the groups, M and N that are not tile multiples.
_RAGGED_CASES = [(300, 256, 200, (50, 0, 130, 97)),
                 (261, 128, 136, (1, 1, 200, 0, 59)),
                 (64, 384, 128, (0, 64)),
                 (40, 128, 64, (3, 0, 30))]  # one K step, N under one column tile


# The grouped kernel's column tiles: its defaults, and 128 x 192 (a tile across two
# 128-column weight blocks, cut into 64-wide pieces for their scales).
_WIDE = Config(block_m=128, block_n=192, stages=4)


@pytest.mark.parametrize("backend, config", [("xla", None), ("mosaic", None),
                                             ("mosaic", _WIDE)], ids=["xla", "mosaic", "192"])
@pytest.mark.parametrize("m, k, n, sizes", _RAGGED_CASES)
def test_scaled_ragged_dot(rng, backend, config, m, k, n, sizes):
  _skip_backend(backend)
  x8, w8, sizes, sx, sw = _ragged_operands(rng, m, k, n, sizes)
  for out_dtype in (np.float32, jnp.bfloat16)[:1 if backend == "mosaic" and not ON_GPU else 2]:
    out = sm.scaled_ragged_dot(x8, w8, jnp.asarray(sizes), sx, sw, out_dtype, backend=backend,
                               config=config)
    _check_ragged(out, x8, w8, sizes, sx, sw, np.dtype(out_dtype))


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_scaled_ragged_dot_wide_scales_e5m2_and_nan(rng, backend):
  _skip_backend(backend)
  x8, w8, sizes, sx, sw = _ragged_operands(rng, 200, 256, 144, (70, 0, 100), (E4M3, E5M2),
                                           wide=True)
  out = sm.scaled_ragged_dot(x8, w8, jnp.asarray(sizes), sx, sw, backend=backend)
  _check_ragged(out, x8, w8, sizes, sx, sw, np.dtype(np.float32))
  # NaN in one row of lhs reaches that row of the output only.
  x_nan = x8.at[75, 3].set(jnp.nan)
  out = np.asarray(sm.scaled_ragged_dot(x_nan, w8, jnp.asarray(sizes), sx, sw, backend=backend))
  assert np.isnan(out[75]).all() and np.isfinite(np.delete(out, 75, axis=0)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, _WIDE], ids=["default", "192"])
@pytest.mark.parametrize("kind", ["uniform", "pareto", "zeros"])
def test_scaled_ragged_dot_at_size(rng, kind, config):
  # MoE-sized: 8 experts, a skewed router (pareto), half the experts empty (zeros).
  from pallas_gemm.testing import grouped_shapes as shapes  # noqa: PLC0415
  m, k, n, g = 4096, 2048, 1408, 8
  sizes = shapes.group_sizes(kind, g, m, rng)
  x8, w8, sizes, sx, sw = _ragged_operands(rng, m, k, n, sizes)
  out = sm.scaled_ragged_dot(x8, w8, jnp.asarray(sizes), sx, sw, jnp.bfloat16, config=config)
  _check_ragged(out, x8, w8, sizes, sx, sw, np.dtype(jnp.bfloat16))


@pytest.mark.gpu
def test_scaled_ragged_dot_decode_sized(rng):
  # 1024 rows over 128 experts (a decode step's top-8 of 128 tokens): the decode tiles,
  # 64 rows on one warpgroup; empty experts and rows past the groups included.
  m, k, n, g = 1024, 768, 2048, 128
  sizes = rng.multinomial(m - 40, np.ones(g) / g).astype(np.int32)
  sizes[:3] = 0
  x8, w8, sizes, sx, sw = _ragged_operands(rng, m, k, n, sizes)
  out = sm.scaled_ragged_dot(x8, w8, jnp.asarray(sizes), sx, sw, jnp.bfloat16)
  _check_ragged(out, x8, w8, sizes, sx, sw, np.dtype(jnp.bfloat16))


def test_scaled_ragged_dot_bad_input(rng):
  x8, w8, sizes, sx, sw = _ragged_operands(rng, 16, 256, 64, (8, 8))
  f, gs = sm.scaled_ragged_dot, jnp.asarray(sizes)
  with pytest.raises(TypeError, match="lhs.dtype must be float8_e4m3fn"):
    f(x8.astype(jnp.bfloat16), w8, gs, sx, sw)
  with pytest.raises(ValueError, match=r"lhs must be \(M, K\) and rhs \(G, N, K\)"):
    f(x8, w8[0], gs, sx, sw)
  with pytest.raises(ValueError, match="rhs .* must have lhs's K=256"):
    f(x8, w8[:, :, :128], gs, sx, sw)
  with pytest.raises(ValueError, match=r"K=64 must be a multiple of 128"):
    f(x8[:, :64], w8[:, :, :64], gs, sx[:, :1], sw[:, :, :1])
  with pytest.raises(ValueError, match=r"lhs_scales must be \(16, 2\) \(1x128 blocks.*got"
                                       r" shape \(16, 1\)"):
    f(x8, w8, gs, sx[:, :1], sw)
  with pytest.raises(ValueError, match=r"rhs_scales must be \(2, 1, 2\) \(128x128 blocks"):
    f(x8, w8, gs, sx, sw[:, :, :1])
  with pytest.raises(TypeError, match="rhs_scales.dtype must be float32"):
    f(x8, w8, gs, sx, sw.astype(jnp.int32))
  with pytest.raises(TypeError, match="group_sizes must be integers; got float32"):
    f(x8, w8, gs.astype(jnp.float32), sx, sw)
  with pytest.raises(ValueError, match=r"group_sizes must be \(G,\) = \(2,\).*got shape \(3,\)"):
    f(x8, w8, jnp.ones((3,), jnp.int32), sx, sw)
  with pytest.raises(ValueError, match="backend must be"):
    f(x8, w8, gs, sx, sw, backend="cublas")
  with pytest.raises(TypeError, match="preferred_element_type"):
    f(x8, w8, gs, sx, sw, jnp.int8)
  if checks.mosaic_unavailable_reason() is None:
    with pytest.raises(ValueError, match="block_n dividing 128 or a multiple of 64"):
      f(x8, w8, gs, sx, sw, config=Config(block_m=128, block_n=160, stages=2, epi_block_n=16),
        backend="mosaic")
    with pytest.raises(ValueError, match=r"epi_block_n=32 makes 64-byte rows of a bfloat16"):
      f(x8, w8, gs, sx, sw, jnp.bfloat16, config=Config(block_m=128, block_n=128, stages=2,
                                                        epi_block_n=32), backend="mosaic")


# ----------------------------------------------------------------------------- bad input


def test_bad_input(rng):
  lhs, rhs = _fp8(rng, (1, 8, 256), E4M3), _fp8(rng, (1, 16, 256), E4M3)
  ls, rs = np.ones((1, 8, 2), np.float32), np.ones((1, 16, 2), np.float32)
  f = sm.scaled_matmul
  with pytest.raises(TypeError, match=r"lhs.dtype must be float8_e4m3fn.*bfloat16"):
    f(lhs.astype(jnp.bfloat16), rhs, ls, rs)
  with pytest.raises(TypeError, match="rhs_scales.dtype must be float32"):
    f(lhs, rhs, ls, rs.astype(np.int32))
  with pytest.raises(TypeError, match="preferred_element_type"):
    f(lhs, rhs, ls, rs, jnp.int8)
  with pytest.raises(ValueError, match=r"lhs_scales has 3 rows .*Accepted: \(1, 8, K_s\)"):
    f(lhs, rhs, np.ones((1, 3, 2), np.float32), rs)
  with pytest.raises(ValueError, match=r"rhs_scales's last dim 3 does not divide K=256.*"
                                       r"\(1, 1, K_s\) \(blocks of 128"):
    f(lhs, rhs, ls, np.ones((1, 16, 3), np.float32))
  with pytest.raises(ValueError, match="rhs_scales has batch 2"):
    f(lhs, rhs, ls, np.ones((2, 16, 2), np.float32))
  with pytest.raises(ValueError, match="must agree in B and K"):
    f(lhs, rhs[:, :, :128], ls, rs)
  with pytest.raises(ValueError, match="lhs_scales must have the operands' rank 3"):
    f(lhs, rhs, ls[0], rs)
  with pytest.raises(ValueError, match="backend must be"):
    f(lhs, rhs, ls, rs, backend="cublas")
  with pytest.raises(TypeError, match="config is the mosaic kernel's"):
    f(lhs, rhs, ls, rs, backend="xla", config=object())
  q = sm.quantize
  with pytest.raises(TypeError, match="dtype must be float8"):
    q(jnp.ones((4, 128)), jnp.int8)
  with pytest.raises(TypeError, match="x.dtype must be float32"):
    q(jnp.ones((4, 128), jnp.int32))
  with pytest.raises(ValueError, match=r"cols 128 must divide x's last \(contraction\) dim 200"):
    q(jnp.ones((4, 200)))
  with pytest.raises(ValueError, match="rows must be 1 or 128"):
    q(jnp.ones((4, 128)), block_shape=(64, 128))
  with pytest.raises(ValueError, match="x must be"):
    q(jnp.ones((128,)))
  with pytest.raises(ValueError, match="backend must be 'auto', 'xla' or 'mosaic'; got 'triton'"):
    q(jnp.ones((8, 128)), backend="triton")
  if checks.mosaic_unavailable_reason() is None:
    with pytest.raises(ValueError, match=r"backend='mosaic' cannot run this call.*blocks of"
                                         r" \(1, 128\) or \(128, 128\).*got \(1, 64\)"
                                         r".*backend='xla' can"):
      q(jnp.ones((8, 128)), block_shape=(1, 64), backend="mosaic")
    with pytest.raises(ValueError, match="128x128 blocks it takes M in multiples of 128.*"
                                         "got 8"):
      q(jnp.ones((8, 128)), block_shape=(128, 128), backend="mosaic")
    with pytest.raises(ValueError, match="rows .* in multiples of 8.*got 12"):
      q(jnp.ones((3, 4, 128)), backend="mosaic")


def test_dequantize_bad_input():
  values = jnp.ones((4, 128), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match=r"values must be \(R, K\) or \(B, R, K\); got shape \(128,\)"):
    sm.dequantize(values[0], jnp.ones((1,), jnp.float32))
  with pytest.raises(ValueError, match=r"values must be .*got shape \(1, 1, 4, 128\)"):
    sm.dequantize(values[None, None], jnp.ones((1, 1, 4, 1), jnp.float32))
  with pytest.raises(ValueError, match=r"scales must have values' rank 2; got shape \(1, 4, 1\)"):
    sm.dequantize(values, jnp.ones((1, 4, 1), jnp.float32))


# ----------------------------------------------------------------------------- training


@functools.partial(jax.jit, static_argnames=("backend", "grad_dtype", "wgrad", "dims",
                                             "precision"))
def _fp8_grads(x, w, dy, backend, grad_dtype=E4M3, wgrad="fp8",
               dims=(((1,), (0,)), ((), ())), precision=None):
  f = functools.partial(sm.fp8_dot_general, grad_dtype=grad_dtype, wgrad=wgrad,
                        backend=backend)
  y, vjp = jax.vjp(lambda a, b: f(a, b, dims, precision), x, w)
  return (y, *vjp(dy))


def _layer_case(rng, backend):
  """(m, k, n, x, w, dy) of a layer with ragged M, N and K (small under the CPU's
  interpreter), the backend skipped where it cannot run."""
  _skip_backend(backend)
  m, k, n = (64, 128, 136) if backend == "mosaic" and not ON_GPU else (300, 200, 260)
  x, w = random(rng, (m, k), np.float32), random(rng, (k, n), np.float32)
  return m, k, n, x, w, random(rng, (m, n), np.float32)


def _pad(a, rows, cols):
  """a (2-D) with zero rows and columns appended."""
  return np.pad(a, ((0, rows), (0, cols)))


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_fp8_dot_general_gemms(rng, backend):
  # Forward, dgrad and wgrad are the scaled products of the operands quantized as the
  # layer's docstring says (ragged M, N and K: the layer pads them to 128s).
  m, k, n, x, w, dy = _layer_case(rng, backend)
  y, dx, dw = _fp8_grads(x, w, dy, backend, E5M2)
  x8, sx = sm.quantize(_pad(x, 0, -k % 128))
  w8, sw = sm.quantize(_pad(w.T, -n % 128, -k % 128), block_shape=(128, 128))
  _check(y, x8, w8[:n], sx, sw)
  dy8, sdy = sm.quantize(_pad(dy, 0, -n % 128), E5M2)
  _check(dx, dy8, w8.T[:k], sdy, sw.T)
  dyt8, sdyt = sm.quantize(_pad(dy.T, 0, -m % 128), E5M2)
  xt8, sxt = sm.quantize(_pad(x.T, 0, -m % 128))
  _check(dw.T, dyt8, xt8, sdyt, sxt)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  # wgrad="input": the same forward and dgrad, the weight gradient x^T @ dy unquantized
  # at the call's precision (HIGHEST: IEEE float32, where the default is TF32 on a GPU).
  highest = jax.lax.Precision.HIGHEST
  y2, dx2, dw2 = _fp8_grads(x, w, dy, backend, E5M2, "input", precision=highest)
  np.testing.assert_array_equal(y2, y)
  np.testing.assert_array_equal(dx2, dx)
  err = reference.relative_error(dw2, reference.reference(x.T, dy))
  assert dw2.dtype == w.dtype and err <= reference.tolerance(np.float32, highest, m), err


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_fp8_dot_general_wgrad_fp8_block(rng, backend):
  # wgrad="fp8-block": the forward and dgrad of "fp8" bit for bit, the weight gradient
  # the product of x^T in 1x128 blocks and dy^T in 128x128 blocks along the batch (ragged
  # M and N, padded to 128s inside; K, the weight gradient's rows, ragged too).
  m, k, n, x, w, dy = _layer_case(rng, backend)
  y, dx, dw = _fp8_grads(x, w, dy, backend, wgrad="fp8-block")
  y1, dx1, _ = _fp8_grads(x, w, dy, backend)
  np.testing.assert_array_equal(y, y1)
  np.testing.assert_array_equal(dx, dx1)
  xt8, sxt = sm.quantize(_pad(x.T, 0, -m % 128))
  dyt8, sdyt = sm.quantize(_pad(dy.T, -n % 128, -m % 128), block_shape=(128, 128))
  _check(dw, xt8, dyt8[:n], sxt, sdyt)
  assert dw.dtype == w.dtype and dw.shape == w.shape


@pytest.mark.parametrize("wgrad", ["fp8", "fp8-block"])
def test_fp8_dot_general_batched_is_each_entry(rng, wgrad):
  # A batched layer: each batch entry's forward and gradients those of the entry alone
  # (each quantized, transposed for the weight gradient, on its own): the same fp8
  # operands, so the same sums up to their order (a batched float32 dot on a GPU may
  # sum in another order than the entry's own).
  b, m, k, n = 2, 130, 256, 136
  x, w = random(rng, (b, m, k), np.float32), random(rng, (b, k, n), np.float32)
  dy = random(rng, (b, m, n), np.float32)
  got = _fp8_grads(x, w, dy, "xla", wgrad=wgrad, dims=(((2,), (1,)), ((0,), (0,))))
  for i in range(b):
    one = _fp8_grads(x[i], w[i], dy[i], "xla", wgrad=wgrad)
    for a, e in zip(got, one, strict=True):
      e = np.asarray(e)
      np.testing.assert_allclose(np.asarray(a)[i], e, rtol=0, atol=1e-5 * np.abs(e).max())


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_fp8_dot_general_wgrad_input_batched_bf16(rng, backend):
  # A batched bf16 layer: the unquantized weight gradient per batch entry, in bf16.
  _skip_backend(backend)
  b, m, k, n = 2, 130, 256, 136
  x = jnp.asarray(random(rng, (b, m, k), np.float32), jnp.bfloat16)
  w = jnp.asarray(random(rng, (b, k, n), np.float32), jnp.bfloat16)
  dy = jnp.asarray(random(rng, (b, m, n), np.float32), jnp.bfloat16)
  y, dx, dw = _fp8_grads(x, w, dy, backend, wgrad="input",
                         dims=(((2,), (1,)), ((0,), (0,))))
  assert y.shape == dy.shape and dx.shape == x.shape and dw.shape == w.shape
  assert dw.dtype == jnp.bfloat16
  ref = np.einsum("bmk,bmn->bkn", np.asarray(x, np.float64), np.asarray(dy, np.float64))
  err = reference.relative_error(dw.astype(jnp.float32), ref)
  assert err <= reference.tolerance(jnp.bfloat16, None, m), err


@pytest.mark.parametrize("wgrad", ["fp8", "fp8-block", "input"])
def test_fp8_dot_general_rhs_stored_n_by_k(rng, wgrad):
  # rhs stored (N, K) (contracted on its last dim) is quantized as stored, (K, N) as well:
  # the same 128x128 blocks either way, so the same numbers bit for bit, gradients too
  # (wgrad="input" aside: XLA's unquantized dot for the two layouts' weight gradients may
  # sum in different orders on a GPU, so those agree to float32 rounding).
  m, k, n = 72, 200, 136
  x, w = random(rng, (m, k), np.float32), random(rng, (k, n), np.float32)
  dy = random(rng, (m, n), np.float32)
  kn = _fp8_grads(x, w, dy, "xla", wgrad=wgrad)
  nk = _fp8_grads(x, np.ascontiguousarray(w.T), dy, "xla", wgrad=wgrad,
                  dims=(((1,), (1,)), ((), ())))
  np.testing.assert_array_equal(nk[0], kn[0])
  np.testing.assert_array_equal(nk[1], kn[1])
  if wgrad == "input":
    np.testing.assert_allclose(nk[2], np.asarray(kn[2]).T, rtol=1e-5, atol=1e-5)
  else:
    np.testing.assert_array_equal(nk[2], np.asarray(kn[2]).T)


@pytest.mark.parametrize("k, n", [(0, 8), (128, 0)], ids=["empty_contraction", "no_columns"])
def test_fp8_dot_general_empty(k, n):
  x, w, dy = jnp.ones((4, k)), jnp.ones((k, n)), jnp.ones((4, n))
  y, dx, dw = _fp8_grads(x, w, dy, "xla")
  assert y.shape == (4, n) and dx.shape == (4, k) and dw.shape == (k, n)
  assert not np.asarray(y).any() and not np.asarray(dx).any() and not np.asarray(dw).any()


def test_fp8_dot_general_in_flax(rng):
  nn = pytest.importorskip("flax.linen")
  x = jnp.asarray(random(rng, (2, 8, 128), np.float32), jnp.bfloat16)
  dense = nn.Dense(256, dtype=jnp.bfloat16, dot_general=sm.fp8_dot_general)
  params = dense.init(jax.random.key(0), x)
  y = jax.jit(dense.apply)(params, x)
  kernel = params["params"]["kernel"]
  direct = jax.jit(sm.fp8_dot_general, static_argnums=2)(
      x, kernel.astype(jnp.bfloat16), (((2,), (0,)), ((), ())))
  assert y.shape == (2, 8, 256) and y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(direct, np.float32))
  grads = jax.jit(jax.grad(lambda p: jnp.sum(dense.apply(p, x).astype(jnp.float32) ** 2)))(
      params)
  assert grads["params"]["kernel"].shape == kernel.shape
  assert np.isfinite(np.asarray(grads["params"]["kernel"])).all()


def test_fp8_dot_general_bad_input():
  with pytest.raises(TypeError, match="lhs.dtype must be float32"):
    sm.fp8_dot_general(jnp.ones((4, 128), jnp.int32), jnp.ones((128, 8)),
                       (((1,), (0,)), ((), ())))
  with pytest.raises(TypeError, match="grad_dtype must be float8"):
    sm.fp8_dot_general(jnp.ones((4, 128)), jnp.ones((128, 8)), (((1,), (0,)), ((), ())),
                       grad_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"wgrad must be one of \('fp8', 'fp8-block', 'input'\);"
                     " got 'bf16'"):
    sm.fp8_dot_general(jnp.ones((4, 128)), jnp.ones((128, 8)), (((1,), (0,)), ((), ())),
                       wgrad="bf16")


# ----------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(4096, 4096, 4096), (4097, 4095, 4096),
                                     (4096, 7168, 2048)])
@pytest.mark.parametrize("layouts", [("1x128", "128x128"), ("tensor", "tensor"),
                                     ("1x128", "1x128")])
def test_real_sizes_gpu(rng, m, n, k, layouts):
  _skip_backend("mosaic")
  _run(rng, "mosaic", 1, m, n, k, *layouts, out_dtype=np.dtype(jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["normal", "wide"])
def test_error_vs_cublaslt_pattern_gpu(rng, family):
  # Per-tensor scales on the same inputs: the kernel's error (default: promoted every
  # 128 of K) is no worse than the cuBLASLt fp8 GEMM XLA makes of the scaled pattern
  # (both with float32 results). The pattern must compile to that GEMM: otherwise it is
  # a wider-precision dot, not fp8, and the comparison says nothing.
  _skip_backend("mosaic")
  m = n = k = 4096
  lo, hi = (0, 0) if family == "normal" else (-20, 20)
  x = random(rng, (m, k), np.float32) * _scales(rng, (m, 1), lo, hi)
  w = random(rng, (n, k), np.float32) * _scales(rng, (1, k), lo, hi)
  x8, sx = sm.quantize(jnp.asarray(x), block_shape=None)
  w8, sw = sm.quantize(jnp.asarray(w), block_shape=None)
  ref = reference.scaled_reference(x8, w8, sx, sw)
  ours = sm.scaled_matmul(x8, w8, sx, sw, backend="mosaic")
  pattern = jax.jit(functools.partial(sm_xla.per_tensor_pattern, out_dtype=jnp.float32))
  args = (x8, w8, jnp.reshape(sx, ()), jnp.reshape(sw, ()))  # 0-d, outside the jit
  hlo = pattern.lower(*args).compile().as_text()
  assert sm_xla.is_cublaslt_fp8(hlo), (
      f"XLA did not rewrite the per-tensor pattern to {sm_xla.CUBLASLT_FP8_TARGET}")
  cublaslt = pattern(*args)
  assert reference.relative_error(ours, ref) <= reference.relative_error(cublaslt, ref)


# ----------------------------------------------------------------------------- gated_quantized
# moe_mlp's fp8 inference form between its two GEMMs: a = silu(gate) * up of the grouped
# fp8 product, quantized in 1x128 blocks (`pallas_gemm.fp8.gated_quantized`). "mosaic" runs
# the kernel in the interpreter on a CPU (seconds a call: fewer cases there).


def _gated_operands(rng, m, k, f, sizes):
  """As `_ragged_operands` for w (G, 2F, K), every 128x128 weight block scaled by its own
  2^u, u in [-6, 6] (the gate's and the up's blocks apart): a kernel that read another
  block's scale (the gate's for the up, another group's, another K step's) is off by
  powers of two."""
  g = len(sizes)
  x = random(rng, (m, k), np.float32)
  w = random(rng, (g, 2 * f, k), np.float32)
  factor = np.exp2(rng.integers(-6, 7, (g, 2 * f // 128, 1, k // 128, 1))).astype(np.float32)
  w = (w.reshape(g, 2 * f // 128, 128, k // 128, 128) * factor).reshape(g, 2 * f, k)
  x8, sx = sm.quantize(jnp.asarray(x), E4M3)
  w8, sw = sm.quantize(jnp.asarray(w), E4M3, block_shape=(128, 128))
  assert np.unique(np.asarray(sw)).size > 1
  return x8, w8, np.asarray(sizes, np.int32), sx, sw


def _gated_reference(x8, w8, sizes, sx, sw, activation):
  """a (M, F) in float64 from the dequantized operands."""
  h = reference.scaled_ragged_reference(x8, w8, sizes, sx, sw)
  f = h.shape[1] // 2
  with jax.enable_x64(True):
    gate = np.asarray(reference.ACTIVATIONS[activation](jnp.asarray(h[:, :f])))
  return gate * h[:, f:]


def _skip_gated(backend):
  if backend == "mosaic" and (why := sm.fp8.gated_kernel_reason(
      jnp.zeros((8, 128), E4M3), jnp.zeros((1, 256, 128), E4M3), E4M3)) is not None:
    pytest.skip(f"mosaic unavailable: {why}")


# (M, K, F, group sizes): an empty group, 1-row groups, groups no multiple of 8 or of the
# 128-row tile, rows past the groups, M no multiple of 8; one K step; several 128-column
# blocks of F. The kernel's two tile shapes (`mosaic_gated.tiles`): 128 rows at M = 300,
# 64 rows (groups averaging under 64) in the others, 16 groups in the last.
_GATED_CASES = [(300, 256, 128, (50, 0, 130, 97)),
                (261, 128, 256, (1, 1, 200, 0, 59)),
                (45, 384, 384, (3, 0, 30)),
                (517, 256, 256, (40, 0, 7, 64, 33, 1, 0, 90, 25, 31, 64, 12, 0, 50, 60, 19))]


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
@pytest.mark.parametrize("m, k, f, sizes", _GATED_CASES)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_quantized(rng, backend, m, k, f, sizes, activation):
  _skip_gated(backend)
  if backend == "mosaic" and not ON_GPU and (activation == "gelu" or m not in (300, 45)):
    pytest.skip("the interpreter takes seconds a call: two cases on a CPU (one per tile"
                " shape)")
  x8, w8, sizes, sx, sw = _gated_operands(rng, m, k, f, sizes)
  values, scales_ = sm.fp8.gated_quantized(x8, w8, jnp.asarray(sizes), sx, sw, activation,
                                           backend=backend)
  assert values.shape == (m, f) and values.dtype == E4M3
  assert scales_.shape == (m, f // 128) and scales_.dtype == np.float32
  ref = _gated_reference(x8, w8, sizes, sx, sw, activation)
  out = np.asarray(sm.dequantize(values, scales_), np.float64)
  tol = reference.tolerance(E4M3, None, k, E4M3)
  err = reference.relative_error(out, ref)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"
  # Every row is written: rows in no group are zeros.
  assert np.all(out[int(np.sum(sizes)):] == 0)
  # Each block's scale is the smallest power of two that holds it (quantize's rule): its
  # largest value lands in [max / 2, max] of e4m3 (448)...
  got = np.asarray(scales_)
  assert np.all(got == np.exp2(np.round(np.log2(got))))
  top = np.abs(np.asarray(values, np.float32)).reshape(m, f // 128, 128).max(-1)
  amax = np.abs(ref).reshape(m, f // 128, 128).max(-1)
  assert np.all((top[amax > 0] >= 224) & (top[amax > 0] <= 448))
  # ... and it is the reference's, but where the reference's amax lies within the
  # kernel's sums' rounding (fp8 wgmma keeps ~14 bits, 2^-10 here) of a power of two.
  _, want = sm.quantize(jnp.asarray(ref, np.float32), E4M3, backend="xla")
  with np.errstate(divide="ignore", invalid="ignore"):  # all-zero blocks: -inf, NaN
    log = np.log2(amax / 448.0)
    near = np.abs(log - np.round(log)) < 2.0 ** -10
  np.testing.assert_array_equal(np.where(near, 0, got), np.where(near, 0, np.asarray(want)))


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_gated_quantized_nan_stays_in_its_row(rng, backend):
  _skip_gated(backend)
  x8, w8, sizes, sx, sw = _gated_operands(rng, 200 if ON_GPU else 40, 256, 128,
                                          (70, 0, 100) if ON_GPU else (13, 0, 20))
  x_nan = x8.at[15, 3].set(jnp.nan)
  values, scales_ = sm.fp8.gated_quantized(x_nan, w8, jnp.asarray(sizes), sx, sw, "silu",
                                           backend=backend)
  out = np.asarray(sm.dequantize(values, scales_), np.float32)
  assert np.isnan(out[15]).all() and np.isfinite(np.delete(out, 15, axis=0)).all()


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
@pytest.mark.parametrize("m, k, f, g", [(0, 256, 128, 2), (16, 0, 128, 2), (16, 256, 0, 2),
                                        (16, 256, 128, 0)])
def test_gated_quantized_empty(rng, backend, m, k, f, g):
  # No row, no contraction (a = act(0) * 0 = 0), no column, no group: zeros of the
  # documented shapes, with the scales `quantize` gives zero blocks.
  _skip_gated(backend)
  x8 = jnp.zeros((m, k), E4M3)
  w8 = jnp.zeros((g, 2 * f, k), E4M3)
  sizes = jnp.full((g,), m // max(g, 1), jnp.int32)
  sx = jnp.ones((m, k // 128), jnp.float32)
  sw = jnp.ones((g, 2 * f // 128, k // 128), jnp.float32)
  values, scales_ = sm.fp8.gated_quantized(x8, w8, sizes, sx, sw, "silu", backend=backend)
  assert values.shape == (m, f) and scales_.shape == (m, f // 128)
  assert not np.asarray(values, np.float32).any()
  _, want = sm.quantize(jnp.zeros((8, 128)), E4M3, backend="xla")
  assert np.all(np.asarray(scales_) == np.asarray(want)[0, 0])


def test_gated_quantized_bad_input(rng):
  x8, w8, sizes, sx, sw = _ragged_operands(rng, 16, 256, 256, (8, 8))
  gs, f = jnp.asarray(sizes), sm.fp8.gated_quantized
  with pytest.raises(ValueError, match="activation must be one of"):
    f(x8, w8, gs, sx, sw, "relu")
  with pytest.raises(ValueError, match=r"rhs must be \(G, 2F, K\) with F a multiple of 128"):
    f(x8, w8[:, :128], gs, sx, sw[:, :1], "silu")
  with pytest.raises(ValueError, match="backend must be"):
    f(x8, w8, gs, sx, sw, "silu", backend="cuda")
  for backend in ("xla", "mosaic"):
    with pytest.raises(ValueError, match=r"lhs_scales must be \(16, 2\)"):
      f(x8, w8, gs, sx[:, :1], sw, "silu", backend=backend)
    with pytest.raises(TypeError, match="dtype must be float8_e4m3fn or float8_e5m2; got"):
      f(x8, w8, gs, sx, sw, "silu", dtype=jnp.bfloat16, backend=backend)
    with pytest.raises(TypeError, match="dtype must be float8_e4m3fn or float8_e5m2; got"):
      f(x8, w8, gs, sx, sw, "silu", dtype="nope", backend=backend)
    with pytest.raises(TypeError, match="lhs.dtype must be float8_e4m3fn"):
      f(x8.astype(jnp.bfloat16), w8, gs, sx, sw, "silu", backend=backend)
