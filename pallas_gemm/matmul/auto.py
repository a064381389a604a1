"""The dense family's backends (`BACKENDS`, `backends()`) and the `backend="auto"` policy:
which backend computes a call, from the measurements in benchmarks/results."""

from __future__ import annotations

import importlib

import jax
import numpy as np

from pallas_gemm.core import precision as _precisions
from pallas_gemm.mgpu import hw


BACKENDS = ("xla", "triton", "mosaic", "cuda")

# Whether 16-bit products with misaligned rows go to the mosaic kernel (on padded copies).
# Under jax 0.11 it ran bf16 4097^3 at 545 TFLOP/s against jnp.dot's 135; under jax
# 0.12.0.1 the same call ran 92 TFLOP/s, 0.665x jnp.dot (H200, same run,
# benchmarks/results/2026-11-27-h200), while the aligned kernels and float32_accurate's
# padded bf16 pieces kept their speed. Until that path is measured fast on 0.12, `auto`
# leaves those products to XLA there; backend="mosaic" still runs them.
MISALIGNED_16BIT_KERNEL = jax.__version_info__ < (0, 12)


class BackendUnavailableError(RuntimeError):
  """The requested backend cannot run on this machine (the message says why)."""


def backend_module(name: str):
  return importlib.import_module(f"pallas_gemm.matmul.{name}")


def backends() -> dict[str, str | None]:
  """Maps each backend name to None when it can run here, else the reason it cannot."""
  status = {}
  for name in BACKENDS:
    try:
      status[name] = backend_module(name).unavailable_reason()
    except ImportError as e:  # a backend whose toolchain is missing must not break the others
      status[name] = f"import failed: {e}"
  return status


def auto_backend(dtype: np.dtype, precision, m: int, n: int, k: int,
                  leading_dims: tuple[int, ...], batch: int = 1, transpose_a: bool = False,
                  transpose_b: bool = False, has_epilogue: bool = False) -> str:
  """The `backend="auto"` decision, from the H200 measurements in benchmarks/results.

  cuBLAS (jnp.dot) is 1.0-1.03x our best kernels on aligned 16-bit shapes, so it keeps
  them. Our kernels win where cuBLAS falls off its fast path: a row stride that is not
  16-byte aligned (bf16 4097^3: jnp.dot 135 TFLOP/s, mosaic 545; TF32: 118 vs 239), and
  IEEE f32 grids that leave cuBLAS a part-full last wave (cuda with stream-K).
  """
  if not hw.on_gpu():
    return "xla"
  status = backends()
  if isinstance(precision, (str, jax.lax.DotAlgorithmPreset)):
    # The fastest backend that keeps the precision's promise (benchmarks --precision,
    # H100, TFLOP/s at 4096^3 / 8192^3 / 4097^3, error at 4096^3). Mosaic's
    # bf16 pieces with X6 (float32_accurate too): 103 / 114 / 85, error 2.0e-7, where
    # XLA's X6 runs 84 / 99 / 32 at 4.4e-6 and IEEE SGEMM 52 / 52 / 45 at 1.15e-6. X9:
    # XLA's errs 2.9e-4 (not 9 products), mosaic's 2.0e-7: mosaic at every size. X3 and
    # BF16 (f32 inputs): XLA where cuBLAS gets 16-byte-aligned bf16 rows (X3 172 / 212
    # vs 158 / 202), mosaic where not (4097^3: X3 137 vs 51, BF16 243 vs 120). Small
    # products (below 512^3, unmeasured, launch-bound) stay on XLA (float32_accurate
    # there: IEEE SGEMM), and so do skinny ones (min(M, N) < 128, unmeasured): they are
    # bound by reading the wide operand, which the pieces pass reads, writes 1.5x of and
    # the kernel reads again.
    split = _precisions.split_of(precision, dtype)
    bf16_misaligned = any(d * 2 % 16 for d in leading_dims)
    large = m * n * k >= 512**3 and min(m, n) >= 128
    # float32_f16x3 (opt-in for speed): mosaic wherever large.
    if split is not None and status["mosaic"] is None and (
        precision == jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X9
        or (large and (len(split.products) >= 6 or bf16_misaligned or split.scaled))):
      return "mosaic"
    return "xla"
  # Small square-ish 16-bit products: the Triton kernel's single short launch beats cuBLAS
  # (bf16 256^3: 1.24x, 512^3: 1.60x; at 1024^3 cuBLAS wins again, 0.74x). Not batched:
  # 64 x 256^3 bf16 ran at 0.80x cuBLAS's batched kernel.
  if (dtype.itemsize == 2 and batch == 1 and 256 <= min(m, n, k) and max(m, n, k) <= 512
      and status["triton"] is None):
    return "triton"
  # An epilogue (beta * C, a bias, an activation) with 16-bit inputs: the mosaic kernel
  # applies it to its f32 accumulator before the single store (C through TMA), where XLA
  # writes the product and reads it back in a fusion (or a cuBLASLt bias epilogue).
  # beta * C: bf16 4096^3 1.10-1.18x, 8192^3 1.06-1.12x the jnp.dot expression (H100;
  # 1.086x at 4096^3 on the H200), 0.87x at 2048^3. Bias (+ GELU):
  # the MLP layer x(8192x4096) @ W1 + b1 1.13x (1.06x) jnp.dot + b1 (+ jax.nn.gelu),
  # CUPTI. Under a training step's grad it is a wash (wall clock 0.95-1.00x the jnp.dot
  # step across runs, kernel time 0.96x: XLA fuses the bias into cuBLASLt there too, and
  # the GELU passes around the op cost more than XLA's own; README "In a Flax model"),
  # and on XLA with an f32 product it was 0.94-0.95x. So from 4096 on.
  if (has_epilogue and dtype.itemsize == 2 and batch == 1 and min(m, n, k) >= 4096
      and status["mosaic"] is None):
    return "mosaic"
  # Small or skinny products are launch- or bandwidth-bound: cuBLAS's specialised kernels
  # win there (16x8192x8192 bf16: jnp.dot 59, mosaic 31, triton 37 TFLOP/s).
  if min(m, n) < 128 or m * n * k < 512**3:
    return "xla"
  misaligned = any(d * dtype.itemsize % 16 for d in leading_dims)
  ieee_f32 = dtype == np.float32 and precision == jax.lax.Precision.HIGHEST
  # IEEE f32 with a full wave of the cuda kernel's 128x128 tiles (2 blocks per SM) or
  # more and a long K: its stream-K tail evens out the part-full last wave that cuBLAS
  # leaves (H200: 3000^3 1.12x, 4097^3 1.07x, 4096^3 1.01x, 8192^3 1.02x);
  # below a wave or with a short K it lost (2048^3 0.98x, 2047x8191x1023 0.84x), and
  # its layout with both operands K-contiguous (transpose_b alone) runs 0.91x at 4096^3.
  # Not batched: unmeasured. (A backward pass reuses the forward's backend, so the
  # gradient a @ b^T of a cuda forward does run in that layout.)
  if (ieee_f32 and batch == 1 and k >= 2048 and (transpose_a or not transpose_b)
      and status["cuda"] is None and backend_module("cuda").full_wave(m, n)):
    return "cuda"
  # TF32 pays for a transposed copy of B besides the pads: at 997x1009x1013 that lost
  # (0.88x), from 2047x8191x1023 (1.5x) up it wins.
  small_tf32 = dtype == np.float32 and m * n * k * batch < 2**32
  if misaligned and dtype.itemsize == 2 and not MISALIGNED_16BIT_KERNEL:
    return "xla"
  if misaligned and not ieee_f32 and not small_tf32 and status["mosaic"] is None:
    return "mosaic"  # TMA + wgmma on padded copies; the IEEE-f32 case has no fast kernel
  return "xla"
