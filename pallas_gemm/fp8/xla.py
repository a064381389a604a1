"""XLA path of `scaled_matmul`: dequantize in float32, one float32 dot. Runs everywhere.

The reference path and the CPU path: every scale layout, any block size. Each operand
is expanded to float32 (values * scales, rounded once to float32; exact for
power-of-two scales) and contracted by `lax.dot_general` at Precision.HIGHEST (IEEE
float32 products and sums; TF32 on a GPU otherwise). On a GPU this is the slow path:
it reads the fp8 operands and writes float32 copies four times their size.

`per_tensor_pattern` is the other XLA route, for one scale per tensor: the
expression XLA's GPU compiler rewrites into a single cuBLASLt fp8 GEMM (HLO custom call
`__cublas$lt$matmul$f8`): the fp8 operands converted to a wider type, each multiplied by
a float32 scalar, then a dot; XLA folds the scalars into cuBLASLt's a/b scale
arguments. XLA 0.11.2 matches multiply(convert(fp8), broadcast(f32 scalar)), so the
scales are 0-d float32 arrays used as they come: callers reshape (1, 1) scales to ()
outside the jitted function. Scales cast to bfloat16 inside it left the expression as
converts, multiplies and a bf16 GEMM on the H100. It needs scalar scales (a batch of
scales is not matched) and both operands contracted on their last dim, as here.
`is_cublaslt_fp8` tells whether a compiled function holds the rewrite. Elsewhere (the
CPU) it computes what it says.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_gemm.fp8 import scales

NAME = "xla"
_DIMS = (((2,), (2,)), ((0,), (0,)))  # (B, M, K) x (B, N, K) -> (B, M, N)


@functools.partial(jax.jit, static_argnames=("lhs_layout", "rhs_layout", "out_dtype"))
def scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, *, lhs_layout: scales.ScaleLayout,
                  rhs_layout: scales.ScaleLayout, out_dtype):
  """(B, M, N): sum_k lhs[b,m,k] s_lhs[b,m,k] rhs[b,n,k] s_rhs[b,n,k] in float32, then
  cast to out_dtype. Operands 3-D, layouts from `quantize.scale_layout`."""
  a = lhs.astype(jnp.float32) * scales.expand(lhs_scales, lhs_layout, lhs.shape)
  b = rhs.astype(jnp.float32) * scales.expand(rhs_scales, rhs_layout, rhs.shape)
  out = jax.lax.dot_general(a, b, _DIMS, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


CUBLASLT_FP8_TARGET = "__cublas$lt$matmul$f8"  # the rewrite's custom call, in compiled HLO


def per_tensor_pattern(lhs, rhs, lhs_scale, rhs_scale, *, out_dtype=jnp.bfloat16,
                       wide=jnp.bfloat16):
  """dot(lhs.astype(wide) * lhs_scale, rhs.astype(wide) * rhs_scale) over the last dims:
  one cuBLASLt fp8 GEMM on a GPU (XLA's rewrite). lhs (M, K), rhs (N, K) fp8; the scales
  0-d float32 arrays, used unchanged (reshape a (1, 1) scale to () before the jitted
  call: a reshape or cast inside it hides the pattern). Result (M, N) in out_dtype."""
  for name, s in (("lhs_scale", lhs_scale), ("rhs_scale", rhs_scale)):
    if getattr(s, "ndim", None) != 0 or jnp.dtype(s.dtype) != jnp.float32:
      raise TypeError(f"{name} must be a 0-d float32 array (XLA rewrites only a float32"
                      f" scalar multiply to cuBLASLt fp8; reshape it to () outside the"
                      f" jitted function); got {type(s).__name__}"
                      f" shape={getattr(s, 'shape', None)} dtype={getattr(s, 'dtype', None)}")
  return jax.lax.dot_general(lhs.astype(wide) * lhs_scale, rhs.astype(wide) * rhs_scale,
                             (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def is_cublaslt_fp8(compiled_text: str) -> bool:
  """Whether compiled HLO text (``jit(f).lower(...).compile().as_text()``) calls
  cuBLASLt's fp8 GEMM, i.e. XLA rewrote the pattern."""
  return CUBLASLT_FP8_TARGET in compiled_text
