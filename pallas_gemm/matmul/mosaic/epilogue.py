"""The sub-tiled TMA epilogue of the Mosaic kernels: a consumer warpgroup's f32
accumulator to the output, in (epi_block_m, epi_block_n) sub-tiles.

Per sub-tile: the f32 partial of a stream-K tile's other K range is added, the sum is
scaled by alpha, beta * C is added (or, with a c_gate, the sum multiplied by act'(C)), C
fetched by TMA into shared memory; then the bias and the activation, the cast to the
out dtype, a store into a ring of shared-memory slots and a TMA store to global memory
(clipped at the array's edge). The epilogue overlaps the producer, which is already
loading the next tile. Any kernel whose warpgroups hold a wgmma accumulator can call
`store_tile` with the buffers of `allocations`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.core.epilogue import activate, derivative
from pallas_gemm.matmul.mosaic.config import Config, _sub_tiles
from pallas_gemm.mgpu.layout import swizzle_transforms


@dataclasses.dataclass(frozen=True, kw_only=True)
class Epilogue:
  """What the epilogue computes: act(alpha * acc + beta * C + bias), or with c_gate
  act'(C) * alpha * acc (C then not added). activation, c_gate: None or names in
  `pallas_gemm.core.epilogue.ACTIVATIONS`."""
  alpha: float = 1.0
  beta: float = 0.0
  activation: str | None = None
  c_gate: str | None = None


def allocations(config: Config, out_dtype, c_dtype=None) -> dict:
  """The shared memory of `store_tile`, for pl.run_scoped: per consumer warpgroup,
  out_slots output sub-tiles (out_smem); with a C (c_dtype not None), two barriers for
  its loads (c_barrier) and, for a C of another dtype than the output, its own sub-tile
  (c_smem). A C of the out dtype is staged in the output slots."""
  num_wgs, epi_m, epi_n = config.num_compute_wgs, config.epi_block_m, config.epi_block_n
  allocs = dict(out_smem=plgpu.SMEM(
      (num_wgs, config.out_slots, epi_m, epi_n), out_dtype,
      transforms=swizzle_transforms(epi_n, out_dtype)))
  if c_dtype is not None:
    # Two per warpgroup: its sub-tiles' C loads alternate between them (prefetch_c).
    allocs["c_barrier"] = plgpu.Barrier(num_barriers=2 * num_wgs)
    if jnp.dtype(c_dtype) != jnp.dtype(out_dtype):
      allocs["c_smem"] = plgpu.SMEM((num_wgs, epi_m, epi_n), c_dtype,
                                    transforms=swizzle_transforms(epi_n, c_dtype))
  return allocs


def to_own(ref):
  """`store_tile`'s default destinations: every sub-tile to ref itself."""
  return [(ref, None)]


def store_tile(acc, out_gmem, pre_gmem, c_gmem, bias_gmem, out_smem, c_smem, c_barrier, *,
               spec: Epilogue, config: Config, bi, row0, col0, wg, partial=None,
               destinations=to_own) -> None:
  """Runs the epilogue of one warpgroup's part of a tile (see the module docstring).

  acc: the warpgroup's (wg_block_m, wg_block_n) f32 accumulator, whose element (0, 0) is
    (row0, col0) of batch entry bi of the output.
  out_gmem: (batch, M, N'); pre_gmem: None, or like out_gmem: the pre-activation, stored
    beside act(z) (keep_pre); c_gmem: None or (batch, M, N); bias_gmem: None or (N',) f32.
  out_smem, c_smem, c_barrier: the buffers of `allocations` (c_smem, c_barrier None
    where not allocated); wg indexes the warpgroup's share of them.
  partial: None, or an f32 ref shaped like acc to add first (a stream-K tile's other K
    range).
  destinations(ref): where each output sub-tile of ref is stored, [(ref, row offset or
    None)] (`pair.placement`: a peer device's output, or both devices').
  """
  cfg = config
  epi_m, epi_n = cfg.epi_block_m, cfg.epi_block_n
  out_dtype = out_gmem.dtype
  c_separate = c_gmem is not None and c_gmem.dtype != out_dtype
  # Wait until this warpgroup's previous tile stores no longer read smem.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  sub_tiles = _sub_tiles(cfg)
  # Each sub-tile stores out (and pre) through the ring of out_slots buffers: store j
  # uses slot j % out_slots, after the store out_slots - 1 before it has read it.
  outs = [out_gmem] + ([] if pre_gmem is None else [pre_gmem])

  def window(ref, i, row_offset=None):  # sub-tile i of the tile, in a (batch, rows, cols)
    es_m, es_n = sub_tiles[i]
    start = row0 + es_m.start
    rows = pl.ds(start if row_offset is None else row_offset + start, epi_m)
    return ref.at[bi, rows, pl.ds(col0 + es_n.start, epi_n)]

  def load_partial(i):  # the f32 sum of the tile's other K range, sub-tile i
    # optimized=False: Mosaic GPU vectorizes only shared-memory transfers.
    return plgpu.load(partial.at[sub_tiles[i]], layout=plgpu.Layout.WGMMA,
                      optimized=False)

  # C is staged in the slot its sub-tile's output will use. With one output and two
  # slots, sub-tile i + 1's C is loaded (into the other slot, on its own barrier)
  # while sub-tile i is computed and stored: the epilogue then waits on one C load
  # per tile instead of one per sub-tile.
  prefetch_c = (c_gmem is not None and not c_separate and len(outs) == 1
                and cfg.out_slots == 2)

  def load_c(i):
    slot = (i * len(outs)) % cfg.out_slots  # (i % 2 with prefetch_c)
    dst = c_smem.at[wg] if c_separate else out_smem.at[wg, slot]
    barrier = c_barrier.at[wg * 2 + slot if prefetch_c else wg]
    plgpu.copy_gmem_to_smem(window(c_gmem, i), dst, barrier)
    return dst, barrier

  # Each sub-tile's partial is loaded one sub-tile ahead: the loads (from L2) wait
  # behind the previous sub-tile's stores instead of in front of its adds (on the
  # H200 the adds waiting for them were a tenth of a 2048^3 stream-K kernel).
  next_partial = None if partial is None else load_partial(0)
  next_c = load_c(0) if prefetch_c else None
  for step, (es_m, es_n) in enumerate(sub_tiles):
    c_val = None
    if not prefetch_c:
      # The first store's slot: its store from out_slots - 1 stores ago must have read
      # it (before C is staged there).
      plgpu.wait_smem_to_gmem(cfg.out_slots - 1, wait_read_only=True)
    if c_gmem is not None:
      if prefetch_c:
        c_dst, c_bar = next_c
      else:
        c_dst, c_bar = load_c(step)
      plgpu.barrier_wait(c_bar)
      c_val = c_dst[...].astype(jnp.float32)
      if prefetch_c and step + 1 < len(sub_tiles):
        # The other slot is free once the previous sub-tile's store has read it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        next_c = load_c(step + 1)
    val = acc[es_m, es_n]
    if partial is not None:
      this_partial = next_partial
      if step + 1 < len(sub_tiles):
        next_partial = load_partial(step + 1)
      val = val + this_partial
    if spec.alpha != 1.0:
      val = val * jnp.float32(spec.alpha)
    if c_val is not None:
      if spec.c_gate is not None:
        val = val * derivative(c_val, spec.c_gate)
      else:
        if spec.beta != 1.0:
          c_val = c_val * jnp.float32(spec.beta)
        val = val + c_val
    if bias_gmem is not None:  # (epi_n,) columns, broadcast over the sub-tile's rows
      bias = plgpu.load(bias_gmem.at[pl.ds(col0 + es_n.start, epi_n)],
                        layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
      val = val + lax.broadcast_in_dim(bias, (epi_m, epi_n), [1])
    values = [activate(val, spec.activation)] + ([val] if pre_gmem is not None else [])
    for o, (ref, value) in enumerate(zip(outs, values)):
      slot = (step * len(outs) + o) % cfg.out_slots
      if o:  # (the first store's slot was waited for above, or before C's prefetch)
        plgpu.wait_smem_to_gmem(cfg.out_slots - 1, wait_read_only=True)
      out_smem[wg, slot] = value.astype(out_dtype)
      plgpu.commit_smem()
      dests = destinations(ref)
      for d, (dst, row_offset) in enumerate(dests):
        # One bulk group per slot (the ring's waits count groups), however many stores.
        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], window(dst, step, row_offset),
                                commit_group=d == len(dests) - 1)
