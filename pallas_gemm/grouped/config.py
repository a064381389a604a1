"""Tile configuration of the Hopper grouped-GEMM kernels (`mosaic_forward`, `mosaic_weight_grad`).

One `Config` serves both kernels; its fields keep the repo's vocabulary, read per kernel:

  forward      out (M, N) = lhs (M, K) @ rhs[g] (K, N): a CTA tile is block_m rows of lhs
               (one group's part of them) by block_n columns; the K loop steps block_k.
  weight_grad  out[g] (K, N) = lhs[rows of g].T @ dy[rows of g]: a CTA tile is block_k rows
               of out[g] (columns of lhs) by block_n columns; the reduction over the group's
               rows steps block_m.

In both, the CTA tile is split between ``num_compute_wgs`` consumer warpgroups along
``wg_split`` ("m": the tile's rows, "n": its columns), each holding an f32 wgmma
accumulator of its part, and a ``stages``-deep ring of shared-memory operand tiles is
filled by TMA from one producer warp.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax.numpy as jnp

from pallas_gemm.mgpu.hw import RESERVED_SMEM_BYTES, SMEM_BYTES_PER_BLOCK
from pallas_gemm.mgpu.rows import row_columns
from pallas_gemm.mgpu.tiles import (check_positive_ints, check_warpgroups, config_error,
                                    deepest_ring)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tiles of a grouped-GEMM kernel (see the module docstring for each kernel's reading).

  block_m: forward: rows of an output tile (a row tile of lhs); weight_grad: rows of lhs
    and dy per reduction step.
  block_n: columns of an output tile.
  block_k: forward: K per pipeline step; weight_grad: rows of an output tile (columns of
    lhs).
  stages: depth of the TMA ring of operand tiles.
  num_compute_wgs: consumer warpgroups (1 or 2); one producer warpgroup is added.
  wg_split: "m" or "n": the output tile's dimension split among the consumer warpgroups.
  grid_tile_width: output tiles are visited in bands of this many column tiles
    (`plgpu.planar_snake`), so CTAs that run together share operand tiles in L2.
  epi_block_m, epi_block_n: sub-tile of the epilogue (registers -> shared memory -> TMA).
  epi_slots: shared-memory slots per consumer warpgroup that the epilogue's sub-tiles take
    in turn; a slot is rewritten once the TMA store that last read it is done, so with a
    slot per sub-tile of the warpgroup's tile the epilogue never waits on its own stores
    (only on the previous item's, long done) and they drain during the next item.
  num_sms: CTAs of the persistent grid; None: the device's SM count (4 in interpret mode).
  """

  block_m: int = 128
  block_n: int = 256
  block_k: int = 64
  stages: int = 4
  num_compute_wgs: int = 2
  wg_split: Literal["m", "n"] = "n"
  grid_tile_width: int = 8
  epi_block_m: int = 64
  epi_block_n: int = 64
  epi_slots: int = 2
  num_sms: int | None = None

  def __post_init__(self):
    fail = functools.partial(config_error, self)
    check_positive_ints(self, ("block_m", "block_n", "block_k", "stages", "num_compute_wgs",
                               "grid_tile_width", "epi_block_m", "epi_block_n", "epi_slots"))
    check_warpgroups(self)
    if self.num_sms is not None and (not isinstance(self.num_sms, int)
                                     or isinstance(self.num_sms, bool) or self.num_sms < 1):
      fail("num_sms", "must be None or a positive int")
    for field in ("block_m", "block_n", "block_k"):
      if getattr(self, field) > 256:
        fail(field, "a TMA box dimension is at most 256 elements")
      if getattr(self, field) % 64 and field != "block_n":
        fail(field, "must be a multiple of 64 (a wgmma row block, and a 128-byte"
             " swizzled row of 16-bit elements)")
    if self.block_n % 64:
      fail("block_n", "must be a multiple of 64 (a 128-byte swizzled row of 16-bit"
           " elements: both wgmma operands need the same swizzle)")
    if self.num_compute_wgs == 2 and self.wg_split == "n" and self.block_n % 128:
      fail("block_n", "splits between 2 warpgroups along n on a 128-byte swizzle atom:"
           " must be a multiple of 128")
    if self.epi_block_m % 64:
      fail("epi_block_m", "must be a multiple of 64 (the wgmma register layout)")
    if self.epi_block_n % 16:
      fail("epi_block_n", "must be a multiple of 16 (a swizzled smem row is at least"
           " 32 bytes)")

  def wg_tile(self, rows: int) -> tuple[int, int]:
    """(rows, columns) of one consumer warpgroup's accumulator for a CTA tile of
    `rows` x block_n (rows: block_m for the forward, block_k for the weight grad)."""
    if self.num_compute_wgs == 2 and self.wg_split == "m":
      return rows // 2, self.block_n
    if self.num_compute_wgs == 2:
      return rows, self.block_n // 2
    return rows, self.block_n

  def check_tiles(self, rows: int) -> None:
    """Raises ValueError unless a CTA tile of `rows` x block_n splits into warpgroup parts
    of whole wgmma rows that the (epi_block_m, epi_block_n) sub-tiles divide."""
    wg_m, wg_n = self.wg_tile(rows)
    if wg_m % 64:
      raise ValueError(
          f"Config: a {rows}-row tile split along {self.wg_split!r} among"
          f" {self.num_compute_wgs} warpgroups gives {wg_m} rows each; wgmma needs a"
          " multiple of 64 (use wg_split='n' or a taller tile)")
    if wg_m % self.epi_block_m or wg_n % self.epi_block_n:
      raise ValueError(
          f"Config: epi_block_m x epi_block_n = {self.epi_block_m}x{self.epi_block_n} must"
          f" divide a warpgroup's {wg_m}x{wg_n} accumulator")
    subtiles = (wg_m // self.epi_block_m) * (wg_n // self.epi_block_n)
    if subtiles % self.epi_slots_for(rows):
      raise ValueError(
          f"Config: epi_slots={self.epi_slots} must divide the {subtiles} epilogue sub-tiles"
          f" of a warpgroup's {wg_m}x{wg_n} accumulator, or exceed them (every item then"
          " leaves the slots in the same turn, and the store that last read a slot is always"
          " the slot count minus one stores ago)")

  def epi_slots_for(self, rows: int) -> int:
    """Epilogue slots a kernel with CTA tiles of `rows` x block_n uses: epi_slots, at most
    one per sub-tile of a warpgroup's accumulator."""
    wg_m, wg_n = self.wg_tile(rows)
    return min(self.epi_slots, (wg_m // self.epi_block_m) * (wg_n // self.epi_block_n))

  replace = dataclasses.replace


def smem_bytes(config: Config, *, a_tile: tuple[int, int], b_tile: tuple[int, int],
               dtype, out_dtype, k_steps: int | None = None) -> int:
  """Shared memory one CTA allocates: the ring of (a_tile, b_tile) pairs (at most
  k_steps deep), epi_slots epilogue sub-tiles per consumer warpgroup, barriers."""
  stages = config.stages if k_steps is None else max(1, min(config.stages, k_steps))
  itemsize = jnp.dtype(dtype).itemsize
  ring = stages * (a_tile[0] * a_tile[1] + b_tile[0] * b_tile[1]) * itemsize
  epi = (config.num_compute_wgs * config.epi_slots * config.epi_block_m * config.epi_block_n
         * jnp.dtype(out_dtype).itemsize)
  barriers = 8 * (2 * stages + 1)
  return (-(-ring // 1024) * 1024 + -(-epi // 1024) * 1024 + barriers
          + RESERVED_SMEM_BYTES)


def check_smem(config: Config, **kwargs) -> None:
  used = smem_bytes(config, **kwargs)
  if used > SMEM_BYTES_PER_BLOCK:
    raise ValueError(
        f"Config {config} needs {used} bytes of shared memory; sm_90 allows"
        f" {SMEM_BYTES_PER_BLOCK} per block (ring: stages * both operand tiles; epilogue:"
        " epi_slots * num_compute_wgs * epi_block_m * epi_block_n). Lower stages, epi_slots"
        " or the tiles.")


def default_config(m: int, n: int, k: int, g: int, dtype=jnp.bfloat16, *,
                   out_dtype=None, weight_grad: bool = False, gated: bool = False) -> Config:
  """Tiles for a grouped GEMM of M rows in g groups, K, N (the forward's names: the
  weight grad's output is (g, K, N), reduced over M).

  Forward: 128 x 256 tiles (two warpgroups of 128 x 128) as the dense kernel's, 128 x 128
  where N is small enough that 256-wide tiles would leave a large ragged column (N = 768
  is 3 tiles of 256 or 6 of 128, both whole; N = 1536 likewise): columns of 256 are kept
  when N divides into them. Decode-like M (a few rows per group) takes 64-row tiles: the
  rows a straddling tile wastes scale with block_m.
  Weight grad: 128 x 256 output tiles, 64-row reduction steps (a group's first and last
  steps are partly outside it; shorter steps waste less there).
  Gated forward (n = F, two accumulators per warpgroup, the gate's and the up's): tiles of
  block_m x 128 (h's 128 x 256 per CTA, as the plain forward's), the warpgroups splitting
  the rows (64 x 128 twice each: 128 f32 registers per thread) or, for 64-row tiles, the
  columns; a ring step holds two rhs tiles.
  """
  del k
  out_dtype = jnp.dtype(dtype if out_dtype is None else out_dtype)
  if gated:
    block_m = 64 if (m / max(g, 1) < 64 or m <= 64) else 128
    # 64-row tiles (a decode step streaming the weights): a 3-deep ring ran 1.015x the
    # 4-deep one at Qwen3-like sizes on the H200, the same at DeepSeek-V3-like ones.
    cfg = Config(block_m=block_m, block_n=128, block_k=64, stages=4 if block_m == 128 else 3,
                 num_compute_wgs=2, wg_split="m" if block_m == 128 else "n")
    a_tile, b_tile = (cfg.block_m, cfg.block_k), (cfg.block_k, 2 * cfg.block_n)
  elif weight_grad:
    cfg = Config(block_m=64, block_n=256 if n > 128 else 128, block_k=128, stages=4,
                 num_compute_wgs=2, wg_split="n")
    a_tile, b_tile = (cfg.block_m, cfg.block_k), (cfg.block_m, cfg.block_n)
  else:
    rows_per_group = m / max(g, 1)
    block_m = 64 if (rows_per_group < 64 or m <= 64) else 128
    block_n = 256 if (n % 256 == 0 or n > 1024) else 128
    if block_m == 64:
      # 64-row tiles: two warpgroups split the columns.
      cfg = Config(block_m=64, block_n=block_n, block_k=64, stages=6, num_compute_wgs=2,
                   wg_split="n")
    else:
      cfg = Config(block_m=128, block_n=block_n, block_k=64, stages=4, num_compute_wgs=2,
                   wg_split="n" if block_n == 256 else "m")
    a_tile, b_tile = (cfg.block_m, cfg.block_k), (cfg.block_k, cfg.block_n)
  # Epilogue rows of 128 bytes (the widest swizzle, and `rows.check_row_stores`' unit):
  # 32 columns of an f32 output.
  cfg = cfg.replace(epi_block_n=row_columns(out_dtype))
  return deepest_ring(cfg, lambda c: smem_bytes(c, a_tile=a_tile, b_tile=b_tile, dtype=dtype,
                                                 out_dtype=out_dtype))
