"""The persistent GEMM kernel body: one ring of TMA loads across a CTA's tiles, filled by
one producer warp, drained by wgmma consumer warpgroups.

One CTA per SM (or one cluster of two CTAs per SM pair). The CTA's work is a sequence of
pieces, each a tile and a range [k0, k1) of its K blocks: whole tiles (k0 = 0, k1 =
k_iters) strided by the CTA count, then, with stream-K, up to three pieces of a K range
(`stream_k.StreamK`). Step s (counted over all pieces) uses ring buffer s % stages. One
warp of the producer warpgroup issues the TMA loads of every step, after the buffer's
release from step s - stages (`ring`); the consumer warpgroups wait for step s's loads,
run wgmma, release the buffer (one step later with wgmma_wait=1) and, after a piece's
last step, run the epilogue (`epilogue.store_tile`) while the producer is already
loading the next piece.

Pingpong (Config.pingpong): the CTA's tile j is consumer warpgroup j % 2's alone; the
ring is the same, each step is released by one warpgroup, and each warpgroup waits for
its steps' loads on its own set of `produced` barriers. (A barrier's phase is tracked per
thread, by the waits that thread makes: a warpgroup waiting on a slot only for its own
tiles would lose count of the phases the other's tiles complete there.)

An FP32 split (`split.k_loop`): each step loads the split.pieces 16-bit pieces of both
tiles (a (stages, pieces, ...) ring) and issues the split's piece products in place of
one wgmma.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.core import precision as _precision
from pallas_gemm.matmul.mosaic import epilogue as _epilogue
from pallas_gemm.mgpu import ring
from pallas_gemm.matmul.mosaic import split as _split
from pallas_gemm.matmul.mosaic.config import Config, _swizzle_minor
from pallas_gemm.mgpu.layout import swizzle_transforms
from pallas_gemm.matmul.mosaic.pair import Peer, placement
from pallas_gemm.matmul.mosaic.stream_k import StreamK, finish_cut_piece


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
  """The static parameters of one launch of `kernel`: the problem and how it is tiled.

  m, n, k, batch: the output tiles' space (with a `peer`, m is one device's half of a's
  2 * m rows). a_k_major / b_k_major: whether the operand is stored (M, K) / (N, K).
  b_shared: one B for every batch entry (batch_b = 1).
  num_ctas: CTAs of the grid, or clusters of CTAs (both CTAs of a cluster run the same
    tiles' two halves, so the schedule counts clusters).
  stream_k: the stream-K schedule, or None for whole tiles only.
  split: float32 operands computed from 16-bit pieces, or None.
  peer: None, or one kernel of a K split over two devices (`pair.Peer`).
  """
  config: Config
  m: int
  n: int
  k: int
  batch: int
  a_k_major: bool
  b_k_major: bool
  b_shared: bool = False
  num_ctas: int
  stream_k: StreamK | None = None
  split: _precision.Split | None = None
  peer: Peer | None = None

  @property
  def k_iters(self) -> int:
    return pl.cdiv(self.k, self.config.block_k)

  @property
  def m_iters(self) -> int:
    """Cluster tiles along m. With an odd tile count the last cluster's second CTA gets
    a tile past the edge: its TMA loads read zeros (it still has to take part in the
    multicast) and its stores are clipped away."""
    return pl.cdiv(pl.cdiv(self.m, self.config.block_m), self.config.cluster_m)

  @property
  def n_iters(self) -> int:
    return pl.cdiv(pl.cdiv(self.n, self.config.block_n), self.config.cluster_n)

  @property
  def stages(self) -> int:
    """Ring buffers: a ring deeper than K is never filled (smem_bytes counts it so too)."""
    return min(self.config.stages, self.k_iters)

  @property
  def wgmma_wait(self) -> int:
    """wgmma groups left in flight after a K step. With one K step there is nothing to
    overlap (and a one-stage ring cannot delay a release); the split's step waits for
    its own products."""
    if self.split is not None:
      return 0
    return self.config.wgmma_wait if self.k_iters > self.config.wgmma_wait else 0

  @property
  def a_block(self) -> tuple[int, int]:
    cfg = self.config
    return (cfg.block_m, cfg.block_k) if self.a_k_major else (cfg.block_k, cfg.block_m)

  @property
  def b_block(self) -> tuple[int, int]:
    cfg = self.config
    return (cfg.block_n, cfg.block_k) if self.b_k_major else (cfg.block_k, cfg.block_n)

  @property
  def wg_split(self) -> str | None:
    """How the CTA tile is split among the consumer warpgroups (None: pingpong's
    warpgroups take whole tiles)."""
    return None if self.config.pingpong else self.config.wg_split


def _tile_coords(p: Problem, bi, lin):
  """(batch entry, m tile, n tile) of tile lin of batch entry bi: ``plgpu.planar_snake``
  bands of grid_tile_width cluster tiles along grid_minor_dim, then this CTA's tile of
  the cluster."""
  cfg = p.config
  mi, ni = plgpu.planar_snake(lin, (p.m_iters, p.n_iters),
                              0 if cfg.grid_minor_dim == "m" else 1,
                              cfg.grid_tile_width)
  if cfg.cluster_size > 1:
    cta = lax.axis_index("cluster")
    mi, ni = mi * cfg.cluster_m, ni * cfg.cluster_n
    mi, ni = (mi + cta, ni) if cfg.cluster_m > 1 else (mi, ni + cta)
  return bi, mi, ni


def _wg_origin(p: Problem, wg):
  """This warpgroup's part of the CTA tile, in CTA-tile coordinates."""
  wg_m, wg_n = p.config.wg_block_m, p.config.wg_block_n
  return {"m": (wg * wg_m, 0), "n": (0, wg * wg_n), None: (0, 0)}[p.wg_split]


def _wgmma(p: Problem, acc_ref, a_smem, b_smem, wg):
  """acc_ref += (wg_m, bk) @ (bk, wg_n): the warpgroup's part of the tiles."""
  wg_m0, wg_n0 = _wg_origin(p, wg)
  wg_ms, wg_ns = pl.ds(wg_m0, p.config.wg_block_m), pl.ds(wg_n0, p.config.wg_block_n)
  if p.a_k_major:
    a_op = a_smem.at[wg_ms, :] if p.wg_split == "m" else a_smem
  else:
    a_op = (a_smem.at[:, wg_ms] if p.wg_split == "m" else a_smem).T
  if p.b_k_major:
    b_op = (b_smem.at[wg_ns, :] if p.wg_split == "n" else b_smem).T
  else:
    b_op = b_smem.at[:, wg_ns] if p.wg_split == "n" else b_smem
  plgpu.wgmma(acc_ref, a_op, b_op)


def kernel(a_gmem, b_gmem, c_gmem, bias_gmem, out_gmem, pre_gmem, partials_gmem, *,
           problem: Problem, epilogue: _epilogue.Epilogue):
  """One persistent CTA (of num_ctas, or of num_ctas clusters).

  a_gmem: (batch, M, K) if a_k_major else (batch, K, M)
  b_gmem: (batch_b, N, K) if b_k_major else (batch_b, K, N)
  c_gmem: (batch, M, N) or None; out_gmem: (batch, M, N') with N' >= N (2M rows for a
    gathering peer).
  pre_gmem: None, or like out_gmem: the pre-activation (keep_pre), stored beside it.
  bias_gmem: (N',) f32 or None, added to every row before the activation.
  partials_gmem: None, or with stream_k (num_ctas * cluster_size * num_compute_wgs,
    wg_block_m, wg_block_n) f32: per warpgroup, the sum it hands over for a tile that
    another CTA finishes.
  With a split, a_gmem and b_gmem are tuples of split.pieces arrays, the operand's
  pieces (largest first), each shaped as above.
  """
  p, cfg, split = problem, problem.config, problem.split
  dtype = (a_gmem if split is None else a_gmem[0]).dtype
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  num_wgs, k_iters, stages, wgmma_wait = cfg.num_compute_wgs, p.k_iters, p.stages, p.wgmma_wait
  a_transforms = swizzle_transforms(
      _swizzle_minor(cfg, p.a_block[1], p.a_k_major, split), dtype)
  b_transforms = swizzle_transforms(
      _swizzle_minor(cfg, p.b_block[1], p.b_k_major, split), dtype)
  # Which of a's rows this kernel computes, and where each output sub-tile goes.
  a_row0, destinations = placement(p.peer, p.m)

  def a_window(bi, mi, piece=0):  # rows [mi*bm, +bm) of batch bi (its piece), all K
    ms = pl.ds(mi * bm if p.peer is None else a_row0 + mi * bm, bm)
    a = a_gmem if split is None else a_gmem[piece]
    return a.at[bi, ms, :] if p.a_k_major else a.at[bi, :, ms]

  def b_window(bi, ni, piece=0):  # columns [ni*bn, +bn) of batch bi (its piece), all K
    bb = 0 if p.b_shared else bi
    b = b_gmem if split is None else b_gmem[piece]
    ns = pl.ds(ni * bn, bn)
    return b.at[bb, ns, :] if p.b_k_major else b.at[bb, :, ns]

  releases = 1 if cfg.pingpong else num_wgs  # consumer warpgroups per step
  a_multicast = ("cluster",) if cfg.cluster_n > 1 else None
  b_multicast = ("cluster",) if cfg.cluster_m > 1 else None
  if a_multicast or b_multicast:
    # Loads into both CTAs of a cluster: a slot is free once both CTAs released it.
    consumed = plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=releases,
                                    num_barriers=stages)
  else:
    consumed = plgpu.Barrier(num_arrivals=releases, num_barriers=stages)
  ring_pieces = () if split is None else (split.pieces,)  # the split's pieces
  loads = 2 * (1 if split is None else split.pieces)  # TMA loads per step
  scoped = dict(
      a_smem=plgpu.SMEM((stages, *ring_pieces, *p.a_block), dtype, transforms=a_transforms),
      b_smem=plgpu.SMEM((stages, *ring_pieces, *p.b_block), dtype, transforms=b_transforms),
      produced=plgpu.Barrier(num_arrivals=loads,
                             num_barriers=stages * (2 if cfg.pingpong else 1)),
      consumed=consumed,
      **_epilogue.allocations(cfg, out_gmem.dtype, None if c_gmem is None else c_gmem.dtype),
  )
  per_batch = p.m_iters * p.n_iters
  cta = lax.axis_index("sm")  # the CTA, or the cluster: both CTAs run the same pieces
  if p.stream_k is not None:
    # One semaphore and one partial accumulator per (CTA, consumer warpgroup): the
    # warpgroups of a tile's two CTAs pair up. Zeroed per call by Pallas; each wait
    # decrements its semaphore back to 0.
    semaphores = pl.get_global(plgpu.SemaphoreType.REGULAR((partials_gmem.shape[0],)))
    rank = lax.axis_index("cluster") if cfg.cluster_size > 1 else 0

  def for_each_piece(body):
    """Calls body(tile g, k0, k1, first step, cut) for the CTA's pieces in order.

    cut is False for the whole tiles of the first phase (static: no stream-K code
    there) and True for the stream-K pieces. Returns the CTA's number of steps.
    """
    if p.stream_k is None:
      local_tiles = lax.div(p.batch * per_batch - cta + p.num_ctas - 1, p.num_ctas)
    else:
      local_tiles = p.stream_k.dp_rounds

    @pl.loop(0, local_tiles)
    def _whole_tiles(j):
      body(cta + j * p.num_ctas, 0, k_iters, j * k_iters, False)

    if p.stream_k is None:
      return local_tiles * k_iters
    start, end = p.stream_k.range(cta)

    @pl.loop(0, 3)
    def _pieces(i):
      g, k0, k1, step = p.stream_k.piece(start, end, i)

      @pl.when(k0 < k1)
      def _():
        body(g, k0, k1, step, True)

    return p.stream_k.dp_rounds * k_iters + end - start

  def coords(g):  # tile g -> (batch entry, m tile, n tile)
    return _tile_coords(p, lax.div(g, per_batch), lax.rem(g, per_batch))

  def owner(first):  # pingpong: the consumer warpgroup of the piece whose first step is
    # `first`, the CTA's tile j = first / k_iters (it runs no stream-K pieces)
    return lax.rem(lax.div(first, k_iters), 2)

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(a_smem, b_smem, produced, consumed, out_smem, c_barrier=None, c_smem=None):
    wg = lax.axis_index("wg")

    def ready(to, slot):  # the `produced` barrier of a slot's loads for warpgroup `to`
      return produced.at[to * stages + slot] if cfg.pingpong else produced.at[slot]

    @ring.producer_warp(wg, num_wgs)
    def _loads():
      def load_piece(g, k0, k1, first, cut):
        del cut  # the loads do not depend on it
        bi, mi, ni = coords(g)
        srcs = [(a_window(bi, mi, i), b_window(bi, ni, i), (i,) if ring_pieces else ())
                for i in range(split.pieces if split else 1)]

        to = owner(first) if cfg.pingpong else None  # the consumer warpgroup

        def load(kk, slot):
          ks = pl.ds(kk * bk, bk)
          for a_src, b_src, piece in srcs:
            plgpu.copy_gmem_to_smem(a_src.at[:, ks] if p.a_k_major else a_src.at[ks, :],
                                    a_smem.at[(slot, *piece)], ready(to, slot),
                                    collective_axes=a_multicast)
            plgpu.copy_gmem_to_smem(b_src.at[:, ks] if p.b_k_major else b_src.at[ks, :],
                                    b_smem.at[(slot, *piece)], ready(to, slot),
                                    collective_axes=b_multicast)

        ring.fill(consumed, k0, k1, step=lambda kk: first + kk - k0, stages=stages,
                  load=load)

      ring.drain(consumed, for_each_piece(load_piece), stages=stages)

    @ring.consumer_warpgroups(wg, num_wgs)
    def _consumers():
      def mma_piece(g, k0, k1, first, cut):
        bi, mi, ni = coords(g)
        wg_m0, wg_n0 = _wg_origin(p, wg)

        def finish(acc):  # the epilogue, or the stream-K hand-over
          write = functools.partial(
              _epilogue.store_tile, acc, out_gmem, pre_gmem, c_gmem, bias_gmem, out_smem,
              c_smem, c_barrier, spec=epilogue, config=cfg, bi=bi, row0=mi * bm + wg_m0,
              col0=ni * bn + wg_n0, wg=wg, destinations=destinations)
          if not cut:
            write()
            return
          finish_cut_piece(acc, partials_gmem, semaphores, write=write, config=cfg,
                           cta=cta, rank=rank, wg=wg, k0=k0, k1=k1, k_iters=k_iters)

        if split is not None:
          finish(_split.k_loop(
              a_smem, b_smem, consumed, split=split,
              mma=lambda acc_ref, a_tile, b_tile: _wgmma(p, acc_ref, a_tile, b_tile, wg),
              ready=lambda slot: ready(wg, slot), k0=k0, k1=k1, first=first,
              stages=stages, shape=(cfg.wg_block_m, cfg.wg_block_n)))
          return

        @functools.partial(pl.run_scoped,
                           acc_ref=plgpu.ACC((cfg.wg_block_m, cfg.wg_block_n), jnp.float32))
        def _acc_scope(acc_ref):
          @pl.loop(k0, k1)
          def _k(kk):
            step = first + kk - k0
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(ready(wg, slot))
            _wgmma(p, acc_ref, a_smem.at[slot], b_smem.at[slot], wg)
            plgpu.wgmma_wait(wgmma_wait)
            if wgmma_wait == 0:
              plgpu.barrier_arrive(consumed.at[slot])
            else:  # the previous step's wgmma is done: its buffer is free

              @pl.when(kk > k0)
              def _():
                plgpu.barrier_arrive(consumed.at[lax.rem(step - 1, stages)])

          if wgmma_wait:
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(consumed.at[lax.rem(first + k1 - k0 - 1, stages)])
          finish(acc_ref[...])

      if cfg.pingpong:  # whole tiles only: its own, every other one
        for_each_piece(lambda g, k0, k1, first, cut: pl.when(owner(first) == wg)(
            lambda: mma_piece(g, k0, k1, first, cut)))
      else:
        for_each_piece(mma_piece)

  del _scope  # run_scoped ran it
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
