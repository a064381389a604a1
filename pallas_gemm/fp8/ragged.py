"""`scaled_ragged_dot`: `jax.lax.ragged_dot`'s grouping with DeepSeek-V3's fp8 block scales.

    x8, sx = quantize(x)                                  # (M, K): 1x128 blocks
    w8, sw = quantize(w_gnk, block_shape=(128, 128))      # (G, N, K): 128x128 per expert
    out = scaled_ragged_dot(x8, w8, group_sizes, sx, sw)  # (M, N)

Backends: "xla" dequantizes both operands to float32 and runs `jax.lax.ragged_dot` at
HIGHEST precision (the reference, and the CPU path); "mosaic" is the Hopper kernel
(mosaic_ragged.py; interpret mode on a CPU); "auto" takes mosaic on a Hopper GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.fp8 import checks, partition, scales
from pallas_gemm.core import primitive, sharding
from pallas_gemm.mgpu import hw

BLOCK = 128  # the scale block along K, and a weight block's rows


def validate(lhs, rhs, group_sizes, lhs_scales, rhs_scales) -> tuple[int, int, int, int]:
  """(M, K, N, G); TypeError / ValueError naming the argument and what it takes."""
  checks.operand(lhs, "lhs")
  checks.operand(rhs, "rhs")
  checks.check_scales(lhs_scales, "lhs_scales")
  checks.check_scales(rhs_scales, "rhs_scales")
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise ValueError(f"lhs must be (M, K) and rhs (G, N, K) (K-major, as scaled_matmul's rhs);"
                     f" got shapes {tuple(lhs.shape)} and {tuple(rhs.shape)}")
  (m, k), (g, n, k_rhs) = lhs.shape, rhs.shape
  if k_rhs != k:
    raise ValueError(f"rhs (G, N, K) must have lhs's K={k}; got shapes {tuple(lhs.shape)} and"
                     f" {tuple(rhs.shape)}")
  if k % BLOCK:
    raise ValueError(f"K={k} must be a multiple of {BLOCK} (the scale blocks along K); pad"
                     " lhs and rhs with zero columns (and their scales with ones)")
  want = {"lhs_scales": (m, k // BLOCK), "rhs_scales": (g, -(-n // BLOCK), k // BLOCK)}
  for name, s in (("lhs_scales", lhs_scales), ("rhs_scales", rhs_scales)):
    if tuple(s.shape) != want[name]:
      what = "1x128 blocks" if name == "lhs_scales" else "128x128 blocks per group"
      raise ValueError(f"{name} must be {want[name]} ({what}, as quantize makes them);"
                       f" got shape {tuple(s.shape)}")
  if not hasattr(group_sizes, "shape") or not hasattr(group_sizes, "dtype"):
    raise TypeError(f"group_sizes must be an integer array; got {type(group_sizes).__name__}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"group_sizes must be integers; got {np.dtype(group_sizes.dtype)}")
  if tuple(group_sizes.shape) != (g,):
    raise ValueError(f"group_sizes must be (G,) = ({g},), one size per group of rhs; got"
                     f" shape {tuple(group_sizes.shape)}")
  return m, k, n, g


def scaled_ragged_dot(lhs, rhs, group_sizes, lhs_scales, rhs_scales,
                      preferred_element_type=jnp.float32, *, backend="auto", config=None):
  """Block-scaled fp8 grouped matmul (Mixture-of-Experts, DeepSeek-V3's recipe).

      out[rows of g] = (lhs[rows] * ls[rows]) @ (rhs[g] * rs[g]).T,  summed in float32

  with the rows of group g consecutive from row 0 (`jax.lax.ragged_dot`'s layout) and
  each scale repeated over its block; rows past sum(group_sizes) are zeros.

  Args:
    lhs: (M, K) float8_e4m3fn or float8_e5m2, the tokens sorted by group.
    rhs: (G, N, K) float8_e4m3fn or float8_e5m2: each group's weight, K-major (a
      (G, K, N) weight is passed as swapaxes(w, 1, 2)). K a multiple of 128.
    group_sizes: (G,) integers, traced.
    lhs_scales: (M, K/128) float32, 1x128 blocks (`quantize(x)`).
    rhs_scales: (G, ceil(N/128), K/128) float32, 128x128 blocks per group
      (`quantize(w, block_shape=(128, 128))`).
    preferred_element_type: float32 (default), bfloat16 or float16.
    backend: "auto" | "xla" | "mosaic" (module docstring).
    config: the mosaic kernel's `fp8.config.Config` (wg_split "m", no cluster).

  Returns (M, N) in preferred_element_type. Forward only (no derivative rule).
  """
  m, k, n, g = validate(lhs, rhs, group_sizes, lhs_scales, rhs_scales)
  out_dtype = checks.out_dtype(preferred_element_type)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  backend = checks.choose(backend, config, sharding.explicit_reason(
      lhs, rhs, group_sizes, lhs_scales, rhs_scales))
  ls, rs = (jnp.asarray(s).astype(jnp.float32) for s in (lhs_scales, rhs_scales))
  sizes = jnp.asarray(group_sizes).astype(jnp.int32)
  if min(m, n, g) == 0 or k == 0:
    return jnp.zeros((m, n), out_dtype)
  if backend == "xla":
    a = scales.dequantize(lhs, ls)
    b = scales.dequantize(rhs, rs)
    # Under Explicit mesh axes lax infers no sharding for ragged_dot: the result is
    # whole on every device, as `ragged_dot`'s is there.
    mesh = sharding.explicit_mesh(a, b, sizes)
    whole = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    out = jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), sizes,
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32, out_sharding=whole)
    return out.astype(out_dtype)
  from pallas_gemm.fp8 import mosaic_ragged  # noqa: PLC0415 - the GPU kernel, on demand

  interpret = not hw.on_gpu()

  def kernel(lhs, rhs, sizes, ls, rs, out_dtype):
    with primitive.kernel_x64("mosaic"):
      return mosaic_ragged.ragged_gemm(lhs, rhs, sizes, ls, rs, out_dtype=out_dtype,
                                       config=config, interpret=interpret)

  return partition.ragged_gemm(kernel, lhs, rhs, sizes, ls, rs, out_dtype,
                               interpret=interpret)
