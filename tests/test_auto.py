"""backend="auto": the decision table of auto.auto_backend (README documents it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_gemm.matmul import auto
from pallas_gemm.matmul import api
from pallas_gemm.mgpu import hw

HIGHEST = jax.lax.Precision.HIGHEST
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)


# Misaligned 16-bit products: the mosaic kernel under jax 0.11, XLA under 0.12 (auto.py).
MISALIGNED16 = "mosaic" if auto.MISALIGNED_16BIT_KERNEL else "xla"


def test_misaligned_16bit_kernel_by_jax_version(fake_gpu, monkeypatch):
  for kernel, expected in ((True, "mosaic"), (False, "xla")):
    monkeypatch.setattr(auto, "MISALIGNED_16BIT_KERNEL", kernel)
    assert auto.auto_backend(BF16, None, 4097, 4097, 4097, (4097,) * 3) == expected
  # f32 (TF32) misaligned keeps its kernel either way: it was not measured slow on 0.12.
  assert auto.auto_backend(F32, None, 4097, 4097, 4097, (4097,) * 3) == "mosaic"


@pytest.fixture
def fake_gpu(monkeypatch):
  monkeypatch.setattr(hw, "on_gpu", lambda: True)
  monkeypatch.setattr(auto, "backends", lambda: {name: None for name in auto.BACKENDS})
  monkeypatch.setattr(hw, "num_sms", lambda: 132)  # the H200 the table was measured on


@pytest.mark.parametrize("dtype,precision,shape,expected", [
    (BF16, None, (4096, 4096, 4096), "xla"),        # aligned: cuBLAS keeps it
    (BF16, None, (4097, 4097, 4097), MISALIGNED16),  # misaligned rows: cuBLAS falls off TMA
    (BF16, None, (4096, 4097, 4096), MISALIGNED16),  # N alone misaligns B and C
    (F32, None, (4097, 4097, 4097), "mosaic"),      # TF32 allowed
    (F32, HIGHEST, (4097, 4097, 4097), "cuda"),     # IEEE f32, >= a wave of tiles: stream-K
    (F32, HIGHEST, (3000, 3000, 3000), "cuda"),
    (F32, HIGHEST, (2048, 2048, 2048), "xla"),      # IEEE f32 below a wave of 128x128 tiles
    (F32, HIGHEST, (2047, 8191, 1023), "xla"),      # IEEE f32, short K
    (BF16, None, (16, 8193, 8193), "xla"),          # skinny
    (BF16, None, (300, 301, 301), "triton"),        # small 16-bit: one short Triton launch
    (F32, None, (300, 301, 301), "xla"),            # small f32
    (BF16, None, (1000, 1000, 1000), "xla"),        # aligned (2000-byte rows)
    (BF16, None, (997, 1009, 1013), MISALIGNED16),  # misaligned
    (F32, None, (997, 1009, 1013), "xla"),          # misaligned TF32, too small to pay its copies
    (F32, None, (2047, 8191, 1023), "mosaic"),      # misaligned TF32, large enough
])
def test_auto_on_gpu(fake_gpu, dtype, precision, shape, expected):
  m, n, k = shape
  assert auto.auto_backend(dtype, precision, m, n, k, (k, n, n)) == expected


def test_auto_batched_ieee_f32_stays_on_cublas(fake_gpu):
  assert auto.auto_backend(F32, HIGHEST, 4097, 4097, 4097, (4097,) * 3, batch=2) == "xla"


@pytest.mark.parametrize("transpose_a,transpose_b,expected", [
    (False, False, "cuda"), (True, False, "cuda"), (True, True, "cuda"),
    (False, True, "xla"),  # both operands K-contiguous: the cuda kernel's slow layout
])
def test_auto_ieee_f32_by_layout(fake_gpu, transpose_a, transpose_b, expected):
  assert auto.auto_backend(F32, HIGHEST, 4097, 4097, 4097, (4097,) * 3,
                           transpose_a=transpose_a, transpose_b=transpose_b) == expected


def test_auto_batched_small_cubes_stay_on_cublas(fake_gpu):
  # 64 x 256^3 bf16: cuBLAS's batched kernel beat the Triton kernel (0.80x) in the sweep.
  assert auto.auto_backend(BF16, None, 256, 256, 256, (256, 256, 256), batch=64) == "xla"
  assert auto.auto_backend(BF16, None, 256, 256, 256, (256, 256, 256), batch=1) == "triton"


def test_auto_on_cpu_is_xla(monkeypatch):
  monkeypatch.setattr(hw, "on_gpu", lambda: False)
  assert auto.auto_backend(BF16, None, 4097, 4097, 4097, (4097, 4097, 4097)) == "xla"


@pytest.mark.parametrize("shape,dtype,epilogue,batch,expected", [
    ((4096, 4096, 4096), BF16, True, 1, "mosaic"),   # beta*C / bias / act in the kernel's epilogue
    ((8192, 16384, 4096), BF16, True, 1, "mosaic"),  # the MLP step's first layer
    ((8192, 8192, 8192), BF16, True, 1, "mosaic"),
    ((2048, 2048, 2048), BF16, True, 1, "xla"),      # 0.87x there
    ((4096, 4096, 4096), BF16, False, 1, "xla"),     # no C: cuBLAS
    ((4096, 4096, 4096), BF16, True, 2, "xla"),      # batched: unmeasured
    ((4096, 4096, 4096), F32, True, 1, "xla"),       # TF32 with C: unmeasured
])
def test_auto_with_epilogue(fake_gpu, shape, dtype, epilogue, batch, expected):
  m, n, k = shape
  assert auto.auto_backend(dtype, None, m, n, k, (k, n, n), batch=batch,
                           has_epilogue=epilogue) == expected


@pytest.mark.parametrize("precision,shape,expected", [
    ("float32_accurate", (4096, 4096, 4096), "mosaic"),
    ("float32_accurate", (256, 256, 256), "xla"),    # small: IEEE SGEMM meets the contract
    ("float32_accurate", (16, 8192, 8192), "xla"),   # skinny: bound by reading B
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X9, (64, 64, 64), "mosaic"),  # XLA's X9 errs 2.9e-4
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6, (4096, 4096, 4096), "mosaic"),
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6, (256, 256, 256), "xla"),
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3, (4096, 4096, 4096), "xla"),
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3, (4097, 4097, 4097), "mosaic"),  # bf16 rows
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32, (4097, 4097, 4097), "mosaic"),     # misaligned
    (jax.lax.DotAlgorithmPreset.TF32_TF32_F32, (4097, 4097, 4097), "xla"),  # rounds, wgmma truncates
])
def test_auto_precisions(fake_gpu, precision, shape, expected):
  m, n, k = shape
  assert auto.auto_backend(F32, precision, m, n, k, (k, n, n)) == expected


@pytest.mark.parametrize("kwargs,epilogue", [
    ({}, False), ({"alpha": 2.0}, False), ({"bias": True}, True), ({"activation": "relu"}, True),
    ({"c": True, "beta": 1.0}, True), ({"c": True, "beta": 0.0}, False)])
def test_gemm_tells_auto_about_its_epilogue(monkeypatch, kwargs, epilogue):
  seen = []
  monkeypatch.setattr(auto, "auto_backend", lambda *a, **kw: seen.append(kw["has_epilogue"]) or "xla")
  a = jnp.ones((8, 4), jnp.bfloat16)
  b = jnp.ones((4, 6), jnp.bfloat16)
  kwargs = dict(kwargs)
  if kwargs.pop("bias", False):
    kwargs["bias"] = jnp.ones((6,), jnp.bfloat16)
  if kwargs.pop("c", False):
    kwargs["c"] = jnp.ones((8, 6), jnp.bfloat16)
  api.gemm(a, b, **kwargs)
  assert seen == [epilogue]
