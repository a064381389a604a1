"""Triton-backend specifics: Config validation, default_config, the kernel called directly.

The backend-independent suite (test_gemm.py) drives this backend through the front door;
here the kernel is called with small explicit tiles so interpret mode stays fast, and the
ragged cases put every kind of edge (M, N and the peeled K tail) in one problem. Interpret
mode pads blocks and out-of-range slices with NaN, so a missing K mask shows up here as
NaN; missing M/N load or store masks do not (the `gpu` tests and compute-sanitizer do).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU, random, skip_reason
from pallas_gemm.matmul import triton
from pallas_gemm.testing.reference import reference, relative_error, tolerance

HIGHEST = jax.lax.Precision.HIGHEST
BF16 = jnp.bfloat16
# Small tiles: few interpreted grid steps, and every ragged shape below hits all edges.
SMALL = triton.Config(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=2)


def run(rng, m, n, k, dtype=np.float32, precision=HIGHEST, *, batch=1, batch_b=None,
        transpose_a=False, transpose_b=False, alpha=1.0, beta=0.0, c_value=None,
        out_dtype=None, config=SMALL, interpret=not ON_GPU):
  """Calls triton.gemm on 3-D operands (as the front door does) and checks it in float64."""
  reason = skip_reason("triton", dtype, precision)
  if reason:
    pytest.skip(reason)
  batch_b = batch if batch_b is None else batch_b
  a = random(rng, (batch,) + ((k, m) if transpose_a else (m, k)), dtype)
  b = random(rng, (batch_b,) + ((n, k) if transpose_b else (k, n)), dtype)
  c = None
  if c_value is not None:
    c = np.full((batch, m, n), c_value, np.float32)
  elif beta != 0.0:
    c = random(rng, (batch, m, n), np.float32)
  out_dtype = np.dtype(out_dtype or dtype)
  out = triton.gemm(
      jnp.asarray(a), jnp.asarray(b), None if c is None else jnp.asarray(c),
      alpha=alpha, beta=beta, transpose_a=transpose_a, transpose_b=transpose_b,
      precision=precision, out_dtype=out_dtype, config=config, interpret=interpret)
  assert out.shape == (batch, m, n) and out.dtype == out_dtype, (out.shape, out.dtype)
  ref = reference(a, b, c, alpha=alpha, beta=beta, transpose_a=transpose_a,
                  transpose_b=transpose_b)
  err = relative_error(out, ref)
  tol = tolerance(dtype, precision, k, out_dtype)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g} ({m}x{n}x{k}, {np.dtype(dtype)})"


# --- Config ------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,words", [
    ("block_m", 96, "power of two"),
    ("block_n", 0, "power of two"),
    ("block_k", 8, ">= 16"),
    ("block_m", 1024, "[16, 512]"),
    ("group_m", 3, "power of two"),
    ("num_warps", 6, "power of two"),
    ("num_warps", 64, "1024"),
    ("num_stages", 0, "[1, 8]"),
    ("block_k", 32.0, "must be an int"),
    ("num_stages", True, "must be an int"),
])
def test_config_rejects(field, value, words):
  with pytest.raises(ValueError, match=rf"Config\.{field}") as info:
    triton.Config(**{field: value})
  assert words in str(info.value)


def test_config_is_frozen_and_keyword_only():
  config = triton.Config()
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.block_m = 64
  with pytest.raises(TypeError):
    triton.Config(128, 128, 32)


@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (4097, 4097, 4097), (1, 1, 1),
                                   (16, 8192, 8192), (8192, 8192, 512), (1000, 1000, 1000)])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
def test_default_config(m, n, k, dtype):
  config = triton.default_config(m, n, k, dtype)
  assert isinstance(config, triton.Config)
  # Fits the 227 KiB of shared memory a Hopper block may use.
  assert triton.shared_memory_bytes(config, dtype) <= 232448
  if (m, n, k) == (4096, 4096, 4096):  # the anchors' best plain-Triton tiles
    big = (128, 256, 64) if np.dtype(dtype).itemsize == 2 else (128, 128, 32)
    assert (config.block_m, config.block_n, config.block_k) == big
  if m <= 16:
    assert config.block_m == 16


def test_supports_and_availability():
  assert triton.supports(np.float32, HIGHEST) is None
  assert triton.supports(np.dtype(BF16), None) is None
  assert triton.supports(np.float16, None) is None
  assert "float64" in triton.supports(np.float64, None)
  if jax.default_backend() == "cpu":
    assert triton.unavailable_reason() is None  # the interpreter runs it


# --- Kernel, interpret mode on CPU (the real kernel on a GPU) ----------------------------

@pytest.mark.parametrize("m,n,k", [(64, 64, 32), (7, 129, 33), (33, 17, 5), (48, 96, 100)])
def test_shapes(m, n, k, rng):
  run(rng, m, n, k)


@pytest.mark.parametrize("transpose_a,transpose_b", [(True, False), (False, True), (True, True)])
def test_transposes(transpose_a, transpose_b, rng):
  run(rng, 40, 72, 24, transpose_a=transpose_a, transpose_b=transpose_b)


@pytest.mark.parametrize("batch_b", [1, 3])
def test_batched(batch_b, rng):
  run(rng, 20, 40, 36, batch=3, batch_b=batch_b)


def test_alpha_beta(rng):
  run(rng, 24, 50, 40, alpha=-0.5, beta=1.5, transpose_b=True)


def test_beta_zero_never_reads_c(rng):
  run(rng, 24, 40, 16, beta=0.0, c_value=np.nan)


@pytest.mark.parametrize("dtype,out_dtype", [(BF16, None), (np.float16, None), (BF16, np.float32)])
def test_16bit(dtype, out_dtype, rng):
  run(rng, 37, 64, 70, dtype, None, out_dtype=out_dtype, alpha=2.0)


def test_tf32_precision(rng):
  run(rng, 32, 32, 48, np.float32, None)


def test_group_order_covers_every_tile(rng):
  # 5 x 3 tiles with group_m=4: the last group is partial (1 row of tiles).
  config = dataclasses.replace(SMALL, group_m=4)
  run(rng, 5 * 16 - 3, 3 * 32 - 5, 20, config=config)


# --- Lowering to Triton IR for an abstract H100, on any machine -------------------------

@pytest.mark.parametrize("m,n,k,dtype,transposes,beta", [
    (4096, 4096, 4096, BF16, (False, False), 0.0),
    (4097, 4097, 4097, BF16, (False, False), 0.0),
    (4096, 4096, 4096, np.float32, (False, False), 0.0),
    (100, 36, 70, np.float16, (True, True), 0.5),
])
def test_lowers_to_triton_ir(m, n, k, dtype, transposes, beta):
  # Runs the Pallas -> Triton IR lowering (every primitive must have a Triton rule);
  # Triton's own compilation to PTX only happens on the GPU.
  transpose_a, transpose_b = transposes
  device = jax.sharding.AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  a = jax.ShapeDtypeStruct((1, k, m) if transpose_a else (1, m, k), dtype)
  b = jax.ShapeDtypeStruct((1, n, k) if transpose_b else (1, k, n), dtype)
  c = jax.ShapeDtypeStruct((1, m, n), np.float32) if beta else None
  config = triton.default_config(m, n, k, dtype)

  def f(a, b, c):
    return triton.gemm(a, b, c, alpha=1.0, beta=beta, transpose_a=transpose_a,
                       transpose_b=transpose_b, precision=HIGHEST, out_dtype=np.dtype(dtype),
                       config=config, interpret=False)

  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(f).trace(a, b, c).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text


# --- The compiled kernel's edges (device machine) -----------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    SMALL,
    triton.Config(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3),
    triton.Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
], ids=["16x32x16", "64x64x32", "128x256x64"])
@pytest.mark.parametrize("dtype,precision", [(np.float32, HIGHEST), (BF16, None)])
@pytest.mark.parametrize("transposes", [(False, False), (True, True)])
def test_gpu_ragged_edges(config, dtype, precision, transposes, rng):
  run(rng, 257, 131, 97, dtype, precision, batch=2, batch_b=1, beta=0.5,
      transpose_a=transposes[0], transpose_b=transposes[1], config=config, interpret=False)
