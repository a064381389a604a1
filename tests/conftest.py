"""Shared fixtures; every skip decision of the suite is made here, in `skip_reason`."""

import contextlib
import os
import zlib

# Eight host devices, so tests/test_sharding.py can partition on a CPU. Set before jax
# initialises its backends; it changes nothing on a GPU (the flag is the host platform's).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm.matmul import auto  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
# Fresh random inputs every run; the seed is printed so a failure can be replayed.
SEED = int(os.environ.get("PALLAS_GEMM_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


def pytest_report_header(config):
  return [f"pallas_gemm: jax {jax.__version__}, default backend {jax.default_backend()}, "
          f"seed {SEED} (PALLAS_GEMM_TEST_SEED replays)",
          f"pallas_gemm backends: {pallas_gemm.backends()}"]


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (no GPU here); run benchmarks/device_run.sh")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def skip_reason(backend: str, dtype=None, precision=None) -> str | None:
  """Why `backend` cannot run this case here, or None. The only place tests decide skips."""
  reason = pallas_gemm.backends()[backend]
  if reason is not None:
    return f"backend {backend} unavailable: {reason}"
  if dtype is not None:
    reason = auto.backend_module(backend).supports(np.dtype(dtype), precision)
    if reason is not None:
      return f"backend {backend} does not support {np.dtype(dtype)}/{precision}: {reason}"
  return None


@contextlib.contextmanager
def jax_config(name: str, value):
  """Sets a jax config option process-wide for the block, as users set it, then restores
  it. Not `with jax.enable_x64(...)` / `jax.default_device(...)`: those are thread-local,
  and Mosaic GPU's interpreter runs its callbacks and compiles its simulated warpgroups on
  worker threads."""
  previous = getattr(jax.config, name)
  jax.config.update(name, value)
  try:
    yield
  finally:
    jax.config.update(name, previous)


@pytest.fixture(params=auto.BACKENDS)
def backend(request):
  reason = skip_reason(request.param)
  if reason:
    pytest.skip(reason)
  return request.param


@pytest.fixture
def as_on_a_gpu(monkeypatch):
  """hw.on_gpu() true and persistent grids of 132 CTAs: the Mosaic paths as a GPU takes
  them, to lower for CUDA on a CPU."""
  from pallas_gemm.mgpu import hw, launch  # noqa: PLC0415
  grid = launch.grid_sms
  monkeypatch.setattr(hw, "on_gpu", lambda: True)
  monkeypatch.setattr(launch, "grid_sms", lambda num_sms, interpret, need_gpu=False: grid(
      num_sms or 132, interpret))


@pytest.fixture
def rng(request):
  # One stream per test, derived from the run's SEED and the test's name.
  return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])


def random(rng, shape, dtype):
  """Standard-normal values (never zeros), rounded to `dtype`, as a NumPy array."""
  return np.array(jax.numpy.asarray(rng.standard_normal(shape, dtype=np.float32), dtype))
