"""The fp8 kernels under jit shardings: each device computes its shard (`core.sharding.
partitioned`), where XLA would otherwise gather every operand of a Mosaic kernel's call.

- `gemm` (scaled_matmul's kernel): lhs (B, M, K), rhs (B, N, K) and their scales in the
  kernel's layouts. B, M and N split with no communication (a scale per 128 rows splits
  with its rows, in whole blocks); K splits in multiples of 128 (each device its 128-wide
  scale blocks), leaving float32 partial sums that one psum adds before the result's dtype.
- `ragged_gemm` (scaled_ragged_dot's kernel): M, N and K as for `gemm`, M with the groups
  cut to each device's rows; G whole.
- `gated_gemm` (gated_quantized's kernel): M as for `ragged_gemm`; G, K and F whole (split
  groups would leave each device fp8 rows of its own groups, which no all-reduce adds, and
  a's 1x128 scales need a row's whole block; `moe_mlp` runs expert parallelism itself).
- `quantize_rows` (quantize's kernel): x (R, K) in 1x128 blocks (128x128): R split in
  multiples of 8 (128) and K in multiples of 128, values and scales with it; no
  communication. The same for x (B, K, R) read transposed (R in multiples of 128).
A split that does not divide so is not made: that factor is whole on every device.

Each takes the kernel call `local` and `interpret`, and runs `local` as it is in interpret mode
(the Mosaic GPU interpreter's ordered effects cannot be partitioned) and inside
jax.shard_map (there the values are already shards: `mgpu/launch.call`); under vmap the
partitioned call runs it unpartitioned, batched (`sharding.partitioned`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_gemm.core import sharding

BLOCK = 128


def _scale_labels(s, rows: int, k: int, rows_factor: str):
  """(factor, per) labels of kernel-layout scales (B, R', K') of an operand (B, rows, k)."""
  _, r, kk = s.shape
  if r == rows:
    row = (rows_factor, 1)
  elif r == 1 and kk == 1:  # per tensor (one row block of <= 128 rows looks the same)
    row = None
  elif r == -(-rows // BLOCK):
    row = (rows_factor, BLOCK)
  else:  # one scale for every row
    row = None
  col = ("k", BLOCK) if kk > 1 and kk * BLOCK == k else None
  return (("b", 1), row, col)


def gemm(local, lhs, rhs, lhs_scales, rhs_scales, out_dtype, *, interpret):
  """local(lhs, rhs, ls, rs, out_dtype) -> (B, M, N), run per shard (module docstring)."""
  if sharding.unpartitioned(interpret):
    return local(lhs, rhs, lhs_scales, rhs_scales, out_dtype)
  (_, m, k), n = lhs.shape, rhs.shape[1]
  labels = ((("b", 1), ("m", 1), ("k", 1)), (("b", 1), ("n", 1), ("k", 1)),
            _scale_labels(lhs_scales, m, k, "m"), _scale_labels(rhs_scales, n, k, "n"))

  def shard(lhs, rhs, ls, rs, *, partial, start):
    del start  # every split of a dense product is the same product on fewer numbers
    return (local(lhs, rhs, ls, rs, jnp.float32 if partial else out_dtype),)

  call = sharding.partitioned(
      shard, [a.shape for a in (lhs, rhs, lhs_scales, rhs_scales)], labels,
      ((("b", 1), ("m", 1), ("n", 1)),), reduce=("k",), align={"k": BLOCK},
      out_dtypes=(out_dtype,))
  return call(lhs, rhs, lhs_scales, rhs_scales)[0]


def quantize_rows(local, x, *, block_rows: int = 1, layout: str = "rows", interpret):
  """local(x) -> its results, run per shard (module docstring). layout "rows": x (R, K)
  -> (values, scales (R/block_rows, K/128)); "transposed": x (B, K, R) -> (values (B, R,
  K), scales (B, R / block_rows, K/128))."""
  if sharding.unpartitioned(interpret):
    return tuple(local(x))
  b, r, k = ("b", 1), ("r", 1), ("k", 1)
  scales = (("r", block_rows), ("k", BLOCK))
  layouts = {"rows": ((r, k), ((r, k), scales)),
             "transposed": ((b, k, r), ((b, r, k), (b, *scales)))}
  if layout not in layouts:
    raise ValueError(f"layout must be one of {tuple(layouts)}; got {layout!r}")
  labels, results = layouts[layout]
  # Read transposed, the kernel takes whole 128-row tiles of each entry.
  rows = max(8, block_rows) if layout == "rows" else 128

  def shard(x, *, partial, start):
    del partial, start  # nothing is contracted; blocks are local to their rows
    return tuple(local(x))

  call = sharding.partitioned(shard, [x.shape], (labels,), results,
                              align={"r": rows, "k": BLOCK})
  return tuple(call(x))


def ragged_gemm(local, lhs, rhs, group_sizes, lhs_scales, rhs_scales, out_dtype, *,
                interpret):
  """local(lhs, rhs, group_sizes, ls, rs, out_dtype) -> (M, N) (scaled_ragged_dot's
  kernel), run per shard: lhs (M, K), rhs (G, N, K), group_sizes (G,), ls (M, K/128), rs
  (G, ceil(N/128), K/128). M splits with no communication (each device's rows, the
  groups cut to its row window), N in multiples of 128 (whole weight blocks) likewise,
  K in multiples of 128 with one f32 all-reduce. G (expert parallel) is not split: the
  groups' weights are gathered (`moe_mlp` runs expert parallelism itself)."""
  if sharding.unpartitioned(interpret):
    return local(lhs, rhs, group_sizes, lhs_scales, rhs_scales, out_dtype)
  m, k = lhs.shape
  labels = ((("m", 1), ("k", 1)), (("g", 1), ("n", 1), ("k", 1)), (("g", 1),),
            (("m", 1), ("k", BLOCK)), (("g", 1), ("n", BLOCK), ("k", BLOCK)))

  def shard(lhs, rhs, sizes, ls, rs, *, partial, start):
    if lhs.shape[0] != m:  # this device's rows: the groups cut to them (a negative size,
      # which no valid call has, counts as 0 here)
      sizes, _ = sharding.group_window(sizes, None, start("m"), lhs.shape[0])
    return (local(lhs, rhs, sizes, ls, rs, jnp.float32 if partial else out_dtype),)

  call = sharding.partitioned(
      shard, [a.shape for a in (lhs, rhs, group_sizes, lhs_scales, rhs_scales)], labels,
      ((("m", 1), ("n", 1)),), reduce=("k",), whole=("g",), align={"k": BLOCK},
      out_dtypes=(out_dtype,))
  return call(lhs, rhs, group_sizes, lhs_scales, rhs_scales)[0]


def gated_gemm(local, lhs, rhs, group_sizes, lhs_scales, rhs_scales, *, out_dtype,
               interpret):
  """local(lhs, rhs, group_sizes, ls, rs) -> (a8 (M, F), a_scales (M, F/128)), run per
  shard (module docstring); operands as `ragged_gemm`'s, rhs (G, 2F, K)."""
  if sharding.unpartitioned(interpret):
    return tuple(local(lhs, rhs, group_sizes, lhs_scales, rhs_scales))
  m = lhs.shape[0]
  labels = ((("m", 1), None), (None, None, None), (None,), (("m", 1), None),
            (None, None, None))

  def shard(lhs, rhs, sizes, ls, rs, *, partial, start):
    del partial  # nothing is summed across devices
    if lhs.shape[0] != m:  # this device's rows: the groups cut to them
      sizes, _ = sharding.group_window(sizes, None, start("m"), lhs.shape[0])
    return tuple(local(lhs, rhs, sizes, ls, rs))

  call = sharding.partitioned(
      shard, [a.shape for a in (lhs, rhs, group_sizes, lhs_scales, rhs_scales)], labels,
      ((("m", 1), None), (("m", 1), None)), out_dtypes=(out_dtype, jnp.float32))
  return tuple(call(lhs, rhs, group_sizes, lhs_scales, rhs_scales))
