"""Scaled fp8 GEMM on Hopper (sm_90) in Pallas Mosaic GPU.

``scaled_gemm(lhs, rhs, lhs_scales, rhs_scales)`` computes, per batch entry b,
``out[b] = (lhs[b] * repeat(lhs_scales[b])) @ (rhs[b] * repeat(rhs_scales[b])).T``
with lhs (B, M, K) and rhs (B, N, K) in float8_e4m3fn / float8_e5m2 (mixed allowed), f32
scales, and a bf16 / f16 / f32 result. The scale layouts it reads (K_b = ceil(K / 128)):

  lhs_scales  (B, M, K_b)    1x128 blocks: one scale per row and 128 of K
              (B, M, 1)      per row
              (B, 1, 1)      per tensor
  rhs_scales  (B, N, K_b)    one per column of the output and 128 of K
              (B, ceil(N/128), K_b)  128x128 blocks (DeepSeek-V3's weights)
              (B, N, 1)      per column of the output
              (B, 1, 1)      per tensor
  rhs and rhs_scales may also have a batch of 1, shared by every lhs entry.

Design (one CTA per SM, persistent; a reader's walk through `_kernel`):
  * Tiles: each CTA walks the flattened (batch, m tiles, n tiles) space strided by the
    CTA count, in ``plgpu.planar_snake`` bands. A CTA tile is block_m x block_n, split
    among ``num_compute_wgs`` consumer warpgroups (one wgmma accumulator each).
    Optionally CTAs pair up in clusters of 2 that compute adjacent tiles and multicast
    the operand tile they share (``Config.cluster_m`` / ``cluster_n``).
  * Operands: fp8 wgmma reads both operands K-major from shared memory (only 16-bit
    operands may be transposed), so lhs is (M, K) and rhs (N, K), and each stage of a
    ``stages``-deep ring holds a (block_m, 128) lhs tile and a (block_n, 128) rhs tile,
    128-byte swizzled, loaded by TMA. One warp of a producer warpgroup issues the loads
    of every (tile, K step) of the CTA in one loop (`mgpu.ring`), so the next tile's
    loads start while the consumers still run the previous tile's epilogue.
  * Block scales (promoted K loop): one K step is one 128-wide scale block. Its wgmma
    products go into a zeroed accumulator; the step's scale (lhs row scale x rhs column
    or block scale) multiplies it and it is added into an f32 register sum: one
    multiply-add per accumulator element and step, and the tensor core's accumulation
    (~14 mantissa bits kept in fp8 wgmma) never runs longer than 128 products. The
    lhs scales of a step, a (block_m,) vector, and per-column rhs scales, a (block_n,)
    vector, ride in the same ring stage (TMA from scale arrays transposed to
    (B, K_b, M) / (B, K_b, N)). A 128x128 rhs block scale is one number per step for
    each column piece of the warpgroup tile lying in one 128-column block (the whole
    tile when its width divides 128; `mgpu.scaled_k.block_pieces`), read from global memory (an
    L2-resident (B, K_b, ceil(N/128)) array) while the wgmma runs and folded into the
    row scales, so block scales too cost one multiply-add per element. Each warpgroup
    waits for its products before promoting them.
  * Scales constant along K (per tensor, row or column): applied once in the epilogue.
    By default the K loop still promotes every 128 of K as above, for the same error
    bound as block scales (f32-result errors on the H100, per tensor: 1.3e-4 promoted
    vs 1.3e-3 at 4096^3 and 2.0e-3 at 8192^3 with fast accumulation).
    ``Config.fast_accumulation=True`` (opt-in, faster: no promotion per step) makes it one
    wgmma chain into one accumulator (the bf16 kernel's loop, wgmma_wait=1 overlaps
    consecutive steps): Hopper's fp8 wgmma accumulation keeps ~14 mantissa bits of a
    running sum that then spans all of K.
  * Epilogue (consumer warpgroups): the sum times the epilogue scales, cast to the
    out dtype, written to a double-buffered shared-memory slot and stored by TMA in
    (epi_block_m, epi_block_n) sub-tiles.

Shapes and edges:
  * Any M, N, K. TMA zero-fills out-of-bounds parts of a tile and clips stores, but
    Mosaic GPU describes a swizzled TMA through a tiled view of the whole array that
    the tiling must divide. K must be a multiple of 128: others are zero-padded
    (`pad_for_tma`, one copy; zero K columns add exact zeros, and a partial last scale
    block then scales real and zero products alike). Rows need not be a multiple of
    8: an operand whose rows are not is loaded, and such an output stored, through a
    view tiled by single rows (`layout.row_transforms`: the same shared-memory bytes),
    with no copy; the wgmma reads the operand through the (8, 128) view of the same
    buffer (`_operand_smem`). An output row of N elements that is not 16-byte aligned
    (TMA's global strides) is computed into a wider buffer and sliced (`unpad`).
    The Pallas interpreter keeps the two views apart, so there rows are padded.
  * NaN / Inf in an operand reach the products and propagate as in the float64
    product of the dequantized operands (up to 0 * inf, which both make NaN).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.mgpu import launch, ring, scaled_k
from pallas_gemm.mgpu.layout import (pad_for_tma, pad_to, round_up, row_transforms,
                                        swizzle_transforms, tma_padded_shape, tma_tile,
                                        tma_view_tile)
from pallas_gemm.mgpu.unpad import unpad
from pallas_gemm.fp8.config import BLOCK_K, Config, check, default_config

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------
# Scale layouts
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """How the kernel applies the scales (static; derived from their shapes).

  lhs_step: lhs scales per 128 of K, a (block_m,) row vector per step.
  rhs_step: None, "column" (a (block_n,) vector per step) or "block" (one number per
    warpgroup, or 64-column piece of it, and step, from a (B, K_b, ceil(N/128)) array
    in global memory).
  epi_scalar / epi_rows / epi_cols: the epilogue multiplies by a (B,) scalar, a
    (B, M) row vector and / or a (B, N) column vector.
  promoted: the K loop promotes each 128 of K into the f32 register sum.
  rhs_shared: rhs (and its step scales) have a batch of 1, shared by every lhs entry.
  lhs_by_row / rhs_by_row: that array's rows are not a multiple of 8 and TMA moves its
    tiles through the single-row view (module docstring, "Shapes"); the output's rows
    are lhs's, and move as lhs's do.
  """

  lhs_step: bool
  rhs_step: str | None
  epi_scalar: bool
  epi_rows: bool
  epi_cols: bool
  promoted: bool
  rhs_shared: bool
  lhs_by_row: bool = False
  rhs_by_row: bool = False


def _classify(name: str, scales, batch: int, rows: int, k_blocks: int,
              block_rows: int | None) -> str:
  """The layout of one operand's scales: "tensor", "row" (per row, constant along K),
  "step" (per row and 128 of K) or "block" (per 128 rows and 128 of K, rhs only)."""
  shape = tuple(scales.shape)
  if jnp.dtype(scales.dtype) != jnp.float32:
    raise TypeError(f"{name}.dtype={scales.dtype}: scales must be float32")
  accepted = [(batch, 1, 1), (batch, rows, 1), (batch, rows, k_blocks)]
  if block_rows is not None:
    accepted.append((batch, block_rows, k_blocks))
  if len(shape) != 3 or shape not in accepted:
    raise ValueError(f"{name}.shape={shape}: expected one of {sorted(set(accepted))}"
                     f" (K_b = ceil(K / {BLOCK_K}) = {k_blocks} blocks of 128 along K"
                     + (", 128x128 blocks along N" if block_rows is not None else "") + ")")
  if shape == (batch, 1, 1):
    return "tensor"
  if shape[2] == 1 and shape[1] == rows:  # (also K_b == 1: one block is the whole K)
    return "row"
  if shape[1] == rows:
    return "step"
  return "block"


def _step_scales(lhs_kind: str, rhs_kind: str) -> bool:
  """Whether the scales vary along K (`_classify`'s "step" or "block")."""
  return lhs_kind == "step" or rhs_kind in ("step", "block")


def default_config_for(m: int, n: int, k: int, out_dtype, lhs_kind: str,
                       rhs_kind: str) -> Config:
  """The Config `scaled_gemm` runs when given none, for the scale layouts `_classify`
  names: promoted, with the tiles `default_config` picks for those layouts."""
  return default_config(m, n, k, out_dtype=out_dtype, promoted=True,
                        step_scales=_step_scales(lhs_kind, rhs_kind),
                        column_scales=rhs_kind == "step")


# ----------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------


def _kernel(lhs_gmem, rhs_gmem, *refs, config: Config, plan: Plan, m: int, n: int,
            k_iters: int, batch: int, num_ctas: int):
  """One persistent CTA of num_ctas.

  lhs_gmem: (B, M, K) fp8; rhs_gmem: (B or 1, N, K) fp8 (K a multiple of 128).
  refs, in order, those the plan uses, then the output:
    lhs_step_gmem (B, K_b, M') f32, rhs_step_gmem (B or 1, K_b, N') f32 ("column") or
    (B or 1, K_b, N_b') ("block"), epi_scalar_gmem (B,), epi_rows_gmem (B, M'),
    epi_cols_gmem (B, N'), out_gmem (B, M_out, N_out); primed sizes cover every tile.
  """
  cfg = config
  refs = list(refs)
  lhs_step_gmem = refs.pop(0) if plan.lhs_step else None
  rhs_step_gmem = refs.pop(0) if plan.rhs_step else None
  epi_scalar_gmem = refs.pop(0) if plan.epi_scalar else None
  epi_rows_gmem = refs.pop(0) if plan.epi_rows else None
  epi_cols_gmem = refs.pop(0) if plan.epi_cols else None
  (out_gmem,) = refs
  out_dtype = out_gmem.dtype
  bm, bn, bk = cfg.block_m, cfg.block_n, BLOCK_K
  wg_m, wg_n = cfg.wg_block_m, cfg.wg_block_n
  epi_m, epi_n = cfg.epi_block_m, cfg.epi_block_n
  num_wgs = cfg.num_compute_wgs
  # The tile loop walks clusters of (cluster_m x cluster_n) adjacent CTA tiles. With an
  # odd tile count the last cluster's second CTA gets a tile past the edge: its TMA
  # loads read zeros (it still takes part in the multicast) and its stores are clipped.
  m_iters = pl.cdiv(pl.cdiv(m, bm), cfg.cluster_m)
  n_iters = pl.cdiv(pl.cdiv(n, bn), cfg.cluster_n)
  per_batch = m_iters * n_iters
  # A ring deeper than K is never filled.
  stages = min(cfg.stages, k_iters)
  # The plain loop keeps one wgmma in flight across steps, so a stage is released one
  # step late; with a single step there is nothing to overlap.
  wgmma_wait = cfg.wgmma_wait if (k_iters > cfg.wgmma_wait and not plan.promoted) else 0
  column_step = plan.rhs_step == "column"

  out_transforms = (row_transforms if plan.lhs_by_row else swizzle_transforms)(epi_n,
                                                                             out_dtype)
  loads = 2 + plan.lhs_step + column_step  # TMA copies per step
  lhs_multicast = ("cluster",) if cfg.cluster_n > 1 else None
  rhs_multicast = ("cluster",) if cfg.cluster_m > 1 else None
  if cfg.cluster_size > 1:
    # Loads into both CTAs of a cluster: a stage is free once both CTAs released it.
    consumed = plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=num_wgs,
                                    num_barriers=stages)
  else:
    consumed = plgpu.Barrier(num_arrivals=num_wgs, num_barriers=stages)
  scoped = dict(
      lhs_smem=_operand_smem((stages, bm, bk), lhs_gmem.dtype, plan.lhs_by_row),
      rhs_smem=_operand_smem((stages, bn, bk), rhs_gmem.dtype, plan.rhs_by_row),
      produced=plgpu.Barrier(num_arrivals=loads, num_barriers=stages),
      consumed=consumed,
      out_smem=plgpu.SMEM((num_wgs, cfg.out_slots, epi_m, epi_n), out_dtype,
                          transforms=out_transforms),
  )
  if plan.lhs_step:
    scoped["lhs_scale_smem"] = plgpu.SMEM((stages, bm), jnp.float32)
  if column_step:
    scoped["rhs_scale_smem"] = plgpu.SMEM((stages, bn), jnp.float32)

  cta = lax.axis_index("sm")  # the CTA, or the cluster: both CTAs run the same tiles
  local_tiles = lax.div(batch * per_batch - cta + num_ctas - 1, num_ctas)

  def coords(j):  # the CTA's j-th tile -> (batch entry, m tile, n tile)
    g = cta + j * num_ctas
    bi, lin = lax.div(g, per_batch), lax.rem(g, per_batch)
    mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters),
                                0 if cfg.grid_minor_dim == "m" else 1, cfg.grid_tile_width)
    if cfg.cluster_size > 1:  # this CTA's tile of the cluster tile
      rank = lax.axis_index("cluster")
      mi, ni = mi * cfg.cluster_m, ni * cfg.cluster_n
      mi, ni = (mi + rank, ni) if cfg.cluster_m > 1 else (mi, ni + rank)
    return bi, mi, ni

  def wg_origin(wg):  # this warpgroup's part of the CTA tile, in CTA-tile coordinates
    return (wg * wg_m, 0) if cfg.wg_split == "m" else (0, wg * wg_n)

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(lhs_smem, rhs_smem, produced, consumed, out_smem, lhs_scale_smem=None,
             rhs_scale_smem=None):
    wg = lax.axis_index("wg")
    # (the wgmma's view, TMA's view) of each operand's ring
    lhs_smem, lhs_load = lhs_smem if plan.lhs_by_row else (lhs_smem, lhs_smem)
    rhs_smem, rhs_load = rhs_smem if plan.rhs_by_row else (rhs_smem, rhs_smem)

    @ring.producer_warp(wg, num_wgs)
    def _loads():
      @pl.loop(0, local_tiles)
      def _tile(j):
        bi, mi, ni = coords(j)
        bb = 0 if plan.rhs_shared else bi
        ms, ns = pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)

        def load(kk, slot):
          ks = pl.ds(kk * bk, bk)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[bi, ms, ks], lhs_load.at[slot],
                                  produced.at[slot], collective_axes=lhs_multicast)
          plgpu.copy_gmem_to_smem(rhs_gmem.at[bb, ns, ks], rhs_load.at[slot],
                                  produced.at[slot], collective_axes=rhs_multicast)
          if plan.lhs_step:
            plgpu.copy_gmem_to_smem(lhs_step_gmem.at[bi, kk, ms],
                                    lhs_scale_smem.at[slot], produced.at[slot])
          if column_step:
            plgpu.copy_gmem_to_smem(rhs_step_gmem.at[bb, kk, ns],
                                    rhs_scale_smem.at[slot], produced.at[slot])

        ring.fill(consumed, 0, k_iters, step=lambda kk: j * k_iters + kk, stages=stages,
                  load=load)

      ring.drain(consumed, local_tiles * k_iters, stages=stages)

    @ring.consumer_warpgroups(wg, num_wgs)
    def _consumers():
      wg_m0, wg_n0 = wg_origin(wg)
      wg_ms, wg_ns = pl.ds(wg_m0, wg_m), pl.ds(wg_n0, wg_n)

      def wgmma(acc_ref, slot):  # acc_ref += (wg_m, 128) @ (128, wg_n)
        lhs_op = lhs_smem.at[slot, wg_ms] if cfg.wg_split == "m" else lhs_smem.at[slot]
        rhs_op = rhs_smem.at[slot, wg_ns] if cfg.wg_split == "n" else rhs_smem.at[slot]
        plgpu.wgmma(acc_ref, lhs_op, rhs_op.T)  # rhs (wg_n, 128) K-major, read as (128, wg_n)

      @pl.loop(0, local_tiles)
      def _tile(j):
        bi, mi, ni = coords(j)
        bb = 0 if plan.rhs_shared else bi
        first = j * k_iters
        if plan.promoted:
          acc = scaled_k.promoted_loop(wgmma, first, bb, ni * bn + wg_n0, wg_ms, wg_ns, stages,
                               produced, consumed, lhs_scale_smem, rhs_scale_smem,
                               rhs_step_gmem, plan=plan, wg_m=wg_m, wg_n=wg_n,
                               k_iters=k_iters)
        else:
          acc = _plain_loop(wgmma, first, stages, produced, consumed, wg_m=wg_m, wg_n=wg_n,
                            k_iters=k_iters, wgmma_wait=wgmma_wait)
        _epilogue(acc, out_gmem, out_smem, epi_scalar_gmem, epi_rows_gmem, epi_cols_gmem,
                  bi, mi * bm + wg_m0, ni * bn + wg_n0, wg, config=cfg)

  del _scope  # run_scoped ran it
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _operand_smem(shape, dtype, by_row: bool):
  """An operand's ring: (stages, rows, 128) fp8 in (8, 128) swizzled tiles, as wgmma reads
  it; by_row: a union of that ref and the same bytes viewed as (1, 128) tiles, for TMA
  (one 128-byte swizzled row is a whole tile in both: `layout.row_transforms`). Each
  group of a `plgpu.RefUnion` starts at its first byte."""
  mma = plgpu.SMEM(shape, dtype, transforms=swizzle_transforms(BLOCK_K, dtype))
  if not by_row:
    return mma
  return plgpu.RefUnion(mma, plgpu.SMEM(shape, dtype,
                                        transforms=row_transforms(BLOCK_K, dtype)))


def _plain_loop(wgmma, first, stages, produced, consumed, *, wg_m, wg_n, k_iters,
                wgmma_wait):
  """All of K into one wgmma accumulator; returns the (wg_m, wg_n) f32 sum."""

  @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wg_m, wg_n), jnp.float32))
  def acc(acc_ref):
    @pl.loop(0, k_iters)
    def _k(kk):
      slot = lax.rem(first + kk, stages)
      plgpu.barrier_wait(produced.at[slot])
      wgmma(acc_ref, slot)
      plgpu.wgmma_wait(wgmma_wait)
      if wgmma_wait == 0:
        plgpu.barrier_arrive(consumed.at[slot])
      else:  # the previous step's wgmma is done: its stage is free

        @pl.when(kk > 0)
        def _():
          plgpu.barrier_arrive(consumed.at[lax.rem(first + kk - 1, stages)])

    if wgmma_wait:
      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(consumed.at[lax.rem(first + k_iters - 1, stages)])
    return acc_ref[...]

  return acc


def _epilogue(acc, out_gmem, out_smem, epi_scalar_gmem, epi_rows_gmem, epi_cols_gmem,
              bi, row0, col0, wg, *, config: Config):
  """acc (wg_m, wg_n) times the epilogue scales, cast, stored by TMA in sub-tiles."""
  cfg = config
  epi_m, epi_n = cfg.epi_block_m, cfg.epi_block_n
  # This warpgroup's previous tile's stores must have read their slots.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  scalar = None if epi_scalar_gmem is None else epi_scalar_gmem[bi]
  sub_tiles = [(slice(i * epi_m, (i + 1) * epi_m), slice(j * epi_n, (j + 1) * epi_n))
               for i in range(cfg.wg_block_m // epi_m) for j in range(cfg.wg_block_n // epi_n)]
  for step, (es_m, es_n) in enumerate(sub_tiles):
    rows, cols = pl.ds(row0 + es_m.start, epi_m), pl.ds(col0 + es_n.start, epi_n)
    val = acc[es_m, es_n]
    if scalar is not None:
      val = val * scalar
    if epi_rows_gmem is not None:  # optimized=False: vectorized loads are smem-only
      r = plgpu.load(epi_rows_gmem.at[bi, rows], layout=plgpu.Layout.WGMMA.reduce(1),
                     optimized=False)
      val = val * lax.broadcast_in_dim(r, (epi_m, epi_n), [0])
    if epi_cols_gmem is not None:
      c = plgpu.load(epi_cols_gmem.at[bi, cols], layout=plgpu.Layout.WGMMA.reduce(0),
                     optimized=False)
      val = val * lax.broadcast_in_dim(c, (epi_m, epi_n), [1])
    slot = step % cfg.out_slots
    # The slot's store from out_slots sub-tiles ago must have read it.
    plgpu.wait_smem_to_gmem(cfg.out_slots - 1, wait_read_only=True)
    out_smem[wg, slot] = val.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_gmem.at[bi, rows, cols])


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def _by_row(rows: int, interpret) -> bool:
  """Whether an array of `rows` rows is moved through the single-row view rather than
  padded to a multiple of 8: on a GPU (the interpreter keeps a RefUnion's views apart),
  and past 8 rows (a shorter array is padded, a copy of at most 8 rows)."""
  return not interpret and rows > 8 and rows % 8 != 0


def scaled_gemm(lhs, rhs, lhs_scales, rhs_scales, *, out_dtype=jnp.bfloat16,
                config: Config | None = None, interpret: bool = False):
  """(B, M, N) out_dtype: the scaled product of fp8 lhs (B, M, K) and rhs (B, N, K),
  both K-major; scale layouts in the module docstring. Any M, N, K (K % 128 == 0 and M,
  N each a multiple of 8 or above 8 need no operand copy; N * itemsize(out) % 16 == 0 no
  output slice). The sum is f32; the result is cast once."""
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if jnp.dtype(x.dtype) not in FP8_DTYPES:
      raise TypeError(f"{name}.dtype={x.dtype}: expected float8_e4m3fn or float8_e5m2")
    if x.ndim != 3:
      raise ValueError(f"{name}.shape={x.shape}: expected 3 dims ((B, M, K) / (B, N, K))")
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in OUT_DTYPES:
    raise TypeError(f"out_dtype={out_dtype}: expected bfloat16, float16 or float32")
  batch, m, k = lhs.shape
  batch_r, n, k_r = rhs.shape
  if k_r != k:
    raise ValueError(f"rhs.shape={rhs.shape}: K={k_r} differs from lhs's K={k}"
                     f" (lhs.shape={lhs.shape}; rhs is (B, N, K))")
  if batch_r not in (1, batch):
    raise ValueError(f"rhs.shape={rhs.shape}: batch {batch_r} must be 1 or lhs's {batch}")
  k_blocks = -(-k // BLOCK_K)
  n_blocks = -(-n // 128)
  lhs_kind = _classify("lhs_scales", lhs_scales, batch, m, k_blocks, None)
  rhs_kind = _classify("rhs_scales", rhs_scales, batch_r, n, k_blocks, n_blocks)
  if rhs_kind == "block" and k_blocks == 1:  # one block along K: per column
    rhs_scales, rhs_kind = jnp.repeat(rhs_scales, 128, axis=1)[:, :n], "row"
  if 0 in (batch, m, n):
    return jnp.zeros((batch, m, n), out_dtype)
  if k == 0:
    return jnp.zeros((batch, m, n), out_dtype)

  step_scales = _step_scales(lhs_kind, rhs_kind)
  # Promoted unless a config asks for fast accumulation (block scales always are).
  if config is None:
    config = default_config_for(m, n, k, out_dtype, lhs_kind, rhs_kind)
  promoted = step_scales or not config.fast_accumulation
  bm, bn = config.block_m, config.block_n
  rhs_step = {"step": "column", "block": "block"}.get(rhs_kind)
  check(config, out_dtype, k=k, promoted=promoted, row_scales=lhs_kind == "step",
        column_scales=rhs_step == "column")
  plan = Plan(lhs_step=lhs_kind == "step", rhs_step=rhs_step,
              epi_scalar=lhs_kind == "tensor" or rhs_kind == "tensor",
              epi_rows=lhs_kind == "row", epi_cols=rhs_kind == "row", promoted=promoted,
              rhs_shared=batch_r == 1 and batch > 1, lhs_by_row=_by_row(m, interpret),
              rhs_by_row=_by_row(n, interpret))

  # Operands: K a multiple of 128 (zeros are exact); rows a multiple of 8, or moved
  # through the single-row view.
  tile = tma_tile(BLOCK_K, lhs.dtype)  # (8, 128) for fp8
  lhs = pad_for_tma(lhs, tma_view_tile(tile, plan.lhs_by_row), BLOCK_K)
  rhs = pad_for_tma(rhs, tma_view_tile(tile, plan.rhs_by_row), BLOCK_K)
  k_iters = lhs.shape[2] // BLOCK_K
  # Every tile's rows / columns lie inside the scale vectors (no gmem bounds checks).
  m_all = round_up(m, bm * config.cluster_m)
  n_all = round_up(n, bn * config.cluster_n)
  operands = [lhs, rhs]
  if plan.lhs_step:  # (B, K_b, M'): one contiguous (block_m,) TMA box per step
    operands.append(pad_to(jnp.swapaxes(lhs_scales, 1, 2), m_all))
  if rhs_step == "column":
    operands.append(pad_to(jnp.swapaxes(rhs_scales, 1, 2), n_all))
  elif rhs_step == "block":
    operands.append(pad_to(jnp.swapaxes(rhs_scales, 1, 2), n_all // 128 + 1))
  if plan.epi_scalar:
    scalar = jnp.ones((batch,), jnp.float32)
    if lhs_kind == "tensor":
      scalar = scalar * lhs_scales[:, 0, 0]
    if rhs_kind == "tensor":
      scalar = scalar * rhs_scales[:, 0, 0]
    operands.append(scalar)
  if plan.epi_rows:
    operands.append(pad_to(lhs_scales[:, :, 0], m_all))
  if plan.epi_cols:
    operands.append(pad_to(jnp.broadcast_to(rhs_scales[:, :, 0], (batch, n)), n_all))

  out_tile = tma_tile(config.epi_block_n, out_dtype)
  m_out, n_out = tma_padded_shape(m, n, tma_view_tile(out_tile, plan.lhs_by_row))
  n_out = max(n_out, bn)  # as for the operands: never narrower than the block
  # One CTA (or cluster of CTAs) per SM (or SM pair).
  num_ctas = launch.grid_sms(config.num_sms, interpret, need_gpu=True) // config.cluster_size
  body = functools.partial(_kernel, config=config, plan=plan, m=m, n=n, k_iters=k_iters,
                           batch=batch, num_ctas=num_ctas)
  kernel = launch.warpgroup_kernel(
      body, out_type=jax.ShapeDtypeStruct((batch, m_out, n_out), out_dtype),
      num_ctas=num_ctas, num_compute_wgs=config.num_compute_wgs,
      cluster_size=config.cluster_size, kernel_name="pallas_gemm_scaled_fp8")
  out = launch.call(kernel, *operands, interpret=interpret)
  if (m_out, n_out) != (m, n):
    out = unpad(out, m, n, interpret=interpret)
  return out
