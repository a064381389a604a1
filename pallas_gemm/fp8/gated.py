"""The first grouped GEMM of a gated fp8 expert MLP, its activation and the quantization
of its output for the second: `moe_mlp`'s fp8 inference form between its two GEMMs.

    a8, a_scales = gated_quantized(x8, w8, group_sizes, x_scales, w_scales, "silu")

x8 (M, K) fp8 with 1x128 scales; w8 (G, 2F, K) each group's [gate | up] rows, K-major,
with 128x128 block scales (`moe.quantize_experts`'s first pair). With h the f32 grouped
product, a = act(h[:, :F]) * h[:, F:] in f32, and (a8, a_scales) = quantize(a, dtype) in
1x128 blocks along F, the lhs the second GEMM takes.

Backends: "xla" runs `scaled_ragged_dot` to f32, the activation and `quantize` (the
reference, and the CPU path); "mosaic" the one Hopper kernel of mosaic_gated.py, from the
same f32 arithmetic up to the order of the K sums; "auto" takes mosaic on a Hopper GPU
where the call allows it (`gated_kernel_reason`). Under jit shardings the kernel runs per
shard of rows (`partition.gated_gemm`); the groups, K and F stay whole.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_gemm.core import epilogue, primitive, sharding
from pallas_gemm.fp8 import checks, partition, ragged, scales
from pallas_gemm.fp8.quantize import check_dtype, quantize
from pallas_gemm.mgpu import hw

BLOCK = 128


def gated_kernel_reason(lhs, rhs, dtype) -> str | None:
  """None when the Mosaic kernel computes this call here (on a Hopper GPU, or in the
  interpreter on a CPU), else why not; for operands `gated_quantized` validated."""
  reason = checks.mosaic_unavailable_reason()
  if reason is not None:
    return reason
  if (rhs.shape[1] // 2) % BLOCK:
    return f"F = {rhs.shape[1] // 2} is not a multiple of {BLOCK} (a's scale blocks)"
  if np.dtype(dtype) not in scales.FP8_DTYPES:
    return f"dtype {np.dtype(dtype)} is not an fp8 dtype"
  return sharding.explicit_reason(lhs, rhs)


def gated_quantized(lhs, rhs, group_sizes, lhs_scales, rhs_scales, activation: str, *,
                    dtype=jnp.float8_e4m3fn, backend: str = "auto"):
  """(a8 (M, F) dtype, a_scales (M, F/128) float32) of the module docstring. The operands
  as `scaled_ragged_dot` takes them (validated as it does), rhs with 2F rows, F a
  multiple of 128; activation one of `core.epilogue.GATES`; dtype float8_e4m3fn or
  float8_e5m2; backend "auto" (mosaic on a Hopper GPU where it can run), "xla" or
  "mosaic" (the interpreter on a CPU)."""
  if activation not in epilogue.GATES:
    raise ValueError(f"activation must be one of {epilogue.GATES}; got {activation!r}")
  if backend not in ("auto", *checks.BACKENDS):
    raise ValueError(f"backend must be 'auto', 'xla' or 'mosaic'; got {backend!r}")
  dtype = check_dtype(dtype)
  if getattr(rhs, "ndim", None) != 3 or rhs.shape[1] % (2 * BLOCK):
    raise ValueError(f"rhs must be (G, 2F, K) with F a multiple of {BLOCK}; got shape"
                     f" {getattr(rhs, 'shape', rhs)}")
  m, k, two_f, g = ragged.validate(lhs, rhs, group_sizes, lhs_scales, rhs_scales)
  f = two_f // 2
  operands = (lhs, rhs, group_sizes, lhs_scales, rhs_scales)
  reason = None if backend == "xla" else (gated_kernel_reason(lhs, rhs, dtype)
                                          or sharding.explicit_reason(*operands))
  if backend == "mosaic" and reason is not None:
    raise ValueError(f"backend='mosaic' cannot run this call: {reason} (backend='xla' can)")
  kernel = backend == "mosaic" or (backend == "auto" and hw.on_gpu() and reason is None)
  if not kernel or min(m, k, f, g) == 0:
    if min(m, f) == 0:  # `quantize` takes no empty rows
      return jnp.zeros((m, f), dtype), jnp.zeros((m, f // BLOCK), jnp.float32)
    h = ragged.scaled_ragged_dot(*operands, preferred_element_type=jnp.float32,
                                 backend="xla")
    return quantize(epilogue.activate(h[:, :f], activation) * h[:, f:], dtype)
  from pallas_gemm.fp8 import mosaic_gated  # noqa: PLC0415 - the GPU kernel, on demand
  interpret = not hw.on_gpu()

  def local(lhs, rhs, sizes, ls, rs):
    with primitive.kernel_x64("mosaic"):
      return mosaic_gated.gated_ragged_gemm(lhs, rhs, sizes, ls, rs, activation=activation,
                                            dtype=dtype, interpret=interpret)

  sizes = jnp.maximum(jnp.asarray(group_sizes).astype(jnp.int32), 0)
  return partition.gated_gemm(
      local, jnp.asarray(lhs), jnp.asarray(rhs), sizes,
      jnp.asarray(lhs_scales).astype(jnp.float32), jnp.asarray(rhs_scales).astype(jnp.float32),
      out_dtype=dtype, interpret=interpret)
