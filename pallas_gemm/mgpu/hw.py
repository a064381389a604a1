"""Facts of the Hopper (sm_90) GPUs every Mosaic GPU kernel of this package sizes itself by."""

from __future__ import annotations

import functools

import jax

# Shared memory per block on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SMEM_BYTES_PER_BLOCK = 232448
# Mosaic GPU reserves this much for cross-warp reductions (CompilerParams).
RESERVED_SMEM_BYTES = 128 * 4 * 4
# SM count used by interpret mode (the CPU has none) when a config's num_sms is None.
INTERPRET_NUM_SMS = 4


@functools.cache
def num_sms() -> int:
  """The GPU's SM count, for the backends' shape heuristics.

  132 (the H100 / H200 this project targets) where no GPU is visible, so that CPU tests
  and lowering pick the tiles the target GPU would.
  """
  try:
    return jax.devices("gpu")[0].core_count
  except RuntimeError:  # no GPU platform
    return 132


def on_gpu() -> bool:
  """Whether jax's default backend is a GPU (else the kernels run in interpret mode)."""
  return jax.default_backend() == "gpu"


def unavailable_reason() -> str | None:
  """None when a Mosaic GPU kernel of this package can run here: an sm_90 GPU, or a
  CPU (interpret mode), else why not."""
  try:
    device = jax.devices()[0]
  except RuntimeError as e:  # no backend at all
    return f"no JAX device: {e}"
  if device.platform == "cpu":
    return None  # Mosaic GPU interpret mode runs on the CPU.
  if device.platform != "gpu":
    return f"Mosaic GPU needs an NVIDIA GPU, the default device is {device.platform}"
  cc = getattr(device, "compute_capability", None)
  if cc is None or str(cc) not in ("9.0", "9.0a"):
    return (f"the kernel uses wgmma, which needs sm_90 (Hopper); the device"
            f" {device.device_kind} has compute capability {cc}")
  return None
