"""`quantize`: x split into fp8 values and power-of-two float32 scales, on the XLA path
(a reduction and a scaled cast) or the one-pass Hopper kernel (`mosaic_quantize`); both
compute `scales`' arithmetic, bit for bit."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_gemm.core import primitive, sharding
from pallas_gemm.fp8 import checks, mosaic_quantize, partition
from pallas_gemm.fp8.scales import (FP8_DTYPES, INPUT_DTYPES, ROW_BLOCK, pow2, saturation,
                                     scale_exponent)
from pallas_gemm.mgpu import hw


def check_dtype(dtype) -> np.dtype:
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2; got {dtype!r}") from None
  if dtype not in FP8_DTYPES:
    raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2; got {dtype}")
  return dtype


def _block(block_shape, m: int, k: int, contracted: str = "last"
           ) -> tuple[int, int, int, int]:
  """(rows per block, block_k, scale rows, scale columns) for x (., m, k), k the
  contraction, x's `contracted` dim; ValueError."""
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
    raise ValueError(f"block_shape's cols {block_k} must divide x's {contracted}"
                     f" (contraction) dim {k}, as jax.nn.scaled_matmul's block size K // K_s"
                     f" does; pad that dim with zeros to a multiple, or pass"
                     f" block_shape=({rows}, {k})")
  return rows, block_k, (m if rows == 1 else math.ceil(m / rows)), k // block_k


def _kernel_reason(block, b: int, m: int) -> str | None:
  """Why the Hopper quantize kernel cannot take this call (x (B, M, K)), or None."""
  if block not in ((1, 128), (128, 128)):
    return (f"it takes blocks of (1, 128) or (128, 128) (rows, columns); got"
            f" ({block[0]}, {block[1]})")
  if block[0] == 1 and (b * m) % 8:
    return f"it takes rows (B * M) in multiples of 8 (a TMA tile); got {b * m}"
  if block[0] == 128 and m % 128:
    return f"with 128x128 blocks it takes M in multiples of 128 (whole blocks); got {m}"
  return None


def _choose(backend, block, b: int, m: int, k: int, x) -> str:
  """The quantize backend for a validated call: "xla" or "mosaic" (see `quantize`), as
  scaled_matmul chooses (`checks.choose`); an empty x takes xla under any backend."""
  if backend not in (*checks.BACKENDS, "auto"):
    raise ValueError(f"backend must be 'auto', 'xla' or 'mosaic'; got {backend!r}")
  if b * m == 0 or k == 0:  # nothing to compute
    return "xla"
  return checks.choose(backend, None,
                       _kernel_reason(block, b, m) or sharding.explicit_reason(x))


def quantize(x, dtype=jnp.float8_e4m3fn, block_shape=(1, 128), *, transpose=False,
             backend="auto"):
  """Splits x into fp8 values and float32 scales in the layout `scaled_matmul` takes.

      values, scales = quantize(x)                       # 1x128 blocks (activations)
      w8, w_scales = quantize(w, block_shape=(128, 128)) # weights: (N, K), K contracted
      t8, t_scale = quantize(x, block_shape=None)        # one scale per tensor

  Args:
    x: (M, K) or (B, M, K), float32, bfloat16 or float16; the last dim is the one a
      matmul contracts (with transpose=True: (K, M) or (B, K, M), the second-to-last).
    dtype: float8_e4m3fn (448 max, 3 mantissa bits) or float8_e5m2 (57344, 2 bits).
    block_shape: (1, bk): a scale per row and bk columns; (128, bk): per 128 rows and bk
      columns (the last block of rows may be partial); None: one scale per tensor (per
      batch entry). bk must divide K (jax.nn.scaled_matmul's block size is K // K_s).
    transpose: quantize x with its last two dims swapped (the operands of a weight
      gradient, contracted over what were x's rows): the same values and scales as
      `quantize(jnp.swapaxes(x, -1, -2), ...)`, values and scales shaped as for that
      (M, K) operand. The Hopper kernel reads x in place (one pass, no transposed copy
      of x) where x's last dim (M) is a multiple of 128; otherwise x is transposed first.
    backend: "xla": a reduction and a scaled cast (two passes over x), everywhere.
      "mosaic": the Hopper kernel of mosaic_quantize.py (one pass, the same numbers
      bit for bit) for block_shape (1, 128) with B * M a multiple of 8, and (128, 128)
      with M a multiple of 128; interpret mode on a CPU. "auto": mosaic on a Hopper GPU
      where it takes the call, else xla.

  Returns:
    (values, scales): values of x's shape (its last two dims swapped with transpose) in
    `dtype`; scales float32 of x's rank:
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
  dtype = check_dtype(dtype)
  if not isinstance(transpose, bool):
    raise TypeError(f"transpose must be a bool; got {transpose!r}")
  squeeze = x.ndim == 2
  x3 = jnp.asarray(x)[None] if squeeze else jnp.asarray(x)
  b, m, k = x3.shape
  block = _block(block_shape, *((k, m) if transpose else (m, k)),
                 "second-to-last" if transpose else "last")
  if transpose:  # x3 (B, K, M) holds the (B, M, K) operand transposed
    m, k = k, m
    if m % 128:  # the kernel reads x's last dim (M) in whole 128-wide tiles
      x3, transpose = jnp.swapaxes(x3, 1, 2), False
  if _choose(backend, block[:2], b, m, k, x3) == "mosaic":
    interpret = not hw.on_gpu()
    rows = block[0]

    def kernel(x_local):
      with primitive.kernel_x64("mosaic"):
        if not transpose:
          return mosaic_quantize.quantize_rows(x_local, dtype, block_rows=rows,
                                               interpret=interpret)
        bl, kl, ml = x_local.shape
        values, scales = mosaic_quantize.quantize_rows(
            x_local, dtype, block_rows=rows, read_transposed=True, interpret=interpret)
        return values.reshape(bl, ml, kl), scales.reshape(bl, ml // rows, kl // 128)

    if transpose:
      values, scales = partition.quantize_rows(kernel, x3, block_rows=rows,
                                               layout="transposed", interpret=interpret)
    else:
      values, scales = partition.quantize_rows(kernel, x3.reshape(b * m, k),
                                               block_rows=rows, interpret=interpret)
    values, scales = values.reshape(b, m, k), scales.reshape(b, m // rows, k // 128)
  else:
    values, scales = _quantize(jnp.swapaxes(x3, 1, 2) if transpose else x3, dtype=dtype,
                               block=block)
  return (values[0], scales[0]) if squeeze else (values, scales)


@functools.partial(jax.jit, static_argnames=("dtype", "block"))
def _quantize(x3, *, dtype, block):
  """`quantize` of a validated (B, M, K) x; block from `_block`."""
  b, m, k = x3.shape
  rows, block_k, scale_rows, scale_cols = block
  if k == 0:  # no values; one scale of 1 per row block (the layout K == 0 takes)
    return x3.astype(dtype), jnp.ones((b, scale_rows, 1), jnp.float32)
  padded_m = scale_rows * rows
  if padded_m != m:  # a partial last block of rows: zeros do not change its amax
    x3 = jnp.pad(x3, ((0, 0), (0, padded_m - m), (0, 0)))
  # Under Explicit mesh axes the reshapes name their result's sharding: each block
  # dimension keeps the split of the dimension it came from (a weight split over its
  # experts stays split over them).
  sb, sm, sk = jax.typeof(x3).sharding.spec
  if sharding.explicitly_sharded(x3):
    # A split of M or K that does not divide its blocks is not kept (x3 gathered on it).
    mesh = jax.typeof(x3).sharding.mesh
    keep = lambda axes, blocks: axes if blocks % sharding.size(  # noqa: E731
        mesh, sharding.axes(axes)) == 0 else None
    if (keep(sm, scale_rows), keep(sk, scale_cols)) != (sm, sk):
      sm, sk = keep(sm, scale_rows), keep(sk, scale_cols)
      x3 = jax.sharding.reshard(x3, NamedSharding(mesh, P(sb, sm, sk)))
  blocks = _reshape(x3, (b, scale_rows, rows, scale_cols, block_k), (sb, sm, None, sk, None))
  # The amax in x's own dtype (abs, max and isfinite are exact in any float type), so
  # that both passes read x as it is and convert inside their fusions: a float32 x read
  # by the reduction and by the scaled cast is one XLA materializes, twice a bf16 x's
  # bytes (28 GiB for a DeepSeek-V3-like layer's w_gate_up).
  zero = jnp.zeros((), blocks.dtype)
  amax = jnp.max(jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), zero), axis=(2, 4))
  e = scale_exponent(amax.astype(jnp.float32), dtype)
  scales = pow2(e)
  inverse = pow2(-e)  # exact too: amax < 2^128 keeps e <= 128 - fmax_exp, so -e >= -126
  scaled = blocks.astype(jnp.float32) * inverse[:, :, None, :, None]
  limit = saturation(e, dtype)[:, :, None, :, None]
  values = jnp.clip(scaled, -limit, limit).astype(dtype)  # clip keeps NaN
  return _reshape(values, (b, padded_m, k), (sb, sm, sk))[:, :m], scales


def _reshape(x, shape, spec):
  """x.reshape(shape), typed with the given partition spec where x is explicitly sharded."""
  if not sharding.explicitly_sharded(x):
    return x.reshape(shape)
  mesh = jax.typeof(x).sharding.mesh
  return jax.lax.reshape(x, shape, out_sharding=NamedSharding(mesh, P(*spec)))
