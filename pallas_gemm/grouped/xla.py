"""The reference path: `jax.lax.ragged_dot_general`, with the kernels' entry points.

Same signatures as the Mosaic entry points (`mosaic_forward.forward`,
`mosaic_weight_grad.weight_grad`), on the normalised problem of `ops.py`:

- `group_sizes` (G,) integers: the sizes of this call's G groups, in row order; sizes
  narrower than int32 are widened to it first (lax would sum them in their own dtype).
- `row_start`: None (the first group starts at row 0; the call is then exactly
  `jax.lax.ragged_dot_general`, negative sizes included) or an int32 scalar array: the
  first row of group 0. Rows before it (other shards' groups, under `group_offset`)
  belong to no group.

jax 0.11.2's lax takes no `group_offset` on any platform (its lowering raises
NotImplementedError), so a row start is emulated with lax calls of the same cost:
the forward as G groups whose first is extended back to row 0 and whose rows before
`row_start` are then selected to zero (a select, so a NaN in another shard's rows stays
there, as lax ignores rows outside every group); the weight gradient as G + 1 groups
whose first (the rows before `row_start`) is dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_FORWARD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
# rhs (G, N, K): contract lhs's K with rhs's last axis.
_FORWARD_T = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
# lhs (M, K), rhs (M, N) ragged along the contracted M: out (G, K, N).
_WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _widened(group_sizes):
  """lax sums the sizes in their own dtype: int8 / uint8 / int16 sizes that each fit
  while their total does not would wrap. int32 holds any total of rows."""
  if jnp.iinfo(group_sizes.dtype).bits < 32:
    return group_sizes.astype(jnp.int32)
  return group_sizes


def forward(lhs, rhs, group_sizes, row_start, *, transpose_rhs: bool, out_dtype, config=None,
            interpret: bool = False, precision=None):
  """out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g].T when transpose_rhs); other rows 0."""
  del config, interpret  # XLA chooses its own
  group_sizes = _widened(group_sizes)
  dims = _FORWARD_T if transpose_rhs else _FORWARD
  if row_start is None:
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims, precision=precision,
                                      preferred_element_type=out_dtype)
  sizes = group_sizes.at[0].add(row_start)
  out = jax.lax.ragged_dot_general(lhs, rhs, sizes, dims, precision=precision,
                                   preferred_element_type=out_dtype)
  rows = jax.lax.broadcasted_iota(jnp.int32, (lhs.shape[0], 1), 0)
  return jnp.where(rows >= row_start, out, jnp.zeros((), out.dtype))


def weight_grad(lhs, dy, group_sizes, row_start, *, out_dtype, config=None,
                interpret: bool = False, precision=None):
  """out[g] = lhs[rows of g].T @ dy[rows of g], (G, K, N); an empty group gives zeros."""
  del config, interpret
  group_sizes = _widened(group_sizes)
  if row_start is None:
    return jax.lax.ragged_dot_general(lhs, dy, group_sizes, _WEIGHT_GRAD, precision=precision,
                                      preferred_element_type=out_dtype)
  sizes = jnp.concatenate([jnp.reshape(row_start, (1,)).astype(group_sizes.dtype), group_sizes])
  out = jax.lax.ragged_dot_general(lhs, dy, sizes, _WEIGHT_GRAD, precision=precision,
                                   preferred_element_type=out_dtype)
  return out[1:]
