"""The promoted fp8 K loop on Mosaic GPU: each 128 of K multiplies into a zeroed wgmma
accumulator, the step's scales multiply it, and it is added into an f32 register sum.
fp8 wgmma accumulates with fewer bits than f32 (DeepSeek-V3's report measures it);
promoting every 128 of K bounds that error by one block's. Shared by the dense and grouped
fp8 kernels."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def block_pieces(wg_n: int) -> int:
  """Column pieces of a warpgroup tile that each lie in one 128-column block of the rhs
  block scales: pieces gcd(wg_n, 128) wide. A warpgroup's first column is a multiple of
  wg_n (tiles are multiples of it), so each piece starts at a multiple of its width,
  which divides 128. One piece when wg_n divides 128."""
  return wg_n // math.gcd(wg_n, 128)


def promoted_loop(wgmma, first, bb, col0, wg_ms, wg_ns, stages, produced, consumed,
                   lhs_scale_smem, rhs_scale_smem, rhs_step_gmem, *, plan, wg_m,
                   wg_n, k_iters):
  """plan: has lhs_step (bool) and rhs_step (None, "column" or "block"), as the fp8
  kernel's Plan. Each 128 of K: products into a zeroed accumulator, times the step's scale, added
  to an f32 register sum (IEEE adds); returns the (wg_m, wg_n) sum. k_iters may be
  traced (the grouped kernel runs none for rows outside every group): zeros then.

  The step's scale is rows[r] (lhs) x cols[c] or the 128x128 block's number (rhs). A
  block scale is folded into the row vector (a few multiplies per thread), so the
  accumulator takes one multiply-add per element; per-column rhs scales take two.

  A step waits for its stage before the block accumulator is allocated (zeroed), so
  no barrier spin loop lies between the accumulator's definition and its wgmma.

  col0: the warpgroup tile's first rhs column, or a tuple of origins of equal column
  pieces that need not be adjacent (the gated kernel's tile: 64 gate columns, then the
  64 up columns F further on), each inside one 128-column block.
  """
  row_layout = plgpu.Layout.WGMMA.reduce(1)  # a (wg_m,) vector, one value per acc row
  col_layout = plgpu.Layout.WGMMA.reduce(0)  # a (wg_n,) vector, one per acc column
  if isinstance(col0, tuple):
    if plan.rhs_step != "block" or wg_n % len(col0):
      raise ValueError(f"column pieces at origins {col0} need 128x128 rhs block scales and"
                       f" wg_n={wg_n} a multiple of their count")
    origins = col0
  else:
    count = block_pieces(wg_n) if plan.rhs_step == "block" else 1
    origins = tuple(col0 + p * (wg_n // count) for p in range(count))
  pieces = len(origins) if plan.rhs_step == "block" else 1
  piece_n = wg_n // pieces
  slot_of = lambda kk: lax.rem(first + kk, stages)  # noqa: E731

  def scales(kk):  # step kk's (rows, cols, block numbers), read from its stage / L2
    slot = slot_of(kk)
    rows = cols = None
    blocks = []
    if plan.lhs_step:
      rows = plgpu.load(lhs_scale_smem.at[slot, wg_ms], layout=row_layout, optimized=False)
    if plan.rhs_step == "column":
      cols = plgpu.load(rhs_scale_smem.at[slot, wg_ns], layout=col_layout, optimized=False)
    elif plan.rhs_step == "block":  # one number per column piece
      blocks = [rhs_step_gmem[bb, kk, lax.div(origin, 128)] for origin in origins]
    return rows, cols, blocks

  def promote(total, blk, rows, cols, blocks):
    if cols is not None:
      blk = blk * lax.broadcast_in_dim(cols, (wg_m, wg_n), [1])
    if not blocks:
      if rows is not None:
        blk = blk * lax.broadcast_in_dim(rows, (wg_m, wg_n), [0])
      return total + blk

    def scaled(piece, number):  # piece * rows * number, one multiply per element
      if rows is None:
        return piece * number
      return piece * lax.broadcast_in_dim(rows * number, piece.shape, [0])

    if pieces == 1:
      return total + scaled(blk, blocks[0])
    return total + jnp.concatenate(
        [scaled(blk[:, p * piece_n:(p + 1) * piece_n], number)
         for p, number in enumerate(blocks)], axis=1)

  zeros = jnp.zeros((wg_m, wg_n), jnp.float32)

  def step(kk, total):
    slot = slot_of(kk)
    plgpu.barrier_wait(produced.at[slot])

    def block(blk_ref):
      wgmma(blk_ref, slot)
      # The scales are read while the products run; reading blk_ref waits for them.
      step_scales = scales(kk)
      return blk_ref[...], step_scales

    blk, step_scales = pl.run_scoped(block, plgpu.ACC((wg_m, wg_n), jnp.float32))
    plgpu.barrier_arrive(consumed.at[slot])
    return promote(total, blk, *step_scales)

  return lax.fori_loop(0, k_iters, step, zeros)
