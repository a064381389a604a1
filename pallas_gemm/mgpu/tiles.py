"""What every Mosaic GPU kernel's tile Config shares: the error a field that breaks a
constraint raises, and the ring depth that fits a block's shared memory."""

from __future__ import annotations

from typing import NoReturn

from pallas_gemm.mgpu.hw import SMEM_BYTES_PER_BLOCK


def config_error(config, field: str, why: str) -> NoReturn:
  """Raises the ValueError of a Config field that breaks a constraint: the field, its value
  and why. Every Mosaic kernel's Config validates through it."""
  raise ValueError(f"Config.{field}={getattr(config, field)!r} is invalid: {why}")


def check_positive_ints(config, fields) -> None:
  """config_error for the first of `fields` that is not a positive int (bools are not)."""
  for field in fields:
    value = getattr(config, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      config_error(config, field, "must be a positive int")


def deepest_ring(config, smem_bytes):
  """`config` with the deepest ring, down to 2 stages, whose smem_bytes(config) fits a block."""
  while config.stages > 2 and smem_bytes(config) > SMEM_BYTES_PER_BLOCK:
    config = config.replace(stages=config.stages - 1)
  return config


# The rules below are Hopper's and Mosaic GPU's, shared by every persistent
# warp-specialized kernel here; each names the field a config breaks them with.


def check_warpgroups(config) -> None:
  """num_compute_wgs and wg_split (and grid_minor_dim, where the config has one)."""
  if config.num_compute_wgs not in (1, 2):
    config_error(config, "num_compute_wgs", "must be 1 or 2 (one producer and at most two"
                 " consumer warpgroups fit the register file with these accumulators)")
  if config.wg_split not in ("m", "n"):
    config_error(config, "wg_split", "must be 'm' or 'n'")
  if getattr(config, "grid_minor_dim", "m") not in ("m", "n"):
    config_error(config, "grid_minor_dim", "must be 'm' or 'n'")


def check_ring(config) -> None:
  """wgmma_wait against the ring's depth: a stage is released only after its wgmma."""
  if config.wgmma_wait not in (0, 1) or isinstance(config.wgmma_wait, bool):
    config_error(config, "wgmma_wait", "must be 0 or 1")
  if config.stages <= config.wgmma_wait:
    config_error(config, "stages", f"must exceed wgmma_wait={config.wgmma_wait} (a stage"
                 " is released only after its wgmma completed)")


def check_cluster(config) -> None:
  """cluster_m / cluster_n (a pair of CTAs sharing a TMA multicast) and num_sms."""
  if config.cluster_m not in (1, 2) or config.cluster_n not in (1, 2):
    config_error(config, "cluster_m" if config.cluster_m not in (1, 2) else "cluster_n",
                 "must be 1 or 2")
  if config.cluster_m == config.cluster_n == 2:
    config_error(config, "cluster_n", "a cluster spans 2 CTAs along m or along n, not both")
  size = config.cluster_m * config.cluster_n
  if config.num_sms is not None and (not isinstance(config.num_sms, int)
                                     or isinstance(config.num_sms, bool)
                                     or config.num_sms < size):
    config_error(config, "num_sms", f"must be None or an int >= the cluster size {size}")


def check_wg_tile(config, wg_m: int, wg_n: int, *, split: bool = True) -> None:
  """A CTA tile (block_m, block_n) split into warpgroup tiles (wg_m, wg_n) that wgmma
  takes, TMA can box, and the (epi_block_m, epi_block_n) epilogue sub-tiles divide.
  split: whether the tile is split among the warpgroups along wg_split."""
  along = config.block_m if config.wg_split == "m" else config.block_n
  if split and along % config.num_compute_wgs:
    config_error(config, f"block_{config.wg_split}", f"must divide evenly among"
                 f" num_compute_wgs={config.num_compute_wgs} warpgroups")
  if wg_m % 64:
    config_error(config, "block_m", f"gives a warpgroup tile of {wg_m} rows; wgmma needs a"
                 " multiple of 64 rows per warpgroup")
  if wg_n % 8 or wg_n > 256:
    config_error(config, "block_n", f"gives a warpgroup tile of {wg_n} columns; wgmma needs"
                 " a multiple of 8, at most 256")
  if config.block_m > 256 or config.block_n > 256:
    config_error(config, "block_m" if config.block_m > 256 else "block_n",
                 "a TMA box dimension is at most 256 elements")
  if config.epi_block_m % 64 or wg_m % config.epi_block_m:
    config_error(config, "epi_block_m", f"must be a multiple of 64 (wgmma register layout)"
                 f" dividing the warpgroup tile's {wg_m} rows")
  if config.epi_block_n % 16 or wg_n % config.epi_block_n:
    config_error(config, "epi_block_n", f"must be a multiple of 16 (a swizzled smem row is"
                 f" at least 32 bytes) dividing the warpgroup tile's {wg_n} columns")
