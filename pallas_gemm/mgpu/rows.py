"""Ragged rows on Mosaic GPU: the work items that cut consecutive groups of rows into row
tiles (a tile never spans two groups), and the stores that write only a tile's rows of its
group. Shared by every grouped kernel (bf16 forward and weight gradient, fp8 forward)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


# Rows of the item table (`row_items`): the item's group (-1: rows written as zeros),
# its row tile's first row / 8, and its rows [lo, hi).
GROUP, ROW8, LO, HI = range(4)
# Row tiles start on multiples of this (the lhs tile's TMA tiling).
ROW_ALIGN = 8


def local_rows(group_sizes: jax.Array, group_offset, num_groups: int, m: int):
  """(starts, ends) of the G local groups' rows, int32 (G,) each, clipped to [0, m].

  group_sizes has G entries (rows of group 0 start at row 0; group_offset then only
  renumbers the groups and changes no row), or more: the rows of lhs are laid out for all
  of them, and the local groups are group_sizes[group_offset : group_offset + G] (rows of
  the others are not computed).
  """
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  if sizes.shape[0] != num_groups:
    offset = jnp.int32(0) if group_offset is None else jnp.asarray(group_offset, jnp.int32)
    offset = jnp.reshape(offset, ())
    starts = lax.dynamic_slice(starts, (offset,), (num_groups,))
    ends = lax.dynamic_slice(ends, (offset,), (num_groups,))
  return jnp.clip(starts, 0, m), jnp.clip(ends, 0, m)


def max_row_items(m: int, num_groups: int, block_m: int) -> int:
  """A bound on the items of `row_items`: a segment of r rows has ceil((r + a) / block_m)
  tiles, a < 8 its rows before the aligned start, so the S = G + 2 segments have at most
  (m + S * (block_m + 6)) / block_m."""
  segments = num_groups + 2
  return -(-(m + segments * (ROW_ALIGN - 2)) // block_m) + segments


def row_items(starts, ends, m: int, block_m: int):
  """The item table, int32 (4, T) (rows GROUP, ROW8, LO, HI; T = `max_row_items`),
  and the number of items, int32 (1,). Items are in row order; entries past the count are
  never read."""
  num_groups = starts.shape[0]
  # Segments: rows before the first local group, the local groups, rows after the last.
  seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), starts, ends[-1:]])
  seg_end = jnp.concatenate([starts[:1], ends, jnp.full((1,), m, jnp.int32)])
  seg_row0 = seg_start // ROW_ALIGN * ROW_ALIGN
  tiles = jnp.where(seg_end > seg_start, (seg_end - seg_row0 + block_m - 1) // block_m, 0)
  last = jnp.cumsum(tiles)  # one past the segment's last item
  first = last - tiles
  t = jnp.arange(max_row_items(m, num_groups, block_m), dtype=jnp.int32)
  seg = jnp.minimum(jnp.sum(last[None, :] <= t[:, None], axis=1), num_groups + 1)
  row0 = seg_row0[seg] + (t - first[seg]) * block_m
  group = jnp.where((seg >= 1) & (seg <= num_groups), seg - 1, -1)
  lo = jnp.maximum(seg_start[seg], row0)
  hi = jnp.minimum(seg_end[seg], row0 + block_m)
  return (jnp.stack([group, row0 // ROW_ALIGN, lo, hi]).astype(jnp.int32), last[-1:])


# The bytes a row of an epilogue slot takes for `store_rows`: a TMA's shared-memory
# source must be 128-byte aligned, and store_rows starts its boxes at any row of the
# slot. Rows of 64 bytes (32 bfloat16 columns) start boxes on 64-byte addresses: on the
# H200 those kernels stopped with CUDA_ERROR_MISALIGNED_ADDRESS.
ROW_BYTES = 128


def row_columns(out_dtype) -> int:
  """Epilogue columns of out_dtype (16-bit or wider) that make one ROW_BYTES row."""
  return ROW_BYTES // max(jnp.dtype(out_dtype).itemsize, 2)


def check_row_stores(epi_block_n: int, out_dtype, kernel: str) -> None:
  """Raises ValueError unless an epilogue slot's rows are whole multiples of ROW_BYTES."""
  row = epi_block_n * jnp.dtype(out_dtype).itemsize
  if row % ROW_BYTES:
    raise ValueError(
        f"{kernel}: config.epi_block_n={epi_block_n} makes {row}-byte rows of a"
        f" {jnp.dtype(out_dtype).name} output; the grouped kernels store single rows by TMA"
        f" and need rows of a multiple of {ROW_BYTES} bytes (epi_block_n a multiple of"
        f" {ROW_BYTES // jnp.dtype(out_dtype).itemsize})")


def store_rows(out_smem, out_gmem, *, row0, col0, lo, hi):
  """TMA-stores the rows [lo, hi) ∩ [row0, row0 + rows) of the (rows, cols) slot out_smem
  to out_gmem[row, col0:col0 + cols] as power-of-two boxes, one bulk group in all. The
  slot's rows take a multiple of ROW_BYTES (`check_row_stores`)."""
  rows, cols = out_smem.shape
  start = jnp.maximum(lo, row0)
  size = jnp.maximum(jnp.minimum(hi, row0 + rows) - start, 0)
  offset = start - row0
  height = rows
  while height:
    @pl.when((size & height) != 0)
    def _():
      plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(offset, height)],
                              out_gmem.at[pl.ds(row0 + offset, height), pl.ds(col0, cols)],
                              commit_group=False)
    offset = offset + (size & height)
    height //= 2
  plgpu.commit_smem_to_gmem_group()


def store_subtiles(acc, out_smem, wg, store):
  """The epilogue of one item: the warpgroup's f32 accumulator acc (wg_m, wg_n), sub-tile
  by sub-tile, cast into the warpgroup's slots out_smem[wg] (num_wgs, epi_slots, epi_m,
  epi_n) in turn, then store(slot_smem, i, jj) TMA-stores sub-tile (i, jj) as one bulk
  group. Every item stores the same number of sub-tiles, a multiple of epi_slots
  (Config checks it), so the store that last read a slot is epi_slots - 1 groups ago,
  across items too: waiting until at most that many still read frees the slot."""
  _, epi_slots, epi_m, epi_n = out_smem.shape
  wg_m, wg_n = acc.shape
  sub = 0
  for i in range(wg_m // epi_m):
    for jj in range(wg_n // epi_n):
      slot = sub % epi_slots
      plgpu.wait_smem_to_gmem(epi_slots - 1, wait_read_only=True)
      out_smem[wg, slot] = acc[i * epi_m:(i + 1) * epi_m,
                               jj * epi_n:(jj + 1) * epi_n].astype(out_smem.dtype)
      plgpu.commit_smem()
      store(out_smem.at[wg, slot], i, jj)
      sub += 1
