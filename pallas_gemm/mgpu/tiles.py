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
