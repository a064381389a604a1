"""fp8 values with float32 scales: the scale layouts, `dequantize`, and the power-of-two
scale arithmetic `quantize` (quantize.py) computes them with.

A quantized operand is a pair (values, scales): values (B, R, K) in float8_e4m3fn or
float8_e5m2, and scales (B, R_s, K_s) float32 (bfloat16, float16 and float8_e8m0fnu scales
are read as their float32 values) with

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


def pow2(exponent):
  """2**exponent as float32, exactly, for integer exponents in [-126, 127]."""
  return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def scale_exponent(amax, dtype):
  """e of a block's scale 2^e, int32, from its float32 amax (finite, >= 0): the smallest
  e with amax <= 2^e * max(dtype), kept in [-126, 127] (normal float32); 0 for a zero
  block. frexp is spelled in bits, ops the Hopper kernel (mosaic_quantize.py) lowers too,
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


def saturation(e, dtype):
  """The largest |value| kept in a block of scale 2^e: max(dtype), or where that is
  larger, the greatest value below 2^(128 - e) with fp8's mantissa, (2 - 2^-nmant) *
  2^(127 - e), whose product with the scale stays finite. (Rounding to fp8 may carry an
  amax near 2^128 up to 2^(128 - e); the bound is exact in fp8 wherever it is below max.)"""
  top = pow2(127 - jnp.maximum(e, 0)) * np.float32(2.0 - 2.0 ** -jnp.finfo(dtype).nmant)
  return jnp.minimum(np.float32(jnp.finfo(dtype).max), top)
