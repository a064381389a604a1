"""Tuning parameters of the fp8 Mosaic GPU kernel (`mosaic_gemm.scaled_gemm`) and its
shared-memory and register budgets."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax.numpy as jnp

from pallas_gemm.mgpu.hw import RESERVED_SMEM_BYTES, SMEM_BYTES_PER_BLOCK
from pallas_gemm.mgpu.tiles import (check_cluster, check_positive_ints, check_ring,
                                    check_warpgroups, check_wg_tile, config_error, deepest_ring)
from pallas_gemm.mgpu.layout import round_up

# K per pipeline step, and the scale block along K: one step's products are one scale
# block's, so promoting them into the f32 sum is one scale-multiply-add per step. 128 fp8
# bytes are also one 128-byte swizzle row of an operand tile.
BLOCK_K = 128


def streams_weights(m: int, g: int) -> bool:
  """Whether a grouped call of m rows over g groups is decode-like: under 64 rows a group
  on average, so the kernel streams the experts' weights and a 128-row lhs tile would be
  mostly other groups' rows. The grouped fp8 kernels take 64-row tiles on one warpgroup
  there (`mosaic_ragged.default_config`, `mosaic_gated.tiles`)."""
  return m < 64 * max(g, 1)


# Data registers per thread a consumer warpgroup may hold: 232 are left to each of two
# consumer warpgroups beside a 40-register producer; the rest holds addresses, the row
# scales and loop state. The promoted K loop holds two accumulators (the f32 sum and
# the zeroed block accumulator), and with per-column step scales also their column
# vector; the plain loop one accumulator.
_MAX_ACC_REGISTERS = {True: 192, False: 128}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tiles and schedule of the fp8 kernel.

  block_m, block_n: the CTA output tile, split among the consumer warpgroups along
    ``wg_split``: each warpgroup owns a (wg_block_m, wg_block_n) f32 accumulator.
    The K step is BLOCK_K (128), fixed: it is the scale block.
  stages: depth of the TMA ring (one stage: a (block_m, 128) lhs tile, a (block_n, 128)
    rhs tile and the step's scale vectors).
  num_compute_wgs: consumer warpgroups (1 or 2); one producer warpgroup is added.
  wg_split: "m" or "n", the dimension of the CTA tile split among warpgroups.
  grid_minor_dim, grid_tile_width: output tile order (``plgpu.planar_snake``): bands
    of ``grid_tile_width`` tiles along ``grid_minor_dim``, so CTAs running together
    share operand tiles in L2.
  epi_block_m, epi_block_n: the epilogue's sub-tile (registers -> shared memory ->
    TMA store), double-buffered per consumer warpgroup.
  wgmma_wait: wgmma groups left in flight at the end of a K step of the plain
    (unpromoted) loop, 0 or 1; the promoted loop waits for each block's products.
  fast_accumulation: with scales that are constant along K (per tensor, per row, per
    column), True (opt-in) accumulates all of K in the tensor core's accumulator (one
    wgmma chain, scales applied in the epilogue): faster, but Hopper's fp8 wgmma
    accumulation keeps ~14 mantissa bits of the running sum (per-tensor f32-result
    error ~1e-3 at K=4096 on the H100, growing with K). False (default) promotes every
    128 of K into an f32 register sum as block scales do (~1.3e-4, flat in K). Block
    scales are always promoted.
  cluster_m, cluster_n: CTAs per cluster along m or n (1 or 2, not both 2). The two
    CTAs of a cluster_m=2 cluster compute vertically adjacent tiles that share their rhs
    tiles: each CTA loads half of every rhs tile and TMA multicasts it to both, halving
    the rhs tiles' L2 -> SM traffic (cluster_n=2: the lhs tiles').
  num_sms: CTAs of the persistent grid; None: the device's SM count (4 in interpret
    mode).
  """

  block_m: int = 128
  block_n: int = 128
  stages: int = 5
  num_compute_wgs: int = 2
  wg_split: Literal["m", "n"] = "m"
  grid_minor_dim: Literal["m", "n"] = "n"
  grid_tile_width: int = 8
  epi_block_m: int = 64
  epi_block_n: int = 64
  wgmma_wait: int = 1
  fast_accumulation: bool = False
  cluster_m: int = 1
  cluster_n: int = 1
  num_sms: int | None = None

  def __post_init__(self):
    fail = functools.partial(config_error, self)
    check_positive_ints(self, ("block_m", "block_n", "stages", "num_compute_wgs",
                               "grid_tile_width", "epi_block_m", "epi_block_n", "cluster_m",
                               "cluster_n"))
    check_warpgroups(self)
    check_ring(self)
    if not isinstance(self.fast_accumulation, bool):
      fail("fast_accumulation", "must be a bool")
    check_cluster(self)
    check_wg_tile(self, self.wg_block_m, self.wg_block_n)

  @property
  def wg_block_m(self) -> int:
    """Rows of one consumer warpgroup's accumulator."""
    return self.block_m // self.num_compute_wgs if self.wg_split == "m" else self.block_m

  @property
  def wg_block_n(self) -> int:
    """Columns of one consumer warpgroup's accumulator."""
    return self.block_n // self.num_compute_wgs if self.wg_split == "n" else self.block_n

  @property
  def out_slots(self) -> int:
    """Epilogue buffers per warpgroup (one if a single sub-tile covers it)."""
    sub_tiles = (self.wg_block_m // self.epi_block_m) * (self.wg_block_n // self.epi_block_n)
    return min(2, sub_tiles)

  @property
  def cluster_size(self) -> int:
    return self.cluster_m * self.cluster_n

  def acc_registers(self) -> int:
    """f32 registers per thread of one warpgroup accumulator."""
    return self.wg_block_m * self.wg_block_n // 128

  replace = dataclasses.replace


def smem_bytes(config: Config, out_dtype, *, k: int | None = None, row_scales: bool = False,
               column_scales: bool = False) -> int:
  """Shared memory one CTA allocates (an upper bound).

  k: the problem's K, which caps the ring at ceil(K / 128) stages.
  row_scales / column_scales: the ring also holds a (block_m,) / (block_n,) f32 scale
    vector per stage.
  """
  stages = config.stages if k is None else max(1, min(config.stages, -(-k // BLOCK_K)))
  ring = stages * (config.block_m + config.block_n) * BLOCK_K  # fp8: one byte each
  scales = stages * 4 * (config.block_m * row_scales + config.block_n * column_scales)
  out = (config.num_compute_wgs * config.out_slots * config.epi_block_m
         * config.epi_block_n * jnp.dtype(out_dtype).itemsize)
  barriers = 8 * 2 * stages
  # Each buffer is aligned to 1024 bytes (128-byte swizzle atoms).
  return (sum(round_up(x, 1024) for x in (ring, scales, out) if x) + barriers
          + RESERVED_SMEM_BYTES)


def check(config: Config, out_dtype, *, k: int | None = None, promoted: bool,
          row_scales: bool = False, column_scales: bool = False) -> None:
  """Raises ValueError if the config does not fit the shared memory or the registers
  of the K loop it runs (promoted: two accumulators per warpgroup; with per-column step
  scales also the step's (wg_block_n,) column vector, wg_block_n / 4 per thread)."""
  limit = _MAX_ACC_REGISTERS[promoted]
  accumulators = 2 if promoted else 1
  regs = config.acc_registers() * accumulators
  columns = config.wg_block_n // 4 if (promoted and column_scales) else 0
  if regs + columns > limit:
    held = (f"{accumulators} accumulator(s): the f32 sum and the block accumulator each"
            " take wg_block_m * wg_block_n / 128")
    if columns:
      held += f", and {columns} for the step's per-column scales"
    raise ValueError(
        f"Config: a {config.wg_block_m}x{config.wg_block_n} warpgroup tile holds"
        f" {regs + columns} registers per thread in the"
        f" {'promoted' if promoted else 'plain'} K loop, more than {limit} ({held});"
        " use smaller tiles")
  used = smem_bytes(config, out_dtype, k=k, row_scales=row_scales,
                    column_scales=column_scales)
  if used > SMEM_BYTES_PER_BLOCK:
    raise ValueError(
        f"Config needs {used} bytes of shared memory per CTA, more than the"
        f" {SMEM_BYTES_PER_BLOCK} of sm_90 ({config}, out {jnp.dtype(out_dtype).name});"
        " lower stages, block_m/block_n or epi_block_m/epi_block_n")


def pads_within(n: int, block_n: int) -> bool:
  """Whether block_n-wide tiles compute at most 5% more columns than 128-wide ones."""
  return round_up(n, block_n) <= 1.05 * round_up(n, 128)


def default_config(m: int, n: int, k: int, *, out_dtype, promoted: bool,
                   step_scales: bool = True, column_scales: bool = False) -> Config:
  """The shape's default tiles; fast_accumulation = not promoted.

  step_scales: the scales vary along K (1x128 or 128x128 blocks), so the promoted loop
  loads a scale every step; False for scales constant along K (per tensor, row, column).
  column_scales: the rhs scales are 1x128 blocks too (one per output column and step, a
  weight gradient's), so each step also holds a (wg_block_n,) column vector in
  registers: 128 x 128 tiles (64 + 64 + 32 registers per thread, where a 64x192
  warpgroup tile's 96 + 96 + 48 exceed the 192 that `check` allows).

  Promoted (block scales along K, and constant scales by default): two 64-row warpgroup
  tiles of a 128 x 192 CTA tile (96 + 96 accumulator registers: the f32 sum and the
  block accumulator), 4 stages, unpaired (no cluster: a stage is released only once both
  CTAs' warpgroups have waited for their products, which would tie the two CTAs'
  promotions together). The 192-wide tile does more MMA per promotion and per byte of
  shared memory than 128 x 128; with block scales it ran 1.0-1.2x faster than 128 x 128
  at every shape measured on the H100 (on the H200, 2.4% slower at 4096^3 and as fast
  at 4096 x 4096 x 7168; docs/performance.md). With constant scales (per tensor, row,
  column) the loop holds no scale loads and no column pieces, so any multiple of 8 is a
  width. 128 x 192 is taken where M * N gives >= ~11 waves of its tiles on 132 SMs
  (M * N >= 6144^2). Below that its coarser last wave costs more than it gains, and
  128 x 176 (88 + 88 registers, 16-column epilogue sub-tiles, the widest that divide
  176) ran 1.06-1.11x the 128 x 128 tiles at M = 4096, N = 4096 and 7168 on the H200
  (CUPTI, docs/performance.md): more MMA per promotion than 128 x 128, and a last wave
  better filled than 192's (4096-wide outputs: 24 column tiles against 22, 5.8 waves
  against 5.3). From 11 waves the two are close (at 8192^3 176 ran 1.02x, at
  4096 x 24576 x 1536 0.96x 192). 176 is not the block scales' tile: it straddles
  128-column scale blocks at every 16 columns (eleven pieces), which ran 0.80-0.96x
  128 x 192. A float32 output whose rows 8 does not divide keeps 128 x 128: it is stored
  through the single-row view (`layout.row_transforms`), whose 64-byte swizzle at 176's
  16-column sub-tiles has not yet run on a GPU (the 16-bit outputs' 32-byte one has).
  Each width only where its padded columns stay within 5% of 128-wide tiles' (N = 200
  would compute 384 columns instead of 256).
  Plain accumulation: two 128x128 tiles of a 256x128 one, as the bf16 kernel, with CTAs
  paired along n where there are two column tiles or more, multicasting their shared
  lhs tile (the bf16 kernels measured 1-5% from it on the H100 / H200 at these tiles).
  A short M (<= 64 rows) takes one 64-row band split by columns, unpaired (its rhs
  tiles, the traffic that matters there, are not shared).
  """
  if m <= 64:
    cfg = Config(block_m=64, block_n=256, wg_split="n", stages=5 if promoted else 6)
  elif promoted and not column_scales and (step_scales or m * n >= 6144 * 6144) and (
      pads_within(n, 192)):
    cfg = Config(block_m=128, block_n=192, wg_split="m", stages=4)
  elif (promoted and not step_scales and not column_scales and pads_within(n, 176)
        and (m % 8 == 0 or jnp.dtype(out_dtype).itemsize < 4)):
    cfg = Config(block_m=128, block_n=176, wg_split="m", stages=4, epi_block_n=16)
  elif promoted:
    cfg = Config(block_m=128, block_n=128, wg_split="m", stages=5)
  else:
    cfg = Config(block_m=256, block_n=128, wg_split="m", stages=4)
  cfg = cfg.replace(fast_accumulation=not promoted)
  if m > 64 and n > cfg.block_n and not promoted:
    cfg = cfg.replace(cluster_n=2)
  if jnp.dtype(out_dtype).itemsize == 4:
    cfg = cfg.replace(epi_block_n=min(cfg.epi_block_n, 32))
  return deepest_ring(cfg, lambda c: smem_bytes(c, out_dtype, row_scales=promoted,
                                                 column_scales=promoted))
