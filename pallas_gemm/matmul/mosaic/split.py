"""float32 GEMMs from 16-bit pieces on the Mosaic kernel (`precision.Split`).

bf16 pieces (``precision="float32_accurate"`` and the BF16_BF16_F32_X* presets): one XLA
fusion writes both operands' bf16 pieces before the kernel (1.5x the f32 bytes for 3
pieces), separate arrays in the operand's stored layout, passed as separate kernel
operands; every pipeline stage loads all piece tiles by TMA, and each K block's piece
products go into a zeroed accumulator that is added to an f32 register sum (`k_loop`).
An MN-major operand's piece tiles take the K-major tile's 64-byte swizzle (wgmma wants
one swizzle on both operands), so no operand is transposed. Making the pieces inside the
kernel from f32 tiles saves the HBM pass, but the split, its shared-memory stores and the
wait before the products held such a kernel at 1.35x SGEMM (H100); pieces stacked in one
K-major array cost XLA a transposed copy and a second pass (20-25% of a call at 4096^3),
where separate arrays in the stored layout take one pass for both operands (0.083 ms of
a 1.106 ms call at 4096^3, H200). The six bf16 products run at cuBLAS's bf16 rate at
8192^3: 2.1-2.2x SGEMM.

float16 pieces (``precision="float32_f16x3"``, `scale_operands` / `unscale`): A's rows
and B's columns are scaled by powers of two into float16's range, the same kernel runs
two float16 pieces per operand and three products, and the f32 result is scaled back,
after which the epilogue runs in XLA: 3.5x / 3.8x / 2.9x SGEMM at 4096^3 / 8192^3 /
4097^3 on the H200 (docs/performance.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.core import precision as _precision
from pallas_gemm.core.epilogue import activate, apply


def k_loop(a_smem, b_smem, consumed, *, split: _precision.Split, mma, ready, k0, k1,
           first, stages: int, shape: tuple[int, int]):
  """A consumer warpgroup's K blocks [k0, k1) of one tile from the ring's piece tiles:
  returns its (shape) f32 sum.

  a_smem, b_smem: the ring, (stages, split.pieces, ...) piece tiles; consumed: the ring's
  release barriers. mma(acc_ref, a_tile, b_tile): the warpgroup's wgmma of its part of
  the tile; ready(slot): the barrier of a slot's loads; first: the ring step of K block
  k0. Each K block's piece products (smallest first) go into a zeroed accumulator, which
  is then added to the running f32 sum, carried in registers, with IEEE adds: the tensor
  core's truncating accumulation never runs longer than one K block.
  """
  def _k(kk, total):
    step = first + kk - k0
    slot = lax.rem(step, stages)
    plgpu.barrier_wait(ready(slot))

    def block_sum(blk_ref):
      for i, j in split.products:
        mma(blk_ref, a_smem.at[slot, i], b_smem.at[slot, j])
      return blk_ref[...]  # waits for the products

    total = total + pl.run_scoped(block_sum, plgpu.ACC(total.shape, jnp.float32))
    plgpu.barrier_arrive(consumed.at[slot])
    return total

  return lax.fori_loop(k0, k1, _k, jnp.zeros(shape, jnp.float32))


def scale_operands(a, b, *, transpose_a: bool, transpose_b: bool):
  """(a * 2^ka, b * 2^kb, ka, kb): A's rows and B's columns scaled by powers of two into
  float16's range (`precision.scale_exponents`); exact (ldexp)."""
  ka = _precision.scale_exponents(a, 1 if transpose_a else 2)  # per row of op(a)
  kb = _precision.scale_exponents(b, 2 if transpose_b else 1)  # per column of op(b)
  return jnp.ldexp(a, ka), jnp.ldexp(b, kb), ka, kb


def unscale(product, ka, kb, c, bias, *, transpose_a: bool, transpose_b: bool, alpha,
            beta, activation, c_gate, keep_pre: bool, out_dtype):
  """The epilogue of a scaled split, in XLA (it must follow the unscaling; one pass over
  the output): the kernel's f32 product of the scaled operands scaled back (exact), then
  alpha, C, bias and activation as `gemm` defines them."""
  rows = jnp.swapaxes(ka, 1, 2) if transpose_a else ka  # (batch, M, 1)
  cols = jnp.swapaxes(kb, 1, 2) if transpose_b else kb  # (batch_b, 1, N)
  z = jnp.ldexp(product, -(rows + cols))
  if alpha != 1.0:
    z = z * jnp.float32(alpha)
  if keep_pre:
    z = apply(z, c, bias, beta=beta, activation=None, out_dtype=jnp.float32)
    return activate(z, activation).astype(out_dtype), z.astype(out_dtype)
  return apply(z, c, bias, beta=beta, activation=activation, out_dtype=out_dtype,
               c_gate=c_gate)
