"""Dropping the padding of a kernel's padded output: ``x[:, :rows, :cols]``.

A kernel that writes a misaligned output (rows not 16-byte aligned: TMA needs aligned
rows) computes it into a padded buffer, and this copies the leading block out. XLA's
slice writes such rows slowly: 4104x4160 -> 4097x4097 bf16 took 0.080 ms as a slice and
0.027 ms as the masked (8, 1024)-block copy below, a Pallas Triton kernel, on the H200.
So on a GPU `unpad` runs the copy kernel, elsewhere (the CPU, interpret mode) the slice.

The Pallas Triton lowering is deprecated in jax 0.11 and emits a DeprecationWarning on
every compilation; this module filters exactly that message (as `pallas_gemm.matmul.triton`).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

warnings.filterwarnings(
    "ignore",
    message=r"The Pallas Triton backend is deprecated",
    category=DeprecationWarning,
)


def unpad(x: jax.Array, rows: int, cols: int, *, interpret: bool) -> jax.Array:
  """``x[:, :rows, :cols]`` of a 3-D array: the copy kernel on a GPU (not in interpret
  mode), else XLA's slice."""
  if interpret or jax.default_backend() != "gpu":
    return x[:, :rows, :cols]
  return copy_kernel(x, rows, cols)


def copy_kernel(x: jax.Array, rows: int, cols: int, *, interpret: bool = False) -> jax.Array:
  """``x[:, :rows, :cols]`` of a 3-D array as a masked Pallas Triton copy (a GPU, or the
  Pallas interpreter with interpret=True)."""
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415 - GPU path only

  block_r, block_c = 8, 1024
  grid_c = pl.cdiv(cols, block_c)

  def kernel(x_ref, o_ref):
    t = pl.program_id(0)
    shape = (block_r, block_c)
    r_ok = (t // grid_c) * block_r + lax.broadcasted_iota(jnp.int32, shape, 0) < rows
    c_ok = (t % grid_c) * block_c + lax.broadcasted_iota(jnp.int32, shape, 1) < cols
    pltriton.store(o_ref, x_ref[...], mask=r_ok & c_ok)

  spec = pl.BlockSpec((None, block_r, block_c), lambda t, i: (i, t // grid_c, t % grid_c))
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((x.shape[0], rows, cols), x.dtype),
      grid=(pl.cdiv(rows, block_r) * grid_c, x.shape[0]),
      in_specs=[spec],
      out_specs=spec,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="pallas_gemm_unpad",
  )(x)
