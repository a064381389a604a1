"""Hopper (sm_90) grouped GEMM, the ragged-contraction form (the weight gradient of
`jax.lax.ragged_dot`): out[g] (K, N) = lhs[rows of g].T @ dy[rows of g], in Pallas Mosaic GPU.

Design (one CTA per SM, persistent):
  * Work items: (group, K tile, N tile) of the (G, K, N) output, block_k x block_n each.
    An item's work is its group's row steps, so the items are ordered by group size,
    largest first (one small argsort in XLA), group-major (consecutive items share the
    group's rows of lhs and dy in L2), a group's tiles in ``plgpu.planar_snake`` order; in
    round r the CTAs take the next num_ctas items, in reverse CTA order every other round.
    Dealing sorted work back and forth this way evens out the CTAs' totals where groups
    differ a lot in size (taken round-robin, a CTA could get two tiles of the largest
    group and another one).
  * Reduction: over the group's rows [start, end) in steps of block_m rows from start
    rounded down to a multiple of 8 (a TMA box of the 8-row-tiled operands starts on such
    a row), ceil((end - that row) / block_m) steps. A step's tiles are lhs (block_m x
    block_k), read from lhs's (M, K) storage and handed to wgmma transposed (16-bit wgmma
    reads an MN-major A from shared memory: no copy of lhs), and dy (block_m x block_n).
    The group's first step (up to 7 rows early) and its last may hold rows of neighbouring
    groups (or rows past sum(group_sizes)): after their loads land, the consumer
    warpgroups zero those rows of both tiles in shared memory (64-column pieces shared out
    among them: load, select, store, fence), meet on a barrier, and only then run wgmma,
    so another group's rows contribute exactly zero even when they hold inf or NaN.
    Interior steps run unmasked.
  * The K pipeline's ring, producer warp and consumer warpgroups are the forward kernel's
    (`mosaic_forward`): one loop over the CTA's (item, row step) pairs; an empty group
    loads nothing and its tile is stored as zeros.
  * Epilogue: (epi_block_m x epi_block_n) sub-tiles through ``epi_slots`` shared-memory
    slots per warpgroup taken in turn, stored by TMA (clipped at K and N); a slot is only
    waited for when it is rewritten, so with a slot per sub-tile the stores drain while the
    next item reduces.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.mgpu import launch, ring
from pallas_gemm.mgpu.layout import (pad_for_tma, round_up, row_transforms, swizzle_transforms,
                                     tma_tile)
from pallas_gemm.grouped.config import Config, check_smem, default_config
from pallas_gemm.grouped.mosaic_forward import DTYPES, num_ctas
from pallas_gemm.mgpu.rows import ROW_ALIGN, local_rows, store_subtiles

# Columns of one masking piece: a 128-byte swizzle atom of 16-bit elements.
_MASK_COLS = 64
# Rows of the group table (`_kernel`'s bounds_gmem).
_GROUP, _START, _END = range(3)


def _kernel(bounds_gmem, lhs_gmem, dy_gmem, out_gmem, *, config: Config, k: int, n: int,
            num_groups: int, num_ctas: int):
  """One persistent CTA. bounds_gmem (3, G) int32: the groups by size, largest first
  (rows _GROUP, _START, _END: the group and its [start, end) rows);
  lhs_gmem (M', K'); dy_gmem (M', N'); out_gmem (G, K, N'')."""
  cfg = config
  dtype = lhs_gmem.dtype
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  wg_m, wg_n = cfg.wg_tile(bk)
  epi_m, epi_n = cfg.epi_block_m, cfg.epi_block_n
  num_wgs = cfg.num_compute_wgs
  k_tiles, n_tiles = pl.cdiv(k, bk), pl.cdiv(n, bn)
  per_group = k_tiles * n_tiles
  stages = cfg.stages
  epi_slots = cfg.epi_slots_for(bk)
  num_items = num_groups * per_group

  step8 = bm // ROW_ALIGN

  def step_row0(first, i):  # first row of step i, a multiple of 8 the TMA tiling can see
    return (first + i * step8) * ROW_ALIGN

  cta = lax.axis_index("sm")
  # Round r deals items [r * num_ctas, (r + 1) * num_ctas) to the CTAs, in reverse CTA
  # order when r is odd; the last, partial round reaches the first `rest` CTAs in its order.
  rounds, rest = divmod(num_items, num_ctas)
  turn = cta if rounds % 2 == 0 else num_ctas - 1 - cta  # the CTA's place in that round
  local_work = rounds + (turn < rest).astype(jnp.int32)

  def order(j):  # the place by size of the CTA's j-th item
    place = jnp.where(lax.rem(j, 2) == 0, cta, num_ctas - 1 - cta)
    return j * num_ctas + place

  def item(j):  # the CTA's j-th item: (group, first row / 8, row steps, start, end, kt, nt)
    w = order(j)
    rank = lax.div(w, per_group)  # the group's place by size
    kt, nt = plgpu.planar_snake(lax.rem(w, per_group), (k_tiles, n_tiles), 1,
                                cfg.grid_tile_width)
    group = bounds_gmem[_GROUP, rank]
    start, end = bounds_gmem[_START, rank], bounds_gmem[_END, rank]
    first = lax.div(start, ROW_ALIGN)  # the first step's first row / 8
    steps = jnp.where(end > start, lax.div(end - first * ROW_ALIGN + bm - 1, bm), 0)
    return group, first, steps, start, end, kt, nt

  def wg_origin(wg):
    return (wg * wg_m, 0) if (num_wgs == 2 and cfg.wg_split == "m") else (0, wg * wg_n)

  def wgmma(acc_ref, a_smem, b_smem, wg):  # acc_ref += (wg_m, bm) @ (bm, wg_n)
    m0, n0 = wg_origin(wg)
    a_op = (a_smem.at[:, pl.ds(m0, wg_m)] if wg_m != bk else a_smem).T
    b_op = b_smem.at[:, pl.ds(n0, wg_n)] if wg_n != bn else b_smem
    plgpu.wgmma(acc_ref, a_op, b_op)

  # The masking pieces of a step's two tiles, shared out among the consumer warpgroups.
  pieces = ([("a", c) for c in range(0, bk, _MASK_COLS)]
            + [("b", c) for c in range(0, bn, _MASK_COLS)])

  scoped = dict(
      a_smem=plgpu.SMEM((stages, bm, bk), dtype, transforms=swizzle_transforms(bk, dtype)),
      b_smem=plgpu.SMEM((stages, bm, bn), dtype, transforms=swizzle_transforms(bn, dtype)),
      out_smem=plgpu.SMEM((num_wgs, epi_slots, epi_m, epi_n), out_gmem.dtype,
                          transforms=row_transforms(epi_n, out_gmem.dtype)),
      produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=num_wgs, num_barriers=stages),
      masked=plgpu.Barrier(num_arrivals=num_wgs, num_barriers=1),
  )

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(a_smem, b_smem, out_smem, produced, consumed, masked):
    wg = lax.axis_index("wg")

    @ring.producer_warp(wg, num_wgs)
    def _loads():
      def load_item(j, step):  # step: the CTA's row steps so far (ring position)
        _, first, steps, _, _, kt, nt = item(j)

        def load(i, slot):
          rows = pl.ds(step_row0(first, i), bm)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, pl.ds(kt * bk, bk)],  # (bm, bk)
                                  a_smem.at[slot], produced.at[slot])
          plgpu.copy_gmem_to_smem(dy_gmem.at[rows, pl.ds(nt * bn, bn)],  # (bm, bn)
                                  b_smem.at[slot], produced.at[slot])

        ring.fill(consumed, 0, steps, step=lambda i: step + i, stages=stages, load=load)
        return step + steps

      ring.drain(consumed, lax.fori_loop(0, local_work, load_item, jnp.int32(0)),
                 stages=stages)

    @ring.consumer_warpgroups(wg, num_wgs)
    def _consumers():
      m0, n0 = wg_origin(wg)

      def mask(slot, lo, hi):  # zero rows outside [lo, hi) of the slot's two tiles
        for p, (which, col) in enumerate(pieces):
          ref = (a_smem if which == "a" else b_smem).at[slot, :, pl.ds(col, _MASK_COLS)]

          @pl.when(wg == p % num_wgs)
          def _():
            x = ref[...]  # (bm, 64)
            rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
            ref[...] = jnp.where((rows >= lo) & (rows < hi), x, jnp.zeros_like(x))

        plgpu.commit_smem()  # visible to wgmma (the async proxy)
        plgpu.barrier_arrive(masked.at[0])
        plgpu.barrier_wait(masked.at[0])

      def mma_item(j, step):
        group, first, steps, start, end, kt, nt = item(j)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wg_m, wg_n), jnp.float32))
        def _acc_scope(acc_ref):
          @pl.loop(0, steps)
          def _rows(i):
            slot = lax.rem(step + i, stages)
            plgpu.barrier_wait(produced.at[slot])
            row0 = step_row0(first, i)

            @pl.when((row0 < start) | (row0 + bm > end))
            def _():
              mask(slot, start - row0, end - row0)

            wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot], wg)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(consumed.at[slot])

          # acc_ref holds zeros for an empty group.
          store_subtiles(acc_ref[...], out_smem, wg, lambda slot_smem, i, jj: (
              plgpu.copy_smem_to_gmem(slot_smem, out_gmem.at[
                  group, pl.ds(kt * bk + m0 + i * epi_m, epi_m),
                  pl.ds(nt * bn + n0 + jj * epi_n, epi_n)])))

        return step + steps

      lax.fori_loop(0, local_work, mma_item, jnp.int32(0))

  del _scope
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def weight_grad(lhs, dy, group_sizes, group_offset=None, *, num_groups: int | None = None,
                out_dtype=None, config: Config | None = None,
                interpret: bool | plgpu.InterpretGPUParams = False):
  """out (G, K, N): out[g] = lhs[rows of g].T @ dy[rows of g]; an empty group gives zeros.

  lhs: (M, K), dy: (M, N), both bf16 or both f16. group_sizes: int, traced; its groups'
  rows are consecutive from row 0. The G computed groups are group_sizes[group_offset :
  group_offset + G] (`mgpu.rows.local_rows`), G = num_groups, which defaults to
  len(group_sizes) - group_offset (group_offset then must be concrete, or None: 0).
  Rows of no computed group never contribute. f32 accumulation; out_dtype defaults to
  lhs's dtype.
  """
  if lhs.ndim != 2 or dy.ndim != 2 or lhs.shape[0] != dy.shape[0]:
    raise ValueError(f"lhs must be (M, K) and dy (M, N) with the same M, got"
                     f" lhs.shape={lhs.shape}, dy.shape={dy.shape}")
  if jnp.dtype(lhs.dtype) not in DTYPES or dy.dtype != lhs.dtype:
    raise TypeError(f"lhs and dy must both be bfloat16 or both float16, got"
                    f" lhs.dtype={lhs.dtype}, dy.dtype={dy.dtype}")
  if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be a 1-D integer array, got shape"
                     f" {group_sizes.shape}, dtype {group_sizes.dtype}")
  if num_groups is None:
    if group_offset is None:
      num_groups = group_sizes.shape[0]
    else:
      try:
        num_groups = group_sizes.shape[0] - int(group_offset)
      except jax.errors.ConcretizationTypeError:
        raise ValueError("weight_grad: a traced group_offset needs num_groups") from None
  if not 0 <= num_groups <= group_sizes.shape[0]:
    raise ValueError(f"num_groups={num_groups} must be in [0, len(group_sizes)="
                     f"{group_sizes.shape[0]}]")
  (m, k), n = lhs.shape, dy.shape[1]
  dtype = jnp.dtype(lhs.dtype)
  out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
  if config is None:
    config = default_config(m, n, k, num_groups, dtype, out_dtype=out_dtype,
                            weight_grad=True)
  if min(m, k, n, num_groups) == 0:
    return jnp.zeros((num_groups, k, n), out_dtype)
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  config.check_tiles(bk)
  check_smem(config, a_tile=(bm, bk), b_tile=(bm, bn), dtype=dtype, out_dtype=out_dtype)

  starts, ends = local_rows(group_sizes, group_offset, num_groups, m)
  order = jnp.argsort(starts - ends, stable=True).astype(jnp.int32)  # largest first
  bounds = jnp.stack([order, starts[order], ends[order]])
  lhs = pad_for_tma(lhs, tma_tile(bk, dtype), bk)
  dy = pad_for_tma(dy, tma_tile(bn, dtype), bn)
  # Columns: whole swizzle widths, and at least one block: as for the gemm kernel
  # (`layout.pad_for_tma`), an output narrower than the block computes wrong results
  # on the GPU (N = 40 with 128-column blocks) though the interpreter gets them right.
  n_out = max(round_up(n, tma_tile(config.epi_block_n, out_dtype)[1]), bn)
  k_out = max(k, bk)  # likewise rows: at least one block of K
  ctas = num_ctas(config, bool(interpret))
  body = functools.partial(_kernel, config=config, k=k, n=n, num_groups=num_groups,
                           num_ctas=ctas)
  kernel = launch.warpgroup_kernel(
      body, out_type=jax.ShapeDtypeStruct((num_groups, k_out, n_out), out_dtype),
      num_ctas=ctas, num_compute_wgs=config.num_compute_wgs,
      kernel_name="pallas_gemm_ragged_weight_grad")
  out = launch.call(kernel, bounds, lhs, dy, interpret=interpret)
  return out if (k_out, n_out) == (k, n) else out[:, :k, :n]
