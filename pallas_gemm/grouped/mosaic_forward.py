"""Hopper (sm_90) grouped GEMM, the forward form: out (M, N) = lhs (M, K) @ rhs[g] for the
rows of each group g (the layout of `jax.lax.ragged_dot`), written in Pallas Mosaic GPU.

Design (one CTA per SM, persistent):
  * Work items. The rows form consecutive segments: the local groups, and rows that
    belong to none (past sum(group_sizes), or of groups outside [group_offset,
    group_offset + G)), whose output is zeros. A segment is cut into row tiles of block_m
    from its first row rounded down to a multiple of 8 (a TMA box of the 8-row-tiled lhs
    starts on such a row): an item is one row tile of one segment, its rows [lo, hi) the
    segment's part of the tile. Only a segment's first tile (at most 7 rows early) and its
    last reach into a neighbour's rows, which the item computes and never stores; a
    segment's last tile is partly wasted work, half a tile on average (tiles aligned in
    the global row space would waste a whole one per boundary: both tiles a boundary
    straddles are partial). Segments are G + 2 (a zero segment before and after the local
    groups). `row_items` builds the item table on the device from the traced
    group_sizes (cumulative sums and an (items x segments) comparison, a few tiny XLA
    fusions: no host sync). Each CTA walks (item, column tile) pairs strided by the CTA
    count, in ``plgpu.planar_snake`` order: bands of ``grid_tile_width`` column tiles, the
    items in row order within a band, so the CTAs that run together read a few row tiles
    of lhs and the same group's weight tiles (mostly one expert's) out of L2.
  * K pipeline: a ``stages``-deep ring of swizzled shared-memory tiles of lhs (block_m x
    block_k) and of the item's expert rhs[g] (block_k x block_n, or block_n x block_k when
    rhs is stored transposed: 16-bit wgmma reads either major order, no copy), filled by
    TMA from one warp of a producer warpgroup that runs a single loop over all of the CTA's
    (item, K block) steps (`mgpu.ring`). Zero items load nothing. ``num_compute_wgs``
    consumer warpgroups each own half of the CTA tile (``Config.wg_split``) and run wgmma
    into an f32 register accumulator; a zero item's accumulator stays zero. Each step's
    wgmma completes before its slot is released.
  * Epilogue (consumer warpgroups, while the producer loads the next item): each
    (epi_block_m x epi_block_n) sub-tile is cast, written to one of ``epi_slots``
    shared-memory slots (taken in turn; waited for only when rewritten) and stored by TMA,
    only the rows [lo, hi) of the item's segment: a straddling tile never writes a
    neighbour group's rows. A TMA box has a static shape, so a row range of
    r rows is stored as up to log2(epi_block_m) + 1 boxes of power-of-two heights (the
    binary digits of r); a whole sub-tile is one box. The slot's rows are tiled (1, swizzle)
    so that a box may start at any row. Every row of the output belongs to exactly one
    item, so the output needs no zero fill beforehand and no extra pass.

Shapes and edges: TMA zero-fills the parts of a load past the array and clips stores, so
M, K, N need not be tile multiples. Mosaic GPU describes a swizzled TMA through a tiled
view of the whole array, so lhs's rows must be a multiple of 8 and K (and N for rhs) of
64 16-bit elements: operands that are not get zero-padded (`layout.pad_for_tma`, one
read+write of that operand) and an output whose N is not a multiple of the epilogue's
swizzle is computed wider and sliced.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.core import epilogue
from pallas_gemm.mgpu import launch, ring
from pallas_gemm.mgpu.rows import (GROUP, HI, LO, ROW8, ROW_ALIGN, check_row_stores,
                                   local_rows, row_items, store_rows, store_subtiles)
from pallas_gemm.mgpu.layout import (pad_for_tma, round_up, row_transforms, swizzle_transforms,
                                     tma_tile)
from pallas_gemm.grouped.config import Config, check_smem, default_config

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

def num_ctas(config: Config, interpret: bool) -> int:
  return launch.grid_sms(config.num_sms, interpret)


@dataclasses.dataclass(frozen=True)
class Gate:
  """The gated epilogue of `gated_forward`: rhs (G, K, 2F) holds [gate | up]; the kernel
  writes a = act(lhs @ gate) * (lhs @ up) and, with write_h, h = lhs @ rhs."""
  activation: str  # `core.epilogue.ACTIVATIONS` name of the gate's function
  f: int           # F: a multiple of 64 (the TMA tile), so up's columns start on a tile
  write_h: bool


def _kernel(items_gmem, count_gmem, lhs_gmem, rhs_gmem, out_gmem, h_gmem=None, *,
            config: Config, k: int, n: int, transpose_rhs: bool, num_ctas: int,
            gate: Gate | None = None):
  """One persistent CTA. lhs_gmem (M', K'); rhs_gmem (G, K', N') or (G, N', K');
  out_gmem (M, N''); items_gmem (4, T) and count_gmem (1,) from `row_items`.
  With gate, n is F, rhs_gmem (G, K', 2F), and each CTA tile multiplies lhs by two rhs
  tiles, the gate's columns and the up's F further on (two accumulators), into
  out_gmem = a (M, F'') and h_gmem = h (M, 2F) (with gate.write_h; both at least a block
  wide)."""
  cfg = config
  dtype = lhs_gmem.dtype
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  wg_m, wg_n = cfg.wg_tile(bm)
  epi_m, epi_n = cfg.epi_block_m, cfg.epi_block_n
  num_wgs = cfg.num_compute_wgs
  k_iters, n_tiles = pl.cdiv(k, bk), pl.cdiv(n, bn)
  stages = min(cfg.stages, k_iters)
  epi_slots = cfg.epi_slots_for(bm)
  b_block = (bn, bk) if transpose_rhs else (bk, bn)
  # Gated: two rhs tiles per step, the gate's (columns c) and the up's (columns F + c).
  b_tiles = () if gate is None else (2,)

  count = count_gmem[0]
  cta = lax.axis_index("sm")
  local_work = lax.div(count * n_tiles - cta + num_ctas - 1, num_ctas)

  def item(j):  # the CTA's j-th work item: (group, row0, lo, hi, column tile)
    t, ni = plgpu.planar_snake(cta + j * num_ctas, (count, n_tiles), 1, cfg.grid_tile_width)
    # (a multiple of 8 that the TMA tiling's divisibility check can see)
    row0 = items_gmem[ROW8, t] * ROW_ALIGN
    return items_gmem[GROUP, t], row0, items_gmem[LO, t], items_gmem[HI, t], ni

  def wg_origin(wg):  # the warpgroup's part of the CTA tile: (row, column) offsets
    return (wg * wg_m, 0) if (num_wgs == 2 and cfg.wg_split == "m") else (0, wg * wg_n)

  def wgmma(acc_ref, a_smem, b_smem, wg):  # acc_ref += (wg_m, bk) @ (bk, wg_n)
    m0, n0 = wg_origin(wg)
    a_op = a_smem.at[pl.ds(m0, wg_m), :] if wg_m != bm else a_smem
    if transpose_rhs:
      b_op = (b_smem.at[pl.ds(n0, wg_n), :] if wg_n != bn else b_smem).T
    else:
      b_op = b_smem.at[:, pl.ds(n0, wg_n)] if wg_n != bn else b_smem
    plgpu.wgmma(acc_ref, a_op, b_op)

  scoped = dict(
      a_smem=plgpu.SMEM((stages, bm, bk), dtype, transforms=swizzle_transforms(bk, dtype)),
      b_smem=plgpu.SMEM((stages, *b_tiles, *b_block), dtype,
                        transforms=swizzle_transforms(b_block[1], dtype)),
      out_smem=plgpu.SMEM((num_wgs, epi_slots, epi_m, epi_n), out_gmem.dtype,
                          transforms=row_transforms(epi_n, out_gmem.dtype)),
      produced=plgpu.Barrier(num_arrivals=2 + len(b_tiles), num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=num_wgs, num_barriers=stages),
  )

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(a_smem, b_smem, out_smem, produced, consumed):
    wg = lax.axis_index("wg")

    @ring.producer_warp(wg, num_wgs)
    def _loads():
      def load_item(j, step):  # step: the CTA's K steps so far (ring position)
        group, row0, _, _, ni = item(j)

        def load(kk, slot):
          ks = pl.ds(kk * bk, bk)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(row0, bm), ks],  # (bm, bk)
                                  a_smem.at[slot], produced.at[slot])
          if gate is None:
            ns = pl.ds(ni * bn, bn)
            rhs_tile = (rhs_gmem.at[group, ns, ks] if transpose_rhs  # (bn, bk)
                        else rhs_gmem.at[group, ks, ns])  # (bk, bn)
            plgpu.copy_gmem_to_smem(rhs_tile, b_smem.at[slot], produced.at[slot])
          else:
            for half in range(2):  # gate, then up; starts in whole 64-column TMA tiles
              col = (half * (gate.f // 64) + ni * (bn // 64)) * 64
              plgpu.copy_gmem_to_smem(rhs_gmem.at[group, ks, pl.ds(col, bn)],
                                      b_smem.at[slot, half], produced.at[slot])

        @pl.when(group >= 0)  # a zero item loads nothing
        def _():
          ring.fill(consumed, 0, k_iters, step=lambda kk: step + kk, stages=stages,
                    load=load)

        return step + jnp.where(group >= 0, k_iters, 0)

      ring.drain(consumed, lax.fori_loop(0, local_work, load_item, jnp.int32(0)),
                 stages=stages)

    @ring.consumer_warpgroups(wg, num_wgs)
    def _consumers():
      m0, n0 = wg_origin(wg)

      def mma_item(j, step):
        group, row0, lo, hi, ni = item(j)

        accs = dict(acc_ref=plgpu.ACC((wg_m, wg_n), jnp.float32))
        if gate is not None:
          accs["up_ref"] = plgpu.ACC((wg_m, wg_n), jnp.float32)

        @functools.partial(pl.run_scoped, **accs)
        def _acc_scope(acc_ref, up_ref=None):
          @pl.when(group >= 0)  # a zero item keeps the zero accumulator
          def _():
            @pl.loop(0, k_iters)
            def _k(kk):
              slot = lax.rem(step + kk, stages)
              plgpu.barrier_wait(produced.at[slot])
              if gate is None:
                wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot], wg)
              else:
                wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot, 0], wg)
                wgmma(up_ref, a_smem.at[slot], b_smem.at[slot, 1], wg)
              plgpu.wgmma_wait(0)
              plgpu.barrier_arrive(consumed.at[slot])

          def store(dst_gmem, col_offset=0):
            def one(slot_smem, i, jj):
              sub_row0 = row0 + m0 + i * epi_m
              col0 = ni * bn + n0 + jj * epi_n
              # Gated: a sub-tile at column F or past it (of the gate's tile) holds no
              # output column (epi_block_n divides F: it holds none or all of its columns
              # below F); it stores no row (every sub-tile still commits its group).
              top = hi if gate is None else jnp.where(col0 < n, hi, lo)
              store_rows(slot_smem, dst_gmem, row0=sub_row0,
                         col0=col_offset + col0 if col_offset else col0, lo=lo, hi=top)
            return one

          if gate is None:
            store_subtiles(acc_ref[...], out_smem, wg, store(out_gmem))
          else:
            gate_acc, up_acc = acc_ref[...], up_ref[...]
            store_subtiles(epilogue.activate(gate_acc, gate.activation) * up_acc, out_smem, wg,
                           store(out_gmem))
            if gate.write_h:
              store_subtiles(gate_acc, out_smem, wg, store(h_gmem))
              store_subtiles(up_acc, out_smem, wg, store(h_gmem, gate.f))

        return step + jnp.where(group >= 0, k_iters, 0)

      lax.fori_loop(0, local_work, mma_item, jnp.int32(0))

  del _scope  # run_scoped ran it
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def check_operands(lhs, rhs, group_sizes, *, transpose_rhs: bool):
  """(M, K, N, G) of a forward call; ValueError/TypeError naming a bad argument."""
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise ValueError(f"lhs must be (M, K) and rhs (G, K, N), got lhs.shape={lhs.shape},"
                     f" rhs.shape={rhs.shape}")
  if jnp.dtype(lhs.dtype) not in DTYPES or rhs.dtype != lhs.dtype:
    raise TypeError(f"lhs and rhs must both be bfloat16 or both float16, got"
                    f" lhs.dtype={lhs.dtype}, rhs.dtype={rhs.dtype}")
  m, k = lhs.shape
  g, k_rhs, n = rhs.shape
  if transpose_rhs:
    n, k_rhs = k_rhs, n
  if k_rhs != k:
    raise ValueError(f"rhs's K={k_rhs} (rhs.shape={rhs.shape}, {transpose_rhs=}) must equal"
                     f" lhs's K={k} (lhs.shape={lhs.shape})")
  if group_sizes.ndim != 1 or group_sizes.shape[0] < g:
    raise ValueError(f"group_sizes must be (G,) with G >= rhs.shape[0]={g}, got"
                     f" group_sizes.shape={group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"group_sizes must be integers, got group_sizes.dtype={group_sizes.dtype}")
  return m, k, n, g


def forward(lhs, rhs, group_sizes, group_offset=None, *, transpose_rhs: bool = False,
            out_dtype=None, config: Config | None = None,
            interpret: bool | plgpu.InterpretGPUParams = False):
  """out (M, N): out[rows of group g] = lhs[rows of g] @ rhs[g]; other rows are zeros.

  lhs: (M, K) bf16/f16; rhs: (G, K, N), or (G, N, K) with transpose_rhs (read in place).
  group_sizes: (G,) int, traced: the groups' rows are consecutive from row 0; rows past
  their sum are zeros. With more than G entries, the rows of lhs are laid out for all of
  them and this call computes groups [group_offset, group_offset + G) (see `local_rows`).
  f32 accumulation; out_dtype defaults to lhs's dtype.
  """
  m, k, n, g = check_operands(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
  dtype = jnp.dtype(lhs.dtype)
  out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
  if config is None:
    config = default_config(m, n, k, g, dtype, out_dtype=out_dtype)
  if m == 0 or n == 0 or k == 0 or g == 0:
    return jnp.zeros((m, n), out_dtype)
  return _launch(lhs, rhs, group_sizes, group_offset, m=m, k=k, n=n, out_dtype=out_dtype,
                 config=config, interpret=interpret, transpose_rhs=transpose_rhs)


def gated_forward(lhs, rhs, group_sizes, group_offset=None, *, activation: str,
                  write_h: bool = False, config: Config | None = None,
                  interpret: bool | plgpu.InterpretGPUParams = False):
  """(a, h) per group g: h = lhs[rows of g] @ rhs[g] (M, 2F), rhs[g] = [gate | up]
  (K, 2F), and a = act(h[:, :F]) * h[:, F:] (M, F), act from the f32 accumulators
  (`core.epilogue.ACTIVATIONS[activation]`); both in lhs's dtype, rows of no group zeros.
  h is None unless write_h (then the kernel stores it beside a). F must be a multiple of
  64 (ValueError otherwise: up's columns must start on a TMA tile). group_sizes and
  group_offset as `forward`'s. activation: a name of `core.epilogue.GATES`."""
  m, k, two_f, g = check_operands(lhs, rhs, group_sizes, transpose_rhs=False)
  f = two_f // 2
  if activation not in epilogue.GATES:
    raise ValueError(f"gated_forward: activation must be one of {epilogue.GATES}; got"
                     f" {activation!r}")
  if two_f % 128:
    raise ValueError(f"gated_forward: rhs must be (G, K, 2F) with F a multiple of 64; got"
                     f" rhs.shape={rhs.shape}")
  dtype = jnp.dtype(lhs.dtype)
  if config is None:
    config = default_config(m, f, k, g, dtype, gated=True)
  if f and f % config.epi_block_n:
    raise ValueError(f"gated_forward: config.epi_block_n={config.epi_block_n} must divide"
                     f" F={f} (a sub-tile holds columns of one half, gate or up)")
  if m == 0 or k == 0 or g == 0 or f == 0:
    zeros = jnp.zeros((m, two_f), dtype)
    return zeros[:, :f], (zeros if write_h else None)
  gate = Gate(activation=activation, f=f, write_h=write_h)
  outs = _launch(lhs, rhs, group_sizes, group_offset, m=m, k=k, n=f, out_dtype=dtype,
                 config=config, interpret=interpret, transpose_rhs=False, gate=gate)
  return (outs[0], outs[1]) if write_h else (outs, None)


def _launch(lhs, rhs, group_sizes, group_offset, *, m, k, n, out_dtype, config, interpret,
            transpose_rhs, gate: Gate | None = None):
  """The kernel call of `forward` / `gated_forward` (checked operands, m, n, k, g > 0)."""
  dtype = jnp.dtype(lhs.dtype)
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  config.check_tiles(bm)
  check_row_stores(config.epi_block_n, out_dtype, "ragged_dot")
  b_cols = bn if gate is None else 2 * bn  # gated: two rhs tiles per step
  check_smem(config, a_tile=(bm, bk), b_tile=(bk, b_cols), dtype=dtype, out_dtype=out_dtype,
             k_steps=-(-k // bk))

  starts, ends = local_rows(group_sizes, group_offset, rhs.shape[0], m)
  items, count = row_items(starts, ends, m, bm)
  lhs = pad_for_tma(lhs, tma_tile(bk, dtype), bk)
  rhs_minor = bk if transpose_rhs else bn
  rhs = pad_for_tma(rhs, tma_tile(rhs_minor, dtype), rhs_minor)
  # Rows: any (the slots are tiled by single rows). Columns: whole swizzle widths, and at
  # least one block: as for the gemm kernel
  # (`layout.pad_for_tma`), an output narrower than the block computes wrong results
  # on the GPU (N = 40 with 128-column blocks) though the interpreter gets them right.
  def width(cols):
    return max(round_up(cols, tma_tile(config.epi_block_n, out_dtype)[1]), bn)

  n_out = width(n)
  out_type = jax.ShapeDtypeStruct((m, n_out), out_dtype)
  if gate is not None and gate.write_h:
    out_type = (out_type, jax.ShapeDtypeStruct((m, width(2 * n)), out_dtype))
  ctas = num_ctas(config, bool(interpret))
  body = functools.partial(_kernel, config=config, k=k, n=n, transpose_rhs=transpose_rhs,
                           num_ctas=ctas, **({} if gate is None else dict(gate=gate)))
  kernel = launch.warpgroup_kernel(
      body, out_type=out_type, num_ctas=ctas, num_compute_wgs=config.num_compute_wgs,
      kernel_name="pallas_gemm_ragged_forward" if gate is None
      else "pallas_gemm_ragged_gated_forward")
  outs = launch.call(kernel, items, count, lhs, rhs, interpret=interpret)
  if isinstance(outs, (tuple, list)):
    return tuple(o if o.shape[1] == w else o[:, :w] for o, w in zip(outs, (n, 2 * n)))
  return outs if n_out == n else outs[:, :n]
