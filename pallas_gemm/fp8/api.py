"""`scaled_matmul`: jax.nn.scaled_matmul's signature and meaning, on every backend.

    out = scaled_matmul(lhs, rhs, lhs_scales, rhs_scales)     # (B, M, N) float32
    out[b, m, n] = sum_k lhs[b, m, k] * ls[b, m, k] * rhs[b, n, k] * rs[b, n, k]

with ls, rs the scales expanded over their blocks (see scales.py for the layouts).
This module validates, reads the layouts from the scales' shapes, and picks a backend:
  "xla"     xla.py: dequantize in float32 and one float32 dot; every layout, everywhere.
  "mosaic"  the Hopper kernel (mosaic_gemm.py): fp8 wgmma with the products of each 128 of K
            scaled and summed in float32. It takes 1x128 / 128x128 (rhs) blocks, and
            per-row and per-tensor scales (applied in its epilogue); blocks along K of
            a multiple of 128 are handed to it repeated per 128, lhs blocks of 128
            rows repeated per row (the same numbers). Finer blocks (1x32) run on xla.
            On a CPU it runs in interpret mode. Every 128 of K is summed in float32,
            for constant (per-tensor, per-row) scales too: Hopper's fp8 tensor-core
            accumulation keeps ~14 mantissa bits, and all of K in it measured ~10x
            the error (f32 results, 4096^3 on the H100: 1.3e-3 against 1.3e-4) for
            ~1.2x the speed. That trade is opt-in:
            config=Config(fast_accumulation=True) with constant scales.
  "auto"    mosaic on a Hopper GPU when it takes the layout, else xla.

An infinite scale: xla multiplies each element by it, so a block's terms of both signs
sum to NaN (inf - inf), as the definition above does elementwise; the kernel multiplies
the block's (or, for constant scales, K's) sum of products by it and gives +-inf there.
A NaN scale, and an infinite one on a block of zeros, give NaN on both.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_gemm.fp8 import checks, partition, scales
from pallas_gemm.core import primitive, sharding
from pallas_gemm.mgpu import hw
from pallas_gemm.fp8 import xla as _xla

def _validate(lhs, rhs, lhs_scales, rhs_scales):
  """(lhs_layout, rhs_layout, squeeze): the checks, on 3-D views of 2-D arguments."""
  checks.operand(lhs, "lhs")
  checks.operand(rhs, "rhs")
  checks.check_scales(lhs_scales, "lhs_scales")
  checks.check_scales(rhs_scales, "rhs_scales")
  if lhs.ndim not in (2, 3) or rhs.ndim != lhs.ndim:
    raise ValueError(f"lhs and rhs must both be (B, M, K) and (B, N, K) (or both 2-D: (M, K),"
                     f" (N, K)); got shapes {tuple(lhs.shape)} and {tuple(rhs.shape)}")
  squeeze = lhs.ndim == 2
  for name, s in (("lhs_scales", lhs_scales), ("rhs_scales", rhs_scales)):
    if s.ndim != lhs.ndim:
      raise ValueError(f"{name} must have the operands' rank {lhs.ndim}; got shape"
                       f" {tuple(s.shape)}")
  lead = (lambda shape: (1,) + tuple(shape)) if squeeze else tuple
  ls, rs = lead(lhs.shape), lead(rhs.shape)
  if ls[0] != rs[0] or ls[2] != rs[2]:
    raise ValueError(f"lhs (B, M, K) and rhs (B, N, K) must agree in B and K (both contract"
                     f" their last dim); got shapes {tuple(lhs.shape)} and {tuple(rhs.shape)}")
  lhs_layout = scales.scale_layout(lead(lhs_scales.shape), ls, name="lhs_scales",
                                   rows_name="rows (M)")
  rhs_layout = scales.scale_layout(lead(rhs_scales.shape), rs, name="rhs_scales",
                                   rows_name="rows (N)")
  return lhs_layout, rhs_layout, squeeze


# ----------------------------------------------------------------------------- backends


def _repeat_rows(s, rows: int, total: int):
  """Scales of blocks of `rows` rows, one per row (the first `total`)."""
  return jnp.repeat(s, rows, axis=1, total_repeat_length=s.shape[1] * rows)[:, :total]


def _kernel_reason(layout: scales.ScaleLayout, k: int, name: str) -> str | None:
  """Why the kernel cannot take scales in `layout`, or None."""
  if layout.per_tensor or layout.block_k == k or layout.block_k % checks.K_BLOCK == 0:
    return None
  return (f"{name} in {layout.describe()}: the kernel scales per {checks.K_BLOCK} of K, so blocks"
          f" along K must be a multiple of {checks.K_BLOCK} long (or K itself)")


def _for_kernel(given, layout: scales.ScaleLayout, shape, *, row_blocks: bool):
  """Scales the kernel takes `_kernel_reason` None for, in a layout it reads: (B, 1, 1);
  (B, R, 1) (per row, applied in its epilogue); (B, R, ceil(K/128)); with row_blocks
  (rhs), (B, ceil(R/128), ceil(K/128)) too."""
  _, r, k = shape
  s = jnp.asarray(given).astype(jnp.float32)
  if layout.per_tensor:
    return s
  per_row = s.shape[2] == 1  # block_k == K
  if not per_row and layout.block_k != checks.K_BLOCK:
    s = jnp.repeat(s, layout.block_k // checks.K_BLOCK, axis=2,
                   total_repeat_length=k // checks.K_BLOCK)
  if layout.rows == scales.ROW_BLOCK and (per_row or not row_blocks):
    s = _repeat_rows(s, scales.ROW_BLOCK, r)
  return s


def scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32, *,
                  backend="auto", config=None):
  """Block-scaled fp8 matmul with `jax.nn.scaled_matmul`'s signature and meaning.

      a = lhs * repeat(lhs_scales)       # over each scale's block
      b = rhs * repeat(rhs_scales)
      out = einsum("BMK,BNK->BMN", a, b)  # accumulated in float32

  Args:
    lhs: (B, M, K) float8_e4m3fn or float8_e5m2.
    rhs: (B, N, K) float8_e4m3fn or float8_e5m2 (mixed with lhs allowed): K-major, as
      jax.nn.scaled_matmul takes it (a weight (K, N) is passed transposed).
    lhs_scales: float32, one of
      (B, M, K_a)              1 x K/K_a blocks (K_a divides K): 1x128, 1x32, 1xK, ...;
      (B, ceil(M/128), K_a)    128 x K/K_a blocks;
      (B, 1, 1)                one scale per tensor.
    rhs_scales: the same with N for M: (B, N, K_b), (B, ceil(N/128), K_b) (DeepSeek-V3's
      128x128 weight blocks with K_b = K/128) or (B, 1, 1). Unlike jax.nn.scaled_matmul,
      the two sides' layouts and block sizes need not match.
      bfloat16 / float16 / float8_e8m0fnu scales are read as their float32 values.
    preferred_element_type: the result dtype: float32 (default), bfloat16 or float16.
    backend: "auto" | "xla" | "mosaic" (see the module docstring).
    config: the mosaic kernel's Config (implies backend="mosaic" under "auto").

  All four arrays may instead be 2-D (no batch dim); the result is then (M, N).
  Returns (B, M, N) in preferred_element_type.

  Raises TypeError for dtypes outside those above and ValueError, naming the argument and
  listing the shapes it accepts, for shapes that do not fit.
  """
  lhs_layout, rhs_layout, squeeze = _validate(lhs, rhs, lhs_scales, rhs_scales)
  out_dtype = checks.out_dtype(preferred_element_type)
  args = [jnp.asarray(x) for x in (lhs, rhs, lhs_scales, rhs_scales)]
  if squeeze:
    args = [x[None] for x in args]
  lhs, rhs, lhs_scales, rhs_scales = args
  (b, m, k), n = lhs.shape, rhs.shape[1]
  backend = checks.choose(backend, config, _kernel_reason(lhs_layout, k, "lhs_scales")
                         or _kernel_reason(rhs_layout, k, "rhs_scales")
                         or sharding.explicit_reason(*args))

  if min(b, m, n) == 0 or k == 0:  # nothing to compute, or the empty sum
    out = jnp.zeros((b, m, n), out_dtype)
  elif backend == "xla":
    out = _xla.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, lhs_layout=lhs_layout,
                             rhs_layout=rhs_layout, out_dtype=out_dtype)
  else:
    ls = _for_kernel(lhs_scales, lhs_layout, lhs.shape, row_blocks=False)
    rs = _for_kernel(rhs_scales, rhs_layout, rhs.shape, row_blocks=True)
    interpret = not hw.on_gpu()

    def kernel(lhs, rhs, ls, rs, out_dtype):
      with primitive.kernel_x64("mosaic"):
        return checks.mosaic_module().scaled_gemm(lhs, rhs, ls, rs, out_dtype=out_dtype,
                                                  config=config, interpret=interpret)

    out = partition.gemm(kernel, lhs, rhs, ls, rs, out_dtype, interpret=interpret)
  return out[0] if squeeze else out
