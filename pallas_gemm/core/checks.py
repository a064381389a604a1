"""Operand checks that every family's front door shares, so that one bad argument reads
the same in `gemm`, `ragged_dot` and `moe_mlp`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# The 16/32-bit float dtypes the GEMM families take (fp8 has its own, `fp8.scales`).
SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def require_array(x, name: str) -> None:
  """The TypeError that names the argument, unless x has a shape and a dtype."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray); got {type(x).__name__}")


def dtype_of(x, name: str) -> np.dtype:
  """x's dtype, or the TypeError that names the argument: not an array, or not a float
  dtype the kernels take."""
  require_array(x, name)
  dtype = np.dtype(x.dtype)
  if dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"{name}.dtype must be one of float32, bfloat16, float16; got {dtype}")
  return dtype
