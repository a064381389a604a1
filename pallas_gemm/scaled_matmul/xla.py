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
arguments. The scales must stay float32 (the products promote to float32): with the
scales cast to bfloat16 first, XLA 0.11.2 leaves the expression as converts, multiplies
and a bf16 GEMM. It needs scalar scales (a batch of scales is not matched) and both
operands contracted on their last dim, as here. Elsewhere (the CPU) it computes what it
says, in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_gemm.scaled_matmul import scales

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
  """dot(lhs.astype(wide) * lhs_scale, rhs.astype(wide) * rhs_scale) over the last dims,
  the scales float32: one cuBLASLt fp8 GEMM on a GPU (XLA's rewrite). lhs (M, K), rhs
  (N, K) fp8; scales scalars (0-d or size 1). Result (M, N) in out_dtype."""
  sa = jnp.reshape(lhs_scale, ()).astype(jnp.float32)
  sb = jnp.reshape(rhs_scale, ()).astype(jnp.float32)
  return jax.lax.dot_general(lhs.astype(wide) * sa, rhs.astype(wide) * sb,
                             (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def is_cublaslt_fp8(compiled_text: str) -> bool:
  """Whether compiled HLO text (``jit(f).lower(...).compile().as_text()``) calls
  cuBLASLt's fp8 GEMM, i.e. XLA rewrote the pattern."""
  return CUBLASLT_FP8_TARGET in compiled_text
