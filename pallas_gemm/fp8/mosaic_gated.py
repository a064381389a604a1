"""The first grouped GEMM of a gated fp8 expert MLP with its activation and the
quantization of its output, as one kernel on Hopper (sm_90) in Pallas Mosaic GPU.

    a8, a_scales = gated_ragged_gemm(lhs8, rhs8, group_sizes, lhs_scales, rhs_scales,
                                     activation="silu")

lhs8 (M, K) fp8 with 1x128 scales (M, K/128); rhs8 (G, 2F, K) fp8, K-major, each group's
[gate | up] rows, with 128x128 block scales (G, 2F/128, K/128) (`quantize_experts`). Per
group g, with h = dequantized lhs[rows of g] @ dequantized rhs[g].T in f32,

    a = act(h[:, :F]) * h[:, F:]           (f32, never written)
    a8, a_scales = quantize(a, dtype)      (1x128 blocks along F: the next GEMM's lhs)

bitwise `quantize`'s arithmetic on the kernel's f32 a; rows in no group get a = 0.
The unfused form writes h (M, 2F) in bf16, reads it for the activation, writes a, and
reads a again to quantize it: three passes over R x 2F that this kernel does not make,
and a is quantized from f32 rather than from bf16-rounded h.

Design: `mosaic_ragged`'s grouped work items and promoted K loop, with
  * an item = one row tile (block_m = 128, a warpgroup per 64 rows; 64 rows on one at
    decode: `tiles`) of one group, times
    one 128-column block of F (a block of a's scales). Its two 64-column halves run one
    after the other, each a block_m x 128 tile of h as `mosaic_ragged`'s: 64 gate columns
    and the 64 up columns F further on, side by side in shared memory, so one wgmma of
    N = 128 per step (two wgmmas of N = 64 read the lhs tile twice from shared memory:
    with them the layer ran 1.2x slower than with three passes at Mixtral-like sizes). A warpgroup
    holds its (64, 128) block accumulator and f32 sum (128 registers), and the first
    half's a (32 more) waits in registers for the second: a row's amax over its 128
    columns is in registers when the block is quantized. The item's K steps are those
    of `mosaic_ragged`'s two column tiles;
  * the values stored with `rows.store_rows` (only the item's rows of its group); the
    scales, 4 bytes a row, below TMA's 16-byte boxes, go to a per-item array (F/128, T,
    block_m) that one gather along its rows turns into (M, F/128) after the kernel
    (each row's F/128 scales read with a stride: 5% of the kernel's time at
    Mixtral-like sizes; along rows, reads are contiguous and the second GEMM, which
    takes its row scales transposed, reads the gather's result as it is).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.core import epilogue
from pallas_gemm.fp8 import mosaic_gemm as fp8_mosaic
from pallas_gemm.fp8.config import BLOCK_K, streams_weights
from pallas_gemm.fp8.mosaic_quantize import row_scales
from pallas_gemm.fp8.scales import pow2
from pallas_gemm.mgpu import launch, ring, rows, scaled_k
from pallas_gemm.mgpu.layout import (pad_for_tma, pad_to, round_up, row_transforms,
                                     swizzle_transforms, tma_tile)

BLOCK = 128  # a's scale block along F, and an item's columns
WG_M = 64  # an item's rows per consumer warpgroup
HALF = 64  # the columns of a's block each K loop computes
OUT_SLOTS = 2  # output slots per consumer warpgroup
GRID_TILE_WIDTH = 8  # items in bands of 8 column blocks (`plgpu.planar_snake`), as the
# grouped kernels order theirs: CTAs running together share lhs and weight tiles in L2


def tiles(m: int, g: int) -> tuple[int, int]:
  """(block_m, stages): an item's rows (WG_M per consumer warpgroup) and the ring's depth.
  128 rows on two warpgroups, 5 stages of 32.5 KiB beside 2 x 2 x 8 KiB of output slots
  (4: 5% slower at Mixtral-like sizes, the same at Qwen3-like ones). Decode-like calls
  (`fp8.config.streams_weights`) take 64 rows on one warpgroup and 8 stages, as
  `mosaic_ragged.default_config` does."""
  if streams_weights(m, g):
    return 64, 8
  return 128, 5


_PLAN = fp8_mosaic.Plan(lhs_step=True, rhs_step="block", epi_scalar=False, epi_rows=False,
                        epi_cols=False, promoted=True, rhs_shared=False)


def _kernel(items_gmem, count_gmem, lhs_gmem, rhs_gmem, lhs_step_gmem, rhs_step_gmem,
            values_gmem, scales_gmem, *, k_iters: int, f: int, num_ctas: int,
            activation: str, block_m: int, stages: int):
  """One persistent CTA. lhs_gmem (M', K) fp8; rhs_gmem (G, 2F, K) fp8; lhs_step_gmem
  (K/128, M'') f32; rhs_step_gmem (G, K/128, 2F/128) f32; values_gmem (M, F) fp8;
  scales_gmem (F/128, T, block_m) f32; items_gmem (4, T), count_gmem (1,) (`rows`)."""
  dtype = values_gmem.dtype
  wg_m, num_wgs = WG_M, block_m // WG_M
  f_blocks = f // BLOCK
  stages = min(stages, 2 * k_iters)

  count = count_gmem[0]
  cta = lax.axis_index("sm")
  local_work = lax.div(count * f_blocks - cta + num_ctas - 1, num_ctas)

  def item(j):  # the CTA's j-th item: (item index, group, row0, lo, hi, column block)
    t, c = plgpu.planar_snake(cta + j * num_ctas, (count, f_blocks), 1, GRID_TILE_WIDTH)
    row0 = items_gmem[rows.ROW8, t] * rows.ROW_ALIGN
    return (t, items_gmem[rows.GROUP, t], row0, items_gmem[rows.LO, t],
            items_gmem[rows.HI, t], c)

  def steps_of(group):  # per half; rows outside every group run no K step
    return jnp.where(group >= 0, k_iters, 0)

  scoped = dict(
      lhs_smem=plgpu.SMEM((stages, block_m, BLOCK_K), lhs_gmem.dtype,
                          transforms=swizzle_transforms(BLOCK_K, lhs_gmem.dtype)),
      rhs_smem=plgpu.SMEM((stages, 2 * HALF, BLOCK_K), rhs_gmem.dtype,
                          transforms=swizzle_transforms(BLOCK_K, rhs_gmem.dtype)),
      lhs_scale_smem=plgpu.SMEM((stages, block_m), jnp.float32),
      values_smem=plgpu.SMEM((num_wgs, OUT_SLOTS, wg_m, BLOCK), dtype,
                             transforms=row_transforms(BLOCK, dtype)),
      scales_smem=plgpu.SMEM((num_wgs, OUT_SLOTS, wg_m), jnp.float32),
      produced=plgpu.Barrier(num_arrivals=4, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=num_wgs, num_barriers=stages),
  )

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(lhs_smem, rhs_smem, lhs_scale_smem, values_smem, scales_smem, produced,
             consumed):
    wg = lax.axis_index("wg")

    @ring.producer_warp(wg, num_wgs)
    def _loads():
      def load_item(j, step):  # step: the CTA's K steps so far (ring position)
        _, group, row0, _, _, c = item(j)
        row_tile = pl.ds(row0, block_m)

        for half in range(2):
          col = c * BLOCK + half * HALF

          def load(kk, slot, col=col):
            ks = pl.ds(kk * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(lhs_gmem.at[row_tile, ks], lhs_smem.at[slot],
                                    produced.at[slot])
            for part, first in enumerate((col, f + col)):  # the gate's, the up's rows
              plgpu.copy_gmem_to_smem(rhs_gmem.at[group, pl.ds(first, HALF), ks],
                                      rhs_smem.at[slot, pl.ds(part * HALF, HALF)],
                                      produced.at[slot])
            plgpu.copy_gmem_to_smem(lhs_step_gmem.at[kk, row_tile], lhs_scale_smem.at[slot],
                                    produced.at[slot])

          @pl.when(group >= 0)  # rows in no group load nothing
          def _(load=load, half=half):
            ring.fill(consumed, 0, k_iters, step=lambda kk: step + half * k_iters + kk,
                      stages=stages, load=load)

        return step + 2 * steps_of(group)

      ring.drain(consumed, lax.fori_loop(0, local_work, load_item, jnp.int32(0)),
                 stages=stages)

    @ring.consumer_warpgroups(wg, num_wgs)
    def _consumers():
      wg_ms = pl.ds(wg * wg_m, wg_m)

      def wgmma(acc_ref, slot):  # [gate | up] += (wg_m, 128) @ (128, 2 * HALF)
        plgpu.wgmma(acc_ref, lhs_smem.at[slot, wg_ms], rhs_smem.at[slot].T)

      def mma_item(j, step):
        t, group, row0, lo, hi, c = item(j)
        steps = steps_of(group)
        halves = []
        for half in range(2):
          col = c * BLOCK + half * HALF
          h = scaled_k.promoted_loop(
              wgmma, step + half * steps, group, (col, f + col), wg_ms, pl.ds(0, 2 * HALF),
              stages, produced, consumed, lhs_scale_smem, None, rhs_step_gmem, plan=_PLAN,
              wg_m=wg_m, wg_n=2 * HALF, k_iters=steps)
          halves.append(epilogue.activate(h[:, :HALF], activation) * h[:, HALF:])
        e, q = row_scales(jnp.concatenate(halves, axis=1), dtype, whole_tile=False)
        out = lax.rem(j, OUT_SLOTS)
        # The item OUT_SLOTS earlier stored from this slot: one bulk group per item.
        plgpu.wait_smem_to_gmem(OUT_SLOTS - 1, wait_read_only=True)
        values_smem[wg, out] = q.astype(dtype)
        scales_smem[wg, out] = pow2(e)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(scales_smem.at[wg, out],
                                scales_gmem.at[c, t, pl.ds(wg * wg_m, wg_m)],
                                commit_group=False)
        rows.store_rows(values_smem.at[wg, out], values_gmem, row0=row0 + wg * wg_m,
                        col0=c * BLOCK, lo=lo, hi=hi)  # commits the item's group
        return step + 2 * steps

      lax.fori_loop(0, local_work, mma_item, jnp.int32(0))

  del _scope  # run_scoped ran it
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gated_ragged_gemm(lhs, rhs, group_sizes, lhs_scales, rhs_scales, *, activation: str,
                      dtype=jnp.float8_e4m3fn, num_sms: int | None = None,
                      interpret=False):
  """(a values (M, F) dtype, a scales (M, F/128) f32) (module docstring). lhs (M, K) and
  rhs (G, 2F, K) fp8, K and F multiples of 128; lhs_scales (M, K/128), rhs_scales (G,
  2F/128, K/128) f32; group_sizes (G,) int32 >= 0, traced. Validation is the caller's
  (`fp8.gated`)."""
  m, k = lhs.shape
  g, two_f, _ = rhs.shape
  f = two_f // 2
  dtype = jnp.dtype(dtype)
  if min(m, k, f, g) == 0:  # no item, or no K step (a ring of no stages)
    raise ValueError(f"gated_ragged_gemm takes no empty dimension: lhs {lhs.shape}, rhs"
                     f" {rhs.shape} (`fp8.gated` computes those without the kernel)")
  k_iters = k // BLOCK_K
  block_m, stages = tiles(m, g)
  starts, ends = rows.local_rows(group_sizes, None, g, m)
  items, count = rows.row_items(starts, ends, m, block_m)
  lhs = pad_for_tma(lhs, tma_tile(BLOCK_K, lhs.dtype), BLOCK_K)
  # Every item's (block_m,) scale box lies inside: rows up to the last row tile's end.
  lhs_step = pad_to(lhs_scales.T, round_up(m, 8) + block_m)
  rhs_step = jnp.swapaxes(rhs_scales, 1, 2)  # (G, K/128, 2F/128)
  ctas = launch.grid_sms(num_sms, interpret, need_gpu=True)
  body = functools.partial(_kernel, k_iters=k_iters, f=f, num_ctas=ctas,
                           activation=activation, block_m=block_m, stages=stages)
  kernel = launch.warpgroup_kernel(
      body, out_type=(jax.ShapeDtypeStruct((m, f), dtype),
                      jax.ShapeDtypeStruct((f // BLOCK, items.shape[1], block_m),
                                           jnp.float32)),
      num_ctas=ctas, num_compute_wgs=block_m // WG_M,
      kernel_name="pallas_gemm_scaled_gated_fp8")
  values, item_scales = launch.call(kernel, items, count, lhs, rhs, lhs_step, rhs_step,
                                    interpret=interpret)
  return values, _row_scales_of_items(item_scales, items, count, m)


def _row_scales_of_items(item_scales, items, count, m: int):
  """(M, F/128): row r's scales from the one item whose rows [lo, hi) hold it, of the
  kernel's (F/128, T, block_m). Items are in row order and tile [0, M) without gaps
  from row 0, so r's item is the number of items whose first row lo is at or before r,
  less one: a scatter of T ones and a cumulative sum (a binary search,
  `jnp.searchsorted`'s default, is a while loop whose every step waits for the host)."""
  t = jnp.arange(items.shape[1], dtype=jnp.int32)
  first = jnp.where(t < count[0], items[rows.LO], jnp.int32(m))  # past the count: dropped
  starts = jnp.zeros((m,), jnp.int32).at[first].add(1, mode="drop")
  owner = jnp.cumsum(starts) - 1
  row = jnp.arange(m, dtype=jnp.int32)
  f_blocks, num_items, block_m = item_scales.shape
  column = owner * block_m + row - items[rows.ROW8, owner] * rows.ROW_ALIGN
  return item_scales.reshape(f_blocks, num_items * block_m)[:, column].T
