"""Global-memory layout for Mosaic GPU TMA: swizzled shared-memory tiles and the padding
that lets TMA describe any operand. Shared by every Mosaic kernel in this package."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu



def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def swizzle_transforms(minor_elems: int, dtype):
  """Tiling + swizzle for a smem tile whose last dim has minor_elems elements."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor_elems * bits)
  swizzle_elems = swizzle * 8 // bits
  return (plgpu.TilingTransform((8, swizzle_elems)),
          plgpu.SwizzleTransform(swizzle))


def tma_tile(minor_elems: int, dtype) -> tuple[int, int]:
  """The (rows, cols) tile of the smem transform for a given block minor dim."""
  tiling, _ = swizzle_transforms(minor_elems, dtype)
  return tiling.tiling


def row_transforms(minor_elems: int, dtype):
  """Tiling (1, swizzle) + swizzle: a view of a global array that any row count divides.

  Where the tile's minor dim is one swizzle wide (`tma_tile`'s columns), its bytes in
  shared memory are those of `swizzle_transforms`' (8, swizzle) tiling: rows of one
  swizzle each, in order, and the 128-byte swizzle is a function of the address. So
  TMA may load or store a tile through this view with M rows in the array, zero-filling
  or clipping those past M, where the (8, swizzle) view needs M a multiple of 8."""
  tiling, swizzle = swizzle_transforms(minor_elems, dtype)
  return (plgpu.TilingTransform((1, tiling.tiling[1])), swizzle)


def tma_view_tile(tile: tuple[int, int], by_row: bool) -> tuple[int, int]:
  """The tile an array is padded to for TMA: `tma_tile`'s, or (1, its columns) where the
  array moves through `row_transforms`' single-row view."""
  return (1, tile[1]) if by_row else tile


def tma_padded_shape(rows: int, cols: int, tile: tuple[int, int]):
  return round_up(rows, tile[0]), round_up(cols, tile[1])


def pad_for_tma(x: jax.Array, tile: tuple[int, int], min_cols: int = 0) -> jax.Array:
  """Zero-pads the last two dims of x up to multiples of the TMA tile.

  Mosaic GPU issues a tiled+swizzled TMA through a view of the whole global
  array as (rows / 8, cols / swizzle_elems, 8, swizzle_elems), so both dims of
  the array (not just of the block) must be multiples of the tile (a multiple
  of the swizzle width also makes the row stride 16-byte aligned). Aligned
  arrays are returned as they are; others cost one read+write (jnp.pad).
  min_cols: the block's minor (contiguous) size. On the H200 an output narrower
  than the block gave a wrong result (129x7x65 bf16, block_n=256, out padded to 64
  columns): small arrays are padded up to the block (operands, C and output).
  """
  rows, cols = x.shape[-2:]
  pr, pc = tma_padded_shape(rows, cols, tile)
  pc = max(pc, min_cols)
  if (pr, pc) == (rows, cols):
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pr - rows), (0, pc - cols)])


def pad_to(x, size: int, axis: int = -1):
  """x zero-padded along axis up to size (x if it is already that long)."""
  extra = size - x.shape[axis]
  if extra <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)
