"""Block-scaled fp8 grouped GEMM on Hopper (sm_90) in Pallas Mosaic GPU: `scaled_ragged_dot`.

``ragged_gemm(lhs, rhs, group_sizes, lhs_scales, rhs_scales)`` computes, for the rows of
each group g (consecutive from row 0, `jax.lax.ragged_dot`'s layout; DeepGEMM's
"contiguous" one),

    out[rows of g] = (lhs[rows] * repeat(lhs_scales[rows])) @ (rhs[g] * repeat(rhs_scales[g])).T

with lhs (M, K) and rhs (G, N, K) fp8 (K-major), lhs_scales (M, K/128) (1x128 blocks, an
activation's) and rhs_scales (G, ceil(N/128), K/128) (each expert's 128x128 weight
blocks); rows past sum(group_sizes) are zeros.

It is the two kernels it is built from, joined:
  * the grouped work items (`mgpu.rows`, as the bf16 grouped forward): each group's rows cut
    into row tiles from its first row rounded down to a multiple of 8, an item one row
    tile of one group (or of the rows in no group), built on the device from the traced
    group sizes; each CTA walks (item, column tile) pairs; an item's epilogue stores only
    its own rows (`store_rows`), so no row of a neighbouring group is ever written;
  * the fp8 kernel's promoted K loop (`mgpu.scaled_k.promoted_loop`): per 128 of K the
    wgmma products go into a zeroed accumulator, multiplied by the row scales times the
    item's expert's block scale, and added into an f32 register sum. The step's lhs
    scales, a (block_m,) vector, ride in the ring stage (TMA from the scales transposed to
    (K/128, M)); the block scales are read from an L2-resident (G, K/128, N/128) array.
Rows outside every group run no K step: their accumulator stays zero.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.fp8 import mosaic_gemm as fp8_mosaic
from pallas_gemm.fp8.config import BLOCK_K, Config, check, pads_within, streams_weights
from pallas_gemm.mgpu import launch, ring, rows, scaled_k
from pallas_gemm.mgpu.layout import (pad_for_tma, pad_to, round_up, row_transforms,
                                     swizzle_transforms, tma_tile)

_PLAN = fp8_mosaic.Plan(lhs_step=True, rhs_step="block", epi_scalar=False, epi_rows=False,
                        epi_cols=False, promoted=True, rhs_shared=False)


def default_config(m: int, n: int, g: int, out_dtype) -> Config:
  """128 x 192 tiles (two 64-row warpgroup tiles: 96 + 96 accumulator registers, the
  f32 sum and the block accumulator; each warpgroup's 192 columns in three 64-wide pieces
  for the 128x128 weight blocks' scales), 4 stages: more MMA per promotion and per byte
  of shared memory than 128 x 128 (5 stages). On the H200 (CUPTI, routed group sizes,
  results bit for bit the same): 1.29x / 1.20x the 128 x 128 tiles at the Mixtral-like
  gate-up / down GEMMs, 1.12x / 1.05x at the Qwen3-like ones. Where 192-wide tiles would
  compute over 5% more columns than 128-wide ones (N = 200), 128 x 128.
  A group's last row tile is partly wasted work, so 128 rows, not the dense kernel's
  256. Decode-like calls (fewer than 64 rows a group on average: the kernel streams the
  experts' weights) take 64 x 128 tiles on one consumer warpgroup and an 8-deep ring: on
  the H200 at 1024 rows over 128 / 256 experts, 1.11-1.14x the 128 x 128 tiles (whose
  128-row lhs tiles are mostly other groups' rows), the same results bit for bit.
  Epilogue sub-tiles have 128-byte rows (`rows.check_row_stores`)."""
  epi_n = rows.row_columns(out_dtype)
  if streams_weights(m, g):
    return Config(block_m=64, block_n=128, stages=8, num_compute_wgs=1, epi_block_n=epi_n)
  if pads_within(n, 192):
    return Config(block_m=128, block_n=192, stages=4, epi_block_n=epi_n)
  return Config(block_m=128, block_n=128, stages=5, epi_block_n=epi_n)


def _epi_slots(config: Config) -> int:
  """Epilogue slots per warpgroup: 2 where every item's sub-tile count is even (the
  slot reuse across items that `rows.store_subtiles` relies on), else 1."""
  sub_tiles = ((config.wg_block_m // config.epi_block_m)
               * (config.wg_block_n // config.epi_block_n))
  return 2 if sub_tiles % 2 == 0 else 1


def _kernel(items_gmem, count_gmem, lhs_gmem, rhs_gmem, lhs_step_gmem, rhs_step_gmem,
            out_gmem, *, config: Config, k_iters: int, n: int, num_ctas: int):
  """One persistent CTA. lhs_gmem (M', K') fp8; rhs_gmem (G, N', K') fp8;
  lhs_step_gmem (K_b, M'') f32; rhs_step_gmem (G, K_b, N_b') f32; out_gmem (M, N'');
  items_gmem (4, T) and count_gmem (1,) from `rows.row_items`."""
  cfg = config
  bm, bn, bk = cfg.block_m, cfg.block_n, BLOCK_K
  wg_m, wg_n = cfg.wg_block_m, cfg.wg_block_n
  epi_m, epi_n = cfg.epi_block_m, cfg.epi_block_n
  num_wgs = cfg.num_compute_wgs
  n_tiles = pl.cdiv(n, bn)
  stages = min(cfg.stages, k_iters)
  epi_slots = _epi_slots(cfg)

  count = count_gmem[0]
  cta = lax.axis_index("sm")
  local_work = lax.div(count * n_tiles - cta + num_ctas - 1, num_ctas)

  def item(j):  # the CTA's j-th work item: (group, row0, lo, hi, column tile)
    t, ni = plgpu.planar_snake(cta + j * num_ctas, (count, n_tiles), 1, cfg.grid_tile_width)
    row0 = items_gmem[rows.ROW8, t] * rows.ROW_ALIGN
    return (items_gmem[rows.GROUP, t], row0, items_gmem[rows.LO, t],
            items_gmem[rows.HI, t], ni)

  def steps_of(group):  # rows outside every group run no K step
    return jnp.where(group >= 0, k_iters, 0)

  scoped = dict(
      lhs_smem=plgpu.SMEM((stages, bm, bk), lhs_gmem.dtype,
                          transforms=swizzle_transforms(bk, lhs_gmem.dtype)),
      rhs_smem=plgpu.SMEM((stages, bn, bk), rhs_gmem.dtype,
                          transforms=swizzle_transforms(bk, rhs_gmem.dtype)),
      lhs_scale_smem=plgpu.SMEM((stages, bm), jnp.float32),
      out_smem=plgpu.SMEM((num_wgs, epi_slots, epi_m, epi_n), out_gmem.dtype,
                          transforms=row_transforms(epi_n, out_gmem.dtype)),
      produced=plgpu.Barrier(num_arrivals=3, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=num_wgs, num_barriers=stages),
  )

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(lhs_smem, rhs_smem, lhs_scale_smem, out_smem, produced, consumed):
    wg = lax.axis_index("wg")

    @ring.producer_warp(wg, num_wgs)
    def _loads():
      def load_item(j, step):  # step: the CTA's K steps so far (ring position)
        group, row0, _, _, ni = item(j)
        rows, cols = pl.ds(row0, bm), pl.ds(ni * bn, bn)

        def load(kk, slot):
          ks = pl.ds(kk * bk, bk)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, ks], lhs_smem.at[slot], produced.at[slot])
          plgpu.copy_gmem_to_smem(rhs_gmem.at[group, cols, ks], rhs_smem.at[slot],
                                  produced.at[slot])
          plgpu.copy_gmem_to_smem(lhs_step_gmem.at[kk, rows], lhs_scale_smem.at[slot],
                                  produced.at[slot])

        @pl.when(group >= 0)  # rows in no group load nothing
        def _():
          ring.fill(consumed, 0, k_iters, step=lambda kk: step + kk, stages=stages,
                    load=load)

        return step + steps_of(group)

      ring.drain(consumed, lax.fori_loop(0, local_work, load_item, jnp.int32(0)),
                 stages=stages)

    @ring.consumer_warpgroups(wg, num_wgs)
    def _consumers():
      wg_m0 = wg * wg_m  # Config: the CTA tile is split among warpgroups along m
      wg_ms, wg_ns = pl.ds(wg_m0, wg_m), pl.ds(0, wg_n)

      def wgmma(acc_ref, slot):  # acc_ref += (wg_m, 128) @ (128, wg_n)
        plgpu.wgmma(acc_ref, lhs_smem.at[slot, wg_ms], rhs_smem.at[slot].T)

      def mma_item(j, step):
        group, row0, lo, hi, ni = item(j)
        steps = steps_of(group)
        acc = scaled_k.promoted_loop(
            wgmma, step, group, ni * bn, wg_ms, wg_ns, stages, produced, consumed,
            lhs_scale_smem, None, rhs_step_gmem, plan=_PLAN, wg_m=wg_m, wg_n=wg_n,
            k_iters=steps)
        rows.store_subtiles(acc, out_smem, wg, lambda slot_smem, i, jj: rows.store_rows(
            slot_smem, out_gmem, row0=row0 + wg_m0 + i * epi_m, col0=ni * bn + jj * epi_n,
            lo=lo, hi=hi))
        return step + steps

      lax.fori_loop(0, local_work, mma_item, jnp.int32(0))

  del _scope  # run_scoped ran it
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def ragged_gemm(lhs, rhs, group_sizes, lhs_scales, rhs_scales, *, out_dtype=jnp.bfloat16,
                config: Config | None = None, interpret=False):
  """(M, N) out_dtype (module docstring). lhs (M, K) and rhs (G, N, K) fp8 with K a
  multiple of 128; lhs_scales (M, K/128), rhs_scales (G, ceil(N/128), K/128) float32;
  group_sizes (G,) int, traced. Validation is the caller's (`fp8.ragged`)."""
  m, k = lhs.shape
  g, n, _ = rhs.shape
  out_dtype = jnp.dtype(out_dtype)
  if config is None:
    config = default_config(m, n, g, out_dtype)
  if config.wg_split != "m" or config.cluster_size != 1 or (128 % config.block_n
                                                             and config.block_n % 64):
    # A column tile lies in one 128-column weight block (block_n dividing 128) or is cut
    # into 64-wide pieces that each do (`scaled_k.block_pieces`: 128 x 192 tiles).
    raise ValueError(f"config: the grouped kernel takes tiles split among warpgroups along"
                     f" m (wg_split='m'), no clusters, and block_n dividing 128 or a"
                     f" multiple of 64; got {config}")
  check(config, out_dtype, k=k, promoted=True, row_scales=True)
  rows.check_row_stores(config.epi_block_n, out_dtype, "scaled_ragged_dot")
  if m == 0 or n == 0 or k == 0 or g == 0:
    return jnp.zeros((m, n), out_dtype)
  bm, bn = config.block_m, config.block_n
  k_iters = k // BLOCK_K

  starts, ends = rows.local_rows(group_sizes, None, g, m)
  items, count = rows.row_items(starts, ends, m, bm)
  tile = tma_tile(BLOCK_K, lhs.dtype)  # (8, 128) for fp8
  lhs, rhs = pad_for_tma(lhs, tile, BLOCK_K), pad_for_tma(rhs, tile, BLOCK_K)
  # Every item's (block_m,) scale box lies inside: rows up to the last row tile's end.
  lhs_step = pad_to(lhs_scales.T, round_up(m, 8) + bm)
  # (G, K_b, N_b'): every column tile's 128-column blocks lie inside.
  rhs_step = pad_to(jnp.swapaxes(rhs_scales, 1, 2), round_up(n, bn) // 128 + 1)
  n_out = max(round_up(n, tma_tile(config.epi_block_n, out_dtype)[1]), bn)
  ctas = launch.grid_sms(config.num_sms, interpret, need_gpu=True)
  body = functools.partial(_kernel, config=config, k_iters=k_iters, n=n, num_ctas=ctas)
  kernel = launch.warpgroup_kernel(
      body, out_type=jax.ShapeDtypeStruct((m, n_out), out_dtype), num_ctas=ctas,
      num_compute_wgs=config.num_compute_wgs, kernel_name="pallas_gemm_scaled_ragged_fp8")
  out = launch.call(kernel, items, count, lhs, rhs, lhs_step, rhs_step, interpret=interpret)
  return out if n_out == n else out[:, :n]
