"""XLA backend: `lax.dot_general` (cuBLAS on GPU, Eigen on CPU). The reference and CPU path."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.core import epilogue as _epilogue
from pallas_gemm.core import precision as precisions

NAME = "xla"
# bias and activation go into the expression: XLA fuses them with the dot (cuBLASLt
# epilogues, or its own fusions).
FUSED_ACTIVATIONS = (None, "relu", "gelu", "gelu_exact", "silu")
FUSED_GATES = ("relu", "gelu", "gelu_exact", "silu")  # c_gate: act'(c) * product, likewise
# lax.dot_general: XLA's partitioner shards it natively (op.partitioned).
XLA_PARTITIONS = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """XLA picks its own kernel (cuBLAS heuristics + autotuning); nothing to configure."""


def default_config(m, n, k, dtype, *, out_dtype=None, c_dtype=None, precision=None) -> Config:
  del m, n, k, dtype, out_dtype, c_dtype, precision
  return Config()


def unavailable_reason() -> str | None:
  return None


# The presets XLA's CPU backend runs (jax 0.11.2; the others raise there). It computes
# the bf16 ones in float32: at least as accurate as the preset.
_CPU_PRESETS = tuple(getattr(jax.lax.DotAlgorithmPreset, name) for name in (
    "DEFAULT", "F16_F16_F16", "BF16_BF16_F32", "BF16_BF16_F32_X3", "BF16_BF16_F32_X6",
    "F32_F32_F32", "F64_F64_F64"))


# The bf16-piece presets a vector product runs as HIGHEST (see gemm).
_VECTOR_AS_HIGHEST = tuple(getattr(jax.lax.DotAlgorithmPreset, name) for name in (
    "BF16_BF16_F32", "BF16_BF16_F32_X3", "BF16_BF16_F32_X6", "BF16_BF16_F32_X9"))


def supports(dtype, precision) -> str | None:
  del dtype
  if (isinstance(precision, jax.lax.DotAlgorithmPreset) and precision not in _CPU_PRESETS
      and jax.default_backend() == "cpu"):
    return f"XLA's CPU backend does not run precision={precision.name}"
  return None


def gemm(a, b, c, *, alpha, beta, transpose_a, transpose_b, precision, out_dtype, config,
         interpret, bias=None, activation=None, c_gate=None):
  del config, interpret
  # Ask XLA for the output dtype directly: cuBLAS accumulates in f32 either way. An f32
  # result plus a convert measured 7% slower at bf16 8192^3 (H200), and with an epilogue
  # the f32 product's round trip through memory cost (H100): the MLP training step ran
  # 0.943x the jnp.dot step (with a bf16 product: 1.013x), alpha/beta*C 0.86-0.94x the
  # jnp.dot expression (with a bf16 product: 0.98-1.01x). So a bf16
  # product is rounded once to bf16 before the f32 epilogue, as `jnp.dot(a, b) + bias`
  # rounds it (mosaic keeps the f32 accumulator: `backend="mosaic"` for one rounding).
  # Not f16: a product beyond its range (65504) would be inf before alpha, beta * C or
  # the bias could bring it back.
  epilogue = (alpha != 1.0 or (c is not None and beta != 0.0) or bias is not None
              or activation is not None)
  # Not for degenerate products (a row or column vector): XLA:GPU may turn those into a
  # reduction in the 16-bit output type (H100: a 60-term bf16 dot product came out 25%
  # off), where the contract is float32 accumulation.
  m = a.shape[2] if transpose_a else a.shape[1]
  n = b.shape[1] if transpose_b else b.shape[2]
  direct = (min(m, n) >= 16
            and np.dtype(out_dtype) in (np.dtype(a.dtype), np.dtype(np.float32))
            and not (epilogue and np.dtype(out_dtype) == np.dtype(np.float16)))
  acc_dtype = out_dtype if direct else jnp.float32
  precision = precisions.for_lax(precision)
  if min(m, n) == 1 and precision in _VECTOR_AS_HIGHEST and np.dtype(a.dtype) == np.float32:
    # A vector product (a row or column of output) under the bf16-piece presets: XLA's
    # CPU emitter rejects them on a 1x1 product ("Algorithm not supported by the
    # ElementalIrEmitter", jnp.dot too), and XLA:GPU turns it into a reduction that
    # ignores the algorithm (H100, jax 0.11.2: 1x1x33 products off by 1.6e-3, plain bf16
    # rounding, under X3 / X6 / X9). HIGHEST computes it at least as accurately as every
    # preset promises, for a product this small at no cost that matters.
    precision = jax.lax.Precision.HIGHEST
  a_op = jnp.swapaxes(a, 1, 2) if transpose_a else a    # (batch, M, K); XLA folds the transpose
  b_op = jnp.swapaxes(b, 1, 2) if transpose_b else b    # (batch_b, K, N)
  if b_op.shape[0] == 1:  # shared B: one (batch*M, K) @ (K, N) product, no broadcast copy
    acc = jnp.matmul(a_op, b_op[0], precision=precision, preferred_element_type=acc_dtype)
  else:
    acc = jax.lax.dot_general(a_op, b_op, (((2,), (1,)), ((0,), (0,))), precision=precision,
                              preferred_element_type=acc_dtype)
  if epilogue:
    acc = acc.astype(jnp.float32)
  if alpha != 1.0:
    acc = alpha * acc
  return _epilogue.apply(acc, c, bias, beta=beta, activation=activation, out_dtype=out_dtype,
                         c_gate=c_gate)
