"""fp8 values with float32 scales: the scale layouts, `quantize` and `dequantize`.

A quantized operand is a pair (values, scales): values (B, R, K) in float8_e4m3fn or
float8_e5m2, and scales (B, R_s, K_s) float32 with

    operand[b, r, k] = values[b, r, k] * scales[b, r // rows, k // block_k]

(`jax.nn.scaled_matmul`'s meaning: multiply to dequantize). The layout is read from the
scales' shape alone, as in jax.nn.scaled_matmul:
  (B, R, K_s)             one scale per row and per block of K // K_s along K (K_s divides
                          K): 1x128 blocks (DeepSeek-V3's activations), 1x32 (MX formats),
                          1xK (one scale per row);
  (B, ceil(R/128), K_s)   128 x (K // K_s) blocks of rows: DeepSeek-V3's 128x128 weights;
  (B, 1, 1)               one scale per tensor (per batch entry).
Where two readings coincide (R <= 128, R == 1, K_s == 1) they mean the same numbers.
The last axis is always the contraction axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
# Scale dtypes taken as they are (each converts to float32 exactly): float32, and the
# narrower ones other scaled-matmul code produces (float8_e8m0fnu: MX's power-of-two scales).
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16),
                np.dtype(jnp.float8_e8m0fnu))
INPUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
ROW_BLOCK = 128  # the row extent of a weight block (DeepSeek-V3's 128x128)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleLayout:
  """How a scale tensor covers its operand (B, R, K): one scale per `rows` rows and
  `block_k` columns. rows is 1, ROW_BLOCK, or R (with block_k == K: per tensor)."""

  rows: int
  block_k: int
  per_tensor: bool = False

  def describe(self) -> str:
    if self.per_tensor:
      return "per tensor"
    return f"{'1' if self.rows == 1 else self.rows}x{self.block_k} blocks"


def accepted_shapes(b: int, r: int, k: int, *, rows_name: str) -> str:
  """The scale shapes an operand (b, r, k) takes, for error messages."""
  return (f"({b}, {r}, K_s) with K_s dividing K={k} (blocks of 1 x K/K_s: 128, 32, K, ...),"
          f" ({b}, {math.ceil(r / ROW_BLOCK)}, K_s) (blocks of {ROW_BLOCK} {rows_name} x K/K_s)"
          f" or ({b}, 1, 1) (per tensor)")


def scale_layout(scales_shape, operand_shape, *, name: str, rows_name: str) -> ScaleLayout:
  """The layout of scales `scales_shape` over an operand (B, R, K); ValueError otherwise."""
  b, r, k = operand_shape
  accepted = accepted_shapes(b, r, k, rows_name=rows_name)
  if len(scales_shape) != 3:
    raise ValueError(f"{name} must be 3-D like its operand; got shape {tuple(scales_shape)}."
                     f" Accepted: {accepted}")
  sb, sr, sk = scales_shape
  if sb != b:
    raise ValueError(f"{name} has batch {sb}, its operand has {b}: shape {tuple(scales_shape)}."
                     f" Accepted: {accepted}")
  if sk < 1 or (k % sk if k else sk != 1):
    raise ValueError(f"{name}'s last dim {sk} does not divide K={k} (block size K // K_s)."
                     f" Accepted: {accepted}")
  block_k = k // sk if k else 0
  if sr == r:
    return ScaleLayout(rows=1, block_k=block_k)
  if sr == 1 and sk == 1:
    return ScaleLayout(rows=max(r, 1), block_k=block_k, per_tensor=True)
  if sr == math.ceil(r / ROW_BLOCK):
    return ScaleLayout(rows=ROW_BLOCK, block_k=block_k)
  raise ValueError(f"{name} has {sr} rows for an operand of {r} {rows_name}: shape"
                   f" {tuple(scales_shape)}. Accepted: {accepted}")


def expand(scales, layout: ScaleLayout, operand_shape):
  """The scales as float32, broadcastable against the operand (B, R, K)."""
  _, r, k = operand_shape
  s = jnp.asarray(scales).astype(jnp.float32)
  if layout.per_tensor:
    return s
  if layout.rows > 1 and s.shape[1] > 1:
    s = jnp.repeat(s, layout.rows, axis=1, total_repeat_length=s.shape[1] * layout.rows)[:, :r]
  if s.shape[2] > 1:
    s = jnp.repeat(s, layout.block_k, axis=2, total_repeat_length=k)
  return s


def dequantize(values, scales):
  """values * scales (expanded over their blocks) in float32: the operand a (values,
  scales) pair stands for. values (B, R, K) or (R, K), scales in a layout of the module
  docstring (with values' rank)."""
  values, scales = jnp.asarray(values), jnp.asarray(scales)
  if values.ndim not in (2, 3):
    raise ValueError(f"values must be (R, K) or (B, R, K); got shape {tuple(values.shape)}")
  if scales.ndim != values.ndim:
    raise ValueError(f"scales must have values' rank {values.ndim}; got shape"
                     f" {tuple(scales.shape)}")
  squeeze = values.ndim == 2
  if squeeze:
    values, scales = values[None], scales[None]
  layout = scale_layout(scales.shape, values.shape, name="scales", rows_name="rows")
  out = values.astype(jnp.float32) * expand(scales, layout, values.shape)
  return out[0] if squeeze else out


def _check_dtype(dtype) -> np.dtype:
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2; got {dtype!r}") from None
  if dtype not in FP8_DTYPES:
    raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2; got {dtype}")
  return dtype


def _block(block_shape, m: int, k: int) -> tuple[int, int, int, int]:
  """(rows per block, block_k, scale rows, scale columns) for x (., m, k); ValueError."""
  if block_shape is None:
    return max(m, 1), k, 1, 1
  ok = (isinstance(block_shape, (tuple, list)) and len(block_shape) == 2
        and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in block_shape))
  if not ok:
    raise ValueError(f"block_shape must be None (per tensor) or a pair (rows, cols) such as"
                     f" (1, 128) or (128, 128); got {block_shape!r}")
  rows, block_k = (int(d) for d in block_shape)
  if rows not in (1, ROW_BLOCK):
    raise ValueError(f"block_shape's rows must be 1 or {ROW_BLOCK} (the layouts scaled_matmul"
                     f" reads from a scale's shape); got {block_shape!r}")
  if block_k < 1 or k % block_k:
    raise ValueError(f"block_shape's cols {block_k} must divide x's last (contraction) dim"
                     f" {k}, as jax.nn.scaled_matmul's block size K // K_s does; pad x's last"
                     f" dim with zeros to a multiple, or pass block_shape=({rows}, {k})")
  return rows, block_k, (m if rows == 1 else math.ceil(m / rows)), k // block_k


def _pow2(exponent):
  """2**exponent as float32, exactly, for integer exponents in [-126, 127]."""
  return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def _scale_exponent(amax, dtype):
  """e of a block's scale 2^e, int32, from its float32 amax (finite, >= 0): the smallest
  e with amax <= 2^e * max(dtype), kept in [-126, 127] (normal float32); 0 for a zero
  block. frexp is spelled in bits, ops the Hopper kernel (quantize_mosaic.py) lowers too,
  so both paths compute the same numbers: amax = mant * 2^exp with mant in [0.5, 1) and
  exp the exponent field - 126; a subnormal amax (field 0) gets -126 instead of its own
  exponent, which the clip maps to -126 either way."""
  fmax_mant, fmax_exp = np.frexp(float(jnp.finfo(dtype).max))
  bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
  exp = jax.lax.shift_right_logical(bits, 23) - 126
  # mant > fmax_mant, compared exactly: the fraction bits above fmax_mant's.
  mant_above = (bits & 0x7FFFFF) > int((fmax_mant * 2 - 1) * (1 << 23))
  e = exp - int(fmax_exp) + mant_above.astype(jnp.int32)
  return jnp.where(amax > 0, jnp.clip(e, -126, 127), 0)


def _saturation(e, dtype):
  """The largest |value| kept in a block of scale 2^e: max(dtype), or where that is
  larger, the greatest value below 2^(128 - e) with fp8's mantissa, (2 - 2^-nmant) *
  2^(127 - e), whose product with the scale stays finite. (Rounding to fp8 may carry an
  amax near 2^128 up to 2^(128 - e); the bound is exact in fp8 wherever it is below max.)"""
  top = _pow2(127 - jnp.maximum(e, 0)) * np.float32(2.0 - 2.0 ** -jnp.finfo(dtype).nmant)
  return jnp.minimum(np.float32(jnp.finfo(dtype).max), top)


def _kernel_reason(block, rows: int) -> str | None:
  """Why the Hopper quantize kernel cannot take this call, or None."""
  if block[0] != 1 or block[1] != 128:
    return (f"it takes block_shape (1, 128) (one scale per row and 128 columns); got"
            f" ({block[0]}, {block[1]})")
  if rows % 8:
    return f"it takes rows (B * M) in multiples of 8 (a TMA tile); got {rows}"
  return None


def _choose(backend, block, rows: int, k: int) -> str:
  """The quantize backend for a validated call: "xla" or "mosaic" (see `quantize`), as
  scaled_matmul chooses (`api._choose`); an empty x takes xla under any backend."""
  from pallas_gemm.fp8 import api  # noqa: PLC0415 - api imports this module

  if backend not in (*api.BACKENDS, "auto"):
    raise ValueError(f"backend must be 'auto', 'xla' or 'mosaic'; got {backend!r}")
  if rows == 0 or k == 0:  # nothing to compute
    return "xla"
  return api._choose(backend, None, _kernel_reason(block, rows))


def quantize(x, dtype=jnp.float8_e4m3fn, block_shape=(1, 128), *, backend="auto"):
  """Splits x into fp8 values and float32 scales in the layout `scaled_matmul` takes.

      values, scales = quantize(x)                       # 1x128 blocks (activations)
      w8, w_scales = quantize(w, block_shape=(128, 128)) # weights: (N, K), K contracted
      t8, t_scale = quantize(x, block_shape=None)        # one scale per tensor

  Args:
    x: (M, K) or (B, M, K), float32, bfloat16 or float16; the last dim is the one a
      matmul contracts.
    dtype: float8_e4m3fn (448 max, 3 mantissa bits) or float8_e5m2 (57344, 2 bits).
    block_shape: (1, bk): a scale per row and bk columns; (128, bk): per 128 rows and bk
      columns (the last block of rows may be partial); None: one scale per tensor (per
      batch entry). bk must divide K (jax.nn.scaled_matmul's block size is K // K_s).
    backend: "xla": a reduction and a scaled cast (two passes over x), everywhere.
      "mosaic": the Hopper kernel of quantize_mosaic.py (one pass, the same numbers
      bit for bit) for block_shape (1, 128) with B * M a multiple of 8; interpret mode
      on a CPU. "auto": mosaic on a Hopper GPU where it takes the call, else xla.

  Returns:
    (values, scales): values of x's shape in `dtype`; scales float32 of x's rank:
    (B, M, K/bk), (B, ceil(M/128), K/bk) or (B, 1, 1) (batch dim dropped for 2-D x), with
    x == values * scales expanded over each block, up to fp8 rounding.

  The scale is a power of two: the smallest 2^e with amax(block) <= 2^e * max(dtype).
  A power of two makes every step but the rounding to fp8 exact: x / 2^e and the
  dequantization values * 2^e lose nothing, and so does the kernel's product of an lhs
  and an rhs scale. It is also the convention of the MX formats (e8m0 scales) and of
  DeepSeek-V3's successors (UE8M0), so these scales feed those kernels unchanged. The
  price against an exact scale amax / max(dtype): the block's largest value lands in
  (max/2, max] instead of on max, which costs nothing in relative precision (a float's
  relative spacing does not depend on its exponent) and at most one binade of headroom
  above fp8's subnormals. A zero block gets scale 1. Exponents are kept in [-126, 127]
  (normal float32): a block whose amax is below ~2^-117 rounds to zeros and subnormals.

  Saturating: infinities become +-max(dtype) * scale (the amax ignores them); NaN stays
  NaN. Rounding to fp8 is to nearest even, except that a value which would round to
  2^128 / scale (within half an fp8 step of float32's max: its product with the scale
  is inf) saturates at the largest fp8 value below that.
  """
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"x must be an array; got {type(x).__name__}")
  if np.dtype(x.dtype) not in INPUT_DTYPES:
    raise TypeError(f"x.dtype must be float32, bfloat16 or float16; got {np.dtype(x.dtype)}")
  if x.ndim not in (2, 3):
    raise ValueError(f"x must be (M, K) or (B, M, K); got shape {tuple(x.shape)}")
  dtype = _check_dtype(dtype)
  squeeze = x.ndim == 2
  x3 = jnp.asarray(x)[None] if squeeze else jnp.asarray(x)
  b, m, k = x3.shape
  block = _block(block_shape, m, k)
  if _choose(backend, block[:2], b * m, k) == "mosaic":
    from pallas_gemm.fp8 import quantize_mosaic  # noqa: PLC0415 - GPU kernel, on demand

    # The kernel's index arithmetic is int32 (see api.scaled_matmul).
    with jax.enable_x64(False):
      values, scales = quantize_mosaic.quantize_rows(
          x3.reshape(b * m, k), dtype, interpret=jax.default_backend() != "gpu")
    values, scales = values.reshape(b, m, k), scales.reshape(b, m, k // 128)
  else:
    values, scales = _quantize(x3, dtype=dtype, block=block)
  return (values[0], scales[0]) if squeeze else (values, scales)


@functools.partial(jax.jit, static_argnames=("dtype", "block"))
def _quantize(x3, *, dtype, block):
  """`quantize` of a validated (B, M, K) x; block from `_block`."""
  b, m, k = x3.shape
  rows, block_k, scale_rows, scale_cols = block
  if k == 0:  # no values; one scale of 1 per row block (the layout K == 0 takes)
    return x3.astype(dtype), jnp.ones((b, scale_rows, 1), jnp.float32)
  xf = x3.astype(jnp.float32)
  padded_m = scale_rows * rows
  if padded_m != m:  # a partial last block of rows: zeros do not change its amax
    xf = jnp.pad(xf, ((0, 0), (0, padded_m - m), (0, 0)))
  blocks = xf.reshape(b, scale_rows, rows, scale_cols, block_k)
  amax = jnp.max(jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), 0.0), axis=(2, 4))
  e = _scale_exponent(amax, dtype)
  scales = _pow2(e)
  inverse = _pow2(-e)  # exact too: amax < 2^128 keeps e <= 128 - fmax_exp, so -e >= -126
  scaled = blocks * inverse[:, :, None, :, None]
  limit = _saturation(e, dtype)[:, :, None, :, None]
  values = jnp.clip(scaled, -limit, limit).astype(dtype)  # clip keeps NaN
  return values.reshape(b, padded_m, k)[:, :m], scales
