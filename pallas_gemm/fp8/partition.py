"""The fp8 kernels under jit shardings: each device computes its shard (`core.sharding.
partitioned`), where XLA would otherwise gather every operand of a Mosaic kernel's call.

- `gemm` (scaled_matmul's kernel): lhs (B, M, K), rhs (B, N, K) and their scales in the
  kernel's layouts. B, M and N split with no communication (a scale per 128 rows splits
  with its rows, in whole blocks); K splits in multiples of 128 (each device its 128-wide
  scale blocks), leaving float32 partial sums that one psum adds before the result's dtype.
- `quantize_rows` (quantize's kernel): x (R, K) in 1x128 blocks: R split in multiples of 8
  and K in multiples of 128, values and scales with it; no communication.
A split that does not divide so is not made: that factor is whole on every device.

Not used inside jax.shard_map (there the values are already shards: `mgpu/launch.call`),
under vmap, nor in interpret mode (the Mosaic GPU interpreter's ordered effects cannot be partitioned).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
# Private but stable since jax 0.4: the public jax.interpreters.batching has no tracer type,
# and a batched value is told apart by it alone.
from jax._src.interpreters import batching

from pallas_gemm.core import sharding

BLOCK = 128


def available(*operands) -> bool:
  """Whether a call on these operands may be partitioned: not inside a shard_map's manual
  axes, and not under vmap (custom_partitioning has no batching rule; a batched call
  runs the kernel directly, which batches itself)."""
  return not (jax.sharding.get_abstract_mesh().manual_axes
              or any(isinstance(x, batching.BatchTracer) for x in operands))


def _scale_labels(s, rows: int, k: int, rows_factor: str):
  """(factor, per) labels of kernel-layout scales (B, R', K') of an operand (B, rows, k)."""
  _, r, kk = s.shape
  if r == rows:
    row = (rows_factor, 1)
  elif r == -(-rows // BLOCK):
    row = (rows_factor, BLOCK)
  else:  # one scale for every row
    row = None
  col = ("k", BLOCK) if kk > 1 and kk * BLOCK == k else None
  return (("b", 1), row, col)


def gemm(local, lhs, rhs, lhs_scales, rhs_scales, out_dtype):
  """local(lhs, rhs, ls, rs, out_dtype) -> (B, M, N), run per shard (module docstring)."""
  (_, m, k), n = lhs.shape, rhs.shape[1]
  labels = ((("b", 1), ("m", 1), ("k", 1)), (("b", 1), ("n", 1), ("k", 1)),
            _scale_labels(lhs_scales, m, k, "m"), _scale_labels(rhs_scales, n, k, "n"))

  def shard(lhs, rhs, ls, rs, *, partial):
    return (local(lhs, rhs, ls, rs, jnp.float32 if partial else out_dtype),)

  call = sharding.partitioned(
      shard, [a.shape for a in (lhs, rhs, lhs_scales, rhs_scales)], labels,
      ((("b", 1), ("m", 1), ("n", 1)),), reduce=("k",), align={"k": BLOCK},
      out_dtypes=(out_dtype,))
  return call(lhs, rhs, lhs_scales, rhs_scales)[0]


def quantize_rows(local, x):
  """local(x (R, K)) -> (values, scales (R, K/128)), run per shard (module docstring)."""
  labels = ((("r", 1), ("k", 1)),)
  results = ((("r", 1), ("k", 1)), (("r", 1), ("k", BLOCK)))

  def shard(x, *, partial):
    del partial  # nothing is contracted
    return tuple(local(x))

  call = sharding.partitioned(shard, [x.shape], labels, results,
                              align={"r": 8, "k": BLOCK})
  return tuple(call(x))
