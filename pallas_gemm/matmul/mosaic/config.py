"""The Mosaic GPU kernel's Config, its shared-memory accounting and validation, and the
default config per shape. Shared by every Mosaic kernel of this package: the checks say
which constraint of TMA, wgmma or the register file a config breaks."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.core import precision as _precision
from pallas_gemm.mgpu import hw, launch
from pallas_gemm.mgpu.hw import RESERVED_SMEM_BYTES, SMEM_BYTES_PER_BLOCK
from pallas_gemm.mgpu.tiles import (check_cluster, check_positive_ints, check_ring,
                                    check_warpgroups, check_wg_tile, config_error)
from pallas_gemm.mgpu.layout import round_up

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                     jnp.dtype(jnp.float16))


# Autotuning candidates (tuning.default_candidates). Tile order and wgmma_wait moved the
# H200 timings by <= 1%: the grid spends its budget on tiles, ring depth and clusters.
TUNING_GRID = {
    "16bit": {("block_m", "block_n", "wg_split"): (
                  (128, 256, "n"), (256, 128, "m"), (128, 128, "n"), (256, 192, "m")),
              "block_k": (64,), "stages": (3, 4),
              ("cluster_m", "cluster_n"): ((1, 1), (2, 1), (1, 2))},
    "f32": {("block_m", "block_n", "wg_split"): (
                (128, 256, "n"), (256, 128, "m"), (128, 128, "n")),
            "block_k": (32,), "stages": (3, 4), "grid_tile_width": (4, 16),
            "wgmma_wait": (0, 1)},
    # float32 from 16-bit pieces: warpgroup tiles of at most 64x128 (two f32
    # accumulators), the ring holds every piece (default_config's split case).
    "split": {("block_m", "block_n", "wg_split"): (
                  (128, 128, "m"), (128, 128, "n"), (64, 256, "n")),
              "block_k": (32,), "stages": (3, 4), "epi_block_n": (32, 64),
              ("cluster_m", "cluster_n"): ((1, 1), (1, 2), (2, 1))},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tuning parameters of the Mosaic GPU kernel.

  block_m, block_n: the CTA output tile. It is split among the consumer
    warpgroups along ``wg_split``; each warpgroup's part is a wgmma accumulator
    of (block_m / num_compute_wgs, block_n) or (block_m, block_n /
    num_compute_wgs) f32 values.
  block_k: K per pipeline step. block_k * itemsize must be a multiple of 32
    bytes (swizzle); 64 (16-bit) or 32 (f32) gives the 128-byte swizzle. With an
    FP32 split the tiles are bf16 pieces: a multiple of 16 (32 gives 64-byte rows).
  stages: depth of the TMA ring (``max_concurrent_steps``).
  num_compute_wgs: consumer warpgroups (1 or 2); one producer warpgroup is added.
  wg_split: "m" or "n", the dimension of the CTA tile split among warpgroups.
  grid_minor_dim, grid_tile_width: output tile order (``plgpu.planar_snake``):
    bands of ``grid_tile_width`` tiles along ``grid_minor_dim``.
  epi_block_m, epi_block_n: sub-tile of the epilogue (shared memory -> TMA
    store), double-buffered per consumer warpgroup.
  wgmma_wait: wgmma groups left in flight at the end of a K step (0 or 1). 1
    overlaps consecutive wgmmas and delays the release of a stage by one step.
  cluster_m, cluster_n: CTAs per cluster along m or n (1 or 2, not both 2).
    The two CTAs of a cluster_m=2 cluster compute vertically adjacent tiles
    that share their B tiles: each CTA loads half of every B tile and TMA
    multicasts it to both, halving B's L2->SM traffic (cluster_n=2: A's).
  num_sms: CTAs of the persistent grid. None: the device's SM count on GPU, 4
    in interpret mode.
  stream_k: cut the last tiles into K ranges (None: on unless pingpong). When the tiles leave the
    last round of CTAs idle enough (bf16 8192^3: 1024 cluster tiles on 66
    clusters, 15.5 rounds), every CTA first runs the full rounds as whole tiles,
    then an equal range of (tile, K block) steps of the rest (the partial round, and
    the last full one if the partial one is under half a round), so that all CTAs
    finish together. A tile cut between CTAs is summed through global memory (see
    ``mosaic/stream_k.py``), which costs more than it saves when the last round
    is nearly full (bf16 4096^3: 3.88 rounds): ``stream_k_schedule`` decides per
    launch. Interpret mode runs whole tiles: its interpreter has no global
    semaphores (jax 0.11.2).
  pingpong: each of the two consumer warpgroups computes whole CTA tiles, taking
    the CTA's tiles in turn (CUTLASS's "ping-pong" schedule), instead of both
    sharing every tile. The producer loads the tiles' K steps in order through the
    one ring, so one warpgroup's main loop runs while the other's epilogue (alpha,
    C, bias, activation, stores) does: the tensor cores do not wait for the epilogue.
    A warpgroup then holds a whole tile's accumulator (at most 128 x 128, 128 f32
    registers per thread). Needs no stream-K or FP32 split, and
    wgmma_wait=1 (with 0, one warpgroup alone leaves the tensor cores idle between K
    steps: 0.72x). Off by default: on the H200 128x128 pingpong tiles ran plain bf16
    products 3% slower than the 256x128 cooperative ones (they move 1.5x the operand
    bytes per FLOP), and the MLP step's two epilogue-heavy GEMMs (GELU + z, gelu'(C))
    1-1.5% slower inside the step (docs/performance.md).
  """

  block_m: int = 128
  block_n: int = 256
  block_k: int = 64
  stages: int = 4
  num_compute_wgs: int = 2
  wg_split: Literal["m", "n"] = "n"
  grid_minor_dim: Literal["m", "n"] = "n"
  grid_tile_width: int = 8
  epi_block_m: int = 64
  epi_block_n: int = 64
  wgmma_wait: int = 0
  cluster_m: int = 1
  cluster_n: int = 1
  num_sms: int | None = None
  stream_k: bool | None = None
  pingpong: bool = False

  def __post_init__(self):
    fail = functools.partial(config_error, self)
    check_positive_ints(self, ("block_m", "block_n", "block_k", "stages", "num_compute_wgs",
                               "grid_tile_width", "epi_block_m", "epi_block_n", "cluster_m",
                               "cluster_n"))
    check_warpgroups(self)
    check_ring(self)
    if self.stream_k is not None and not isinstance(self.stream_k, bool):
      fail("stream_k", "must be None or a bool")
    if not isinstance(self.pingpong, bool):
      fail("pingpong", "must be a bool")
    if self.pingpong:
      if self.num_compute_wgs != 2 or self.stream_k:
        fail("pingpong", "needs num_compute_wgs=2 and stream_k off (the two warpgroups"
             " take whole tiles in turn from the producer's ring)")
      if self.block_m * self.block_n > 128 * 128:
        fail("pingpong", f"gives each warpgroup a {self.block_m}x{self.block_n} f32"
             " accumulator; at most 128x128 (128 registers per thread) leaves room"
             " for the epilogue")
    check_cluster(self)
    check_wg_tile(self, self.wg_block_m, self.wg_block_n, split=not self.pingpong)
    if self.block_k % 8 or self.block_k > 256:
      fail("block_k", "must be a multiple of 8 (wgmma K step) and at most 256")
    if self.block_n % 16:
      fail("block_n", "must be a multiple of 16 (a swizzled smem row of B is"
           " at least 32 bytes)")

  @property
  def wg_block_m(self) -> int:
    """Rows of one consumer warpgroup's accumulator."""
    if self.wg_split == "m" and not self.pingpong:
      return self.block_m // self.num_compute_wgs
    return self.block_m

  @property
  def wg_block_n(self) -> int:
    """Columns of one consumer warpgroup's accumulator."""
    if self.wg_split == "n" and not self.pingpong:
      return self.block_n // self.num_compute_wgs
    return self.block_n

  @property
  def uses_stream_k(self) -> bool:
    """stream_k, or for None: on unless pingpong (whose warpgroups take whole tiles)."""
    if self.stream_k is None:
      return not self.pingpong
    return self.stream_k

  @property
  def cluster_size(self) -> int:
    return self.cluster_m * self.cluster_n

  @property
  def out_slots(self) -> int:
    """Epilogue buffers per warpgroup (one if a single sub-tile covers it)."""
    sub_tiles = (self.wg_block_m // self.epi_block_m) * (
        self.wg_block_n // self.epi_block_n)
    return min(2, sub_tiles)

  replace = dataclasses.replace


def smem_bytes(config: Config, dtype, out_dtype, c_dtype=None,
               k: int | None = None, split: _precision.Split | None = None) -> int:
  """Shared memory one CTA of the kernel allocates (an upper bound).

  c_dtype: dtype of C, None when C is not read. A C of the out dtype is staged
  in the output buffer; another dtype needs its own buffer.
  k: the problem's K, which caps the ring at ceil(K / block_k) stages.
  split: the FP32 emulation's bf16 split (its ring holds split.pieces bf16 tiles of each
    operand per stage), or None.
  """
  itemsize = jnp.dtype(dtype).itemsize if split is None else 2 * split.pieces
  stages = config.stages
  if k is not None:
    stages = min(stages, -(-k // config.block_k))
  ring = stages * (config.block_m * config.block_k
                   + config.block_k * config.block_n) * itemsize
  epi = config.epi_block_m * config.epi_block_n
  out = config.num_compute_wgs * config.out_slots * epi * jnp.dtype(
      out_dtype).itemsize
  c = 0 if not _c_separate(c_dtype, out_dtype) else (
      config.num_compute_wgs * epi * jnp.dtype(c_dtype).itemsize)
  # The ring (pingpong: a set of `produced` barriers per warpgroup); C loads (2 per wg).
  barriers = 8 * ((3 if config.pingpong else 2) * stages + 2 * config.num_compute_wgs)
  # Each buffer is aligned to 1024 bytes (128-byte swizzle atoms).
  return (sum(round_up(x, 1024) for x in (ring, out, c) if x)
          + barriers + RESERVED_SMEM_BYTES)


def check_layout(config: Config, dtype, *, a_k_major: bool,
                 b_k_major: bool, split=None) -> None:
  """Raises ValueError if the config's tiles do not fit the smem swizzle.

  A warpgroup's slice of a shared-memory tile along its minor (contiguous)
  dimension must start on a swizzle atom (128 bytes; with an FP32 split, whose
  MN-major piece tiles take the K-major tile's swizzle, that swizzle's width), and
  every minor dimension must hold at least 32 bytes (the smallest swizzle).
  """
  itemsize = jnp.dtype(dtype).itemsize
  if config.block_k * itemsize % 32:
    raise ValueError(
        f"Config.block_k={config.block_k} gives {config.block_k * itemsize}"
        f"-byte rows for {jnp.dtype(dtype).name}; swizzled smem rows need a"
        " multiple of 32 bytes")
  a_minor = config.block_k if a_k_major else config.block_m
  b_minor = config.block_k if b_k_major else config.block_n
  a_swizzle = plgpu.find_swizzle(_swizzle_minor(config, a_minor, a_k_major, split)
                                 * itemsize * 8)
  b_swizzle = plgpu.find_swizzle(_swizzle_minor(config, b_minor, b_k_major, split)
                                 * itemsize * 8)
  if a_swizzle != b_swizzle:
    raise ValueError(
        f"Config: the A tile's contiguous dim ({a_minor} elements) gets a"
        f" {a_swizzle}-byte swizzle but the B tile's ({b_minor}) a {b_swizzle}"
        "-byte one; wgmma needs both operands with the same swizzle (make"
        " block_n/block_m/block_k a multiple of 128 bytes)")
  if config.num_compute_wgs > 1 and not config.pingpong:
    if config.wg_split == "n" and not b_k_major:
      minor, what = config.wg_block_n, "wg_block_n (block_n / num_compute_wgs)"
    elif config.wg_split == "m" and not a_k_major:
      minor, what = config.wg_block_m, "wg_block_m (block_m / num_compute_wgs)"
    else:
      return
    if minor * itemsize % (128 if split is None else a_swizzle):
      raise ValueError(
          f"Config: {what}={minor} splits a shared-memory tile along its"
          f" contiguous dimension at {minor * itemsize} bytes for"
          f" {jnp.dtype(dtype).name}; the split must fall on a swizzle atom"
          f" ({128 if split is None else a_swizzle} bytes; use a wider tile or the"
          " other wg_split)")


def check_smem_budget(config: Config, dtype, out_dtype, c_dtype=None,
                      k: int | None = None, split: _precision.Split | None = None) -> None:
  """Raises ValueError if the kernel would not fit an sm_90 block's smem."""
  used = smem_bytes(config, dtype, out_dtype, c_dtype, k, split)
  if used > SMEM_BYTES_PER_BLOCK:
    raise ValueError(
        f"Config {config} needs {used} bytes of shared memory for"
        f" dtype={jnp.dtype(dtype).name}, out_dtype={jnp.dtype(out_dtype).name}"
        + (f", c_dtype={jnp.dtype(c_dtype).name}" if c_dtype is not None else "")
        + (f", split {split.name}" if split is not None else "")
        + f"; sm_90 allows {SMEM_BYTES_PER_BLOCK} per block (shared-memory"
        " budget: stages*(block_m+block_n)*block_k*itemsize + epilogue"
        " buffers; with a split the ring holds bf16 pieces). Lower stages, block_k,"
        " the block tile or the epi_block.")


def check_fits(config: Config, dtype, out_dtype, c_dtype=None, k: int | None = None,
               precision=None) -> None:
  """Raises ValueError if the config cannot run a call with these dtypes and precision
  (shared memory; with an FP32 split, `check_split` too). For tuned and candidate configs."""
  split = _precision.split_of(precision, dtype)
  if split is not None:
    check_split(config, split)
  check_smem_budget(config, dtype, out_dtype, c_dtype, k, split)


def check_split(config: Config, split: _precision.Split) -> None:
  """Raises ValueError if the config cannot run the FP32 emulation (see `mosaic/split.py`)."""
  if config.pingpong:
    raise ValueError("Config.pingpong=True: the FP32 split runs with both warpgroups"
                     " sharing each tile")
  if config.wg_block_m * config.wg_block_n > 64 * 128:
    raise ValueError(
        f"Config: a warpgroup tile of {config.wg_block_m}x{config.wg_block_n} is too large"
        " for the FP32 split, which keeps two f32 accumulators of it in registers (at most"
        " 64x128)")


def default_config(m: int, n: int, k: int, dtype, *, out_dtype=None,
                   c_dtype=None, precision=None) -> Config:
  """Picks a config by shape and dtype (fits the shared-memory budget).

  out_dtype defaults to dtype; c_dtype is C's dtype (None: no C). Both change
  the epilogue's shared memory, so pass them when they are known. precision
  matters for float32 emulated from bf16 pieces (`precision.split_of`).
  """
  dtype = jnp.dtype(dtype)
  out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
  block_k = 128 // dtype.itemsize  # 128-byte rows: the widest swizzle.
  split = _precision.split_of(precision, dtype)
  if split is not None:
    # Two f32 accumulators per warpgroup (the running sum and the K block's) cap its
    # tile at 64x128. A 128x128 CTA tile (two warpgroups of 64 rows) with 3 pieces of
    # each operand and 32-wide K blocks loads 48 KB per K step, as the 256x128 bf16
    # tiles do, for six products; that leaves room for 3 stages and the epilogue. CTA pairs
    # sharing A (multicast): 4097^3 89.6 vs 85.0 TFLOP/s, 8192^3 112.6 vs 111.1, 4096^3
    # even (H100); 64x256 tiles split by columns ran 7-15% slower.
    # float16 pieces (float32_f16x3, two per operand): 64-wide K blocks in the same 64 KB
    # per stage (and a 64x32 f32 epilogue sub-tile to fit): 180 / 200 / 128 TFLOP/s at
    # 4096^3 / 8192^3 / 4097^3 against 156 / 163 / 115 with 32-wide blocks (H200): three
    # products per K block are too few to cover the block's sync.
    f16 = split.dtype == "float16"
    big = m > 64 and n > 128
    cfg = Config(block_m=128 if m > 64 else 64, block_n=128, block_k=64 if f16 else 32,
                 stages=3, num_compute_wgs=2 if m > 64 else 1, wg_split="m", epi_block_m=64,
                 epi_block_n=32 if f16 else 64, grid_minor_dim="n", grid_tile_width=8,
                 cluster_n=2 if big else 1)
  elif max(m, n) <= 64 or (m <= 128 and n <= 128):
    # Tiny problems: one warpgroup, a small tile, fewer wasted zero rows.
    # B's block must keep the 128-byte swizzle of A (wgmma needs one swizzle).
    block_n = min(128, round_up(n, 128 // dtype.itemsize))
    cfg = Config(block_m=64, block_n=block_n, block_k=block_k, stages=4,
                 num_compute_wgs=1, wg_split="n", epi_block_m=64,
                 epi_block_n=_largest_divisor(block_n, 64, 16),
                 grid_tile_width=4)
  elif m <= 64:
    # Skinny M (e.g. 16 x 8192 x 8192): 64-row tiles, wide N, deep ring.
    cfg = Config(block_m=64, block_n=256, block_k=block_k, stages=6,
                 num_compute_wgs=2, wg_split="n", epi_block_m=64,
                 epi_block_n=64)
  elif n <= 64:
    # Narrow N: a 64-wide tile split by rows (a 32-column warpgroup slice would
    # break the 128-byte swizzle atom).
    cfg = Config(block_m=128, block_n=64, block_k=block_k, stages=6,
                 num_compute_wgs=2, wg_split="m", epi_block_m=64,
                 epi_block_n=_largest_divisor(64, 64, 16))
  elif m >= 256 and n >= 256:
    # 256 x 128 CTA tiles, two consumer warpgroups of 128 x 128 each, and CTAs
    # paired along n so that each pair loads its shared A tile once (multicast).
    # On the H200 this beat 128 x 256 without clusters by 1-2% at 4096^3 and
    # 8192^3. wgmma_wait=1 moved it by 0-0.7%, within the noise of a default.
    cfg = Config(block_m=256, block_n=128, block_k=block_k, stages=4,
                 num_compute_wgs=2, wg_split="m", epi_block_m=64,
                 epi_block_n=64, grid_minor_dim="n", grid_tile_width=8,
                 cluster_n=2)
    if dtype.itemsize == 2:
      # 1.5x wider tiles (3 stages fit) when they need clearly fewer rounds of
      # tiles over the SMs: bf16 4097^3 takes 5 rounds of 256x128 clusters and 3
      # of 256x192 tiles, 493 vs 543 TFLOP/s on the H200;
      # a round of them cost 1.40x one of 256x128 there, so 1.45 with a 10% margin
      # keeps 256x128 where both are close (4096^3: 797 vs 743).
      wide = Config(block_m=256, block_n=192, block_k=block_k, stages=3,
                    num_compute_wgs=2, wg_split="m", epi_block_m=64,
                    epi_block_n=64, grid_minor_dim="n", grid_tile_width=8)
      if 1.45 * _rounds(wide, m, n) <= 0.9 * _rounds(cfg, m, n):
        cfg = wide
  else:
    # 128 x 256 CTA tile, two consumer warpgroups of 128 x 128 each.
    cfg = Config(block_m=128, block_n=256, block_k=block_k, stages=4,
                 num_compute_wgs=2, wg_split="n", epi_block_m=64,
                 epi_block_n=64, grid_minor_dim="n", grid_tile_width=8)
  # Shrink the epilogue, then the ring, until it fits.
  while smem_bytes(cfg, dtype, out_dtype, c_dtype, k, split) > SMEM_BYTES_PER_BLOCK:
    if cfg.epi_block_n > 32 or (cfg.epi_block_n > 8 and cfg.stages <= 2):
      cfg = cfg.replace(epi_block_n=cfg.epi_block_n // 2)
    elif cfg.stages > 2:
      cfg = cfg.replace(stages=cfg.stages - 1)
    else:
      break
  return cfg


def _rounds(config: Config, m: int, n: int) -> int:
  """Rounds of CTA tiles (clusters) over the SMs for an m x n output."""
  tiles_m = -(-m // config.block_m)
  tiles_n = -(-n // config.block_n)
  clusters = -(-tiles_m // config.cluster_m) * -(-tiles_n // config.cluster_n)
  return -(-clusters // (hw.num_sms() // config.cluster_size))


def _sub_tiles(config: Config) -> list[tuple[slice, slice]]:
  """The (epi_block_m, epi_block_n) sub-tiles of a warpgroup's accumulator, row-major:
  the epilogue stores them one by one, and a stream-K hand-over writes and reads the
  f32 partials in the same pieces."""
  em, en = config.epi_block_m, config.epi_block_n
  return [(slice(i * em, (i + 1) * em), slice(j * en, (j + 1) * en))
          for i in range(config.wg_block_m // em) for j in range(config.wg_block_n // en)]


def _c_separate(c_dtype, out_dtype) -> bool:
  return c_dtype is not None and jnp.dtype(c_dtype) != jnp.dtype(out_dtype)


def _largest_divisor(x: int, at_most: int, multiple_of: int) -> int:
  for d in range(at_most, 0, -multiple_of):
    if x % d == 0:
      return d
  return multiple_of


def _swizzle_minor(config: Config, minor: int, k_major: bool, split) -> int:
  """The minor size that picks a smem tile's swizzle: its minor (last) dim, except for an
  FP32 split's MN-major operand. Its bf16 pieces keep the operand's stored layout (no XLA
  transpose before the split) and its tile takes the K-major tile's swizzle (block_k
  wide, 64 bytes for block_k=32): wgmma needs the same swizzle on both operands."""
  return config.block_k if split is not None and not k_major else minor



def _num_sms(config: Config, interpret: bool) -> int:
  return launch.grid_sms(config.num_sms, interpret, need_gpu=True)

