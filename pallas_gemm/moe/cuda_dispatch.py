"""The MoE layer's dispatch at decode sizes as one CUDA kernel (`cuda_dispatch.cu`).

At a decode step's 1024 pairs the dispatch in XLA (counting each pair's sorted row, the
group sizes, the gather of x's rows) is several kernels of a few microseconds each, and
each launch leaves a gap before the next, around grouped GEMMs of 0.1-0.2 ms. The kernel
computes the same `Dispatch` and the gathered rows x[token] in one launch, bit for bit
(tests/test_moe.py compares them on a GPU). The shared library `_cuda_dispatch.so` is built
by CMake at install time when nvcc is present; without it `layer.dispatch` runs in XLA.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax
import jax.numpy as jnp

from pallas_gemm.core import ffi_library
from pallas_gemm.mgpu import hw

TARGET_NAME = "pallas_gemm_moe_dispatch"
LIBRARY_ENV = "PALLAS_GEMM_MOE_DISPATCH_LIB"
_LIBRARY_NAMES = ("_cuda_dispatch.so", "lib_cuda_dispatch.so")
# Each block copies about this many bytes of rows (and ranks every pair itself first).
_BYTES_PER_BLOCK = 32 * 1024


def _declare(lib) -> None:
  lib.pallas_gemm_moe_dispatch_max_pairs.restype = ctypes.c_int
  lib.pallas_gemm_moe_dispatch_max_keys.restype = ctypes.c_int


_LIB, _LIB_ERROR = ffi_library.load(pathlib.Path(__file__).parent, "pallas_gemm/moe",
                                    _LIBRARY_NAMES, LIBRARY_ENV, _declare)
if _LIB is not None:
  jax.ffi.register_ffi_target(
      TARGET_NAME, jax.ffi.pycapsule(_LIB.PallasGemmMoeDispatch), platform="CUDA")
  MAX_PAIRS = _LIB.pallas_gemm_moe_dispatch_max_pairs()
  MAX_EXPERTS = _LIB.pallas_gemm_moe_dispatch_max_keys() - 1
else:
  MAX_PAIRS = MAX_EXPERTS = 0


def library_error() -> str | None:
  """None when the shared library is loaded and its target registered, else why not."""
  return _LIB_ERROR


@functools.cache
def _gpu_reason() -> str | None:
  try:
    devices = jax.devices("cuda")
  except RuntimeError as e:
    return f"no CUDA GPU visible to jax ({e})"
  capability = getattr(devices[0], "compute_capability", None)
  if capability is not None and tuple(int(v) for v in str(capability).split(".")) < (8, 0):
    return f"the kernel is compiled for compute capability >= 8.0, got {capability}"
  return None


def unavailable_reason(pairs: int, num_experts: int) -> str | None:
  """None when `dispatch_rows` runs for these sizes here, else why not."""
  if _LIB is None:
    return _LIB_ERROR
  if not hw.on_gpu():
    return f"jax's default backend is {jax.default_backend()}, not a GPU"
  if not 1 <= pairs <= MAX_PAIRS:
    return f"{pairs} pairs: the kernel ranks 1 to {MAX_PAIRS} in shared memory"
  if not 1 <= num_experts <= MAX_EXPERTS:
    return f"{num_experts} experts: the kernel counts 1 to {MAX_EXPERTS}"
  return _gpu_reason()


def dispatch_rows(x, topk_ids, num_experts: int):
  """(order, token, inverse, group_sizes, rows) of `layer.dispatch` for x (T, D) and
  topk_ids (T, k), rows = x[token] (R, D); int32 vectors. Runs where
  `unavailable_reason(T * k, num_experts)` is None. rows carry no gradient
  (`jax.lax.stop_gradient`): the layer's backward sums x's gradient from its rows itself."""
  t, k = topk_ids.shape
  pairs = t * k
  row_bytes = x.shape[1] * jnp.dtype(x.dtype).itemsize
  blocks = max(1, min(pairs, hw.num_sms(), -(-pairs * row_bytes // _BYTES_PER_BLOCK)))
  ints = jax.ShapeDtypeStruct((pairs,), jnp.int32)
  call = jax.ffi.ffi_call(
      TARGET_NAME,
      (ints, ints, ints, jax.ShapeDtypeStruct((num_experts,), jnp.int32),
       jax.ShapeDtypeStruct((pairs, x.shape[1]), x.dtype)),
      vmap_method="sequential")
  order, token, inverse, group_sizes, rows = call(
      jax.lax.stop_gradient(topk_ids.astype(jnp.int32)), jax.lax.stop_gradient(x),
      k=k, experts=num_experts, blocks=blocks)
  return order, token, inverse, group_sizes, rows
