"""The checks and the backend choice every fp8 entry point shares (`scaled_matmul`,
`scaled_ragged_dot`, `quantize`): operands, scales, result dtype, and whether the Hopper
kernels take the call."""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np

from pallas_gemm.core.checks import require_array
from pallas_gemm.fp8 import scales
from pallas_gemm.mgpu import hw

BACKENDS = ("xla", "mosaic")
OUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
K_BLOCK = 128  # the kernel's scale granularity along K


def mosaic_module():
  """The Hopper kernel's module (imported when first asked for)."""
  return importlib.import_module("pallas_gemm.fp8.mosaic_gemm")


def mosaic_unavailable_reason() -> str | None:
  """None when the mosaic backend can run here (sm_90, or a CPU in interpret mode)."""
  try:
    mosaic_module()
  except ImportError as e:
    return f"the Mosaic fp8 kernel cannot be imported: {e}"
  return hw.unavailable_reason()


def operand(x, name: str) -> np.dtype:
  require_array(x, name)
  dtype = np.dtype(x.dtype)
  if dtype not in scales.FP8_DTYPES:
    raise TypeError(f"{name}.dtype must be float8_e4m3fn or float8_e5m2 (quantize() makes"
                    f" them); got {dtype}")
  return dtype


def check_scales(x, name: str) -> None:
  require_array(x, name)
  if np.dtype(x.dtype) not in scales.SCALE_DTYPES:
    raise TypeError(f"{name}.dtype must be float32 (or bfloat16, float16, float8_e8m0fnu);"
                    f" got {np.dtype(x.dtype)}")


def out_dtype(preferred_element_type) -> np.dtype:
  if preferred_element_type is None:
    return np.dtype(np.float32)
  try:
    dtype = np.dtype(preferred_element_type)
  except TypeError:
    raise TypeError(f"preferred_element_type must be float32, bfloat16 or float16; got"
                    f" {preferred_element_type!r}") from None
  if dtype not in OUT_DTYPES:
    raise TypeError(f"preferred_element_type must be float32, bfloat16 or float16; got {dtype}")
  return dtype


def choose(backend: str, config, kernel_reason: str | None) -> str:
  if backend not in (*BACKENDS, "auto"):
    raise ValueError(f"backend must be 'auto', 'xla' or 'mosaic'; got {backend!r}")
  if backend == "auto" and config is None:
    usable = hw.on_gpu() and kernel_reason is None and mosaic_unavailable_reason() is None
    return "mosaic" if usable else "xla"
  if backend == "xla":
    if config is not None:
      raise TypeError(f"config is the mosaic kernel's; backend='xla' takes none (got"
                      f" {type(config).__qualname__})")
    return backend
  reason = mosaic_unavailable_reason() or kernel_reason
  if reason is not None:
    raise ValueError(f"backend='mosaic' cannot run this call: {reason} (backend='xla' can)")
  from pallas_gemm.fp8.config import Config  # noqa: PLC0415 - with the kernel
  if config is not None and not isinstance(config, Config):
    raise TypeError(f"config must be a pallas_gemm.fp8.config.Config; got"
                    f" {type(config).__module__}.{type(config).__qualname__}")
  return "mosaic"
