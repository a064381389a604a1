"""One-pass 1x128 and 128x128 quantize on Hopper (sm_90) in Pallas Mosaic GPU.

``quantize_rows(x, dtype)`` is `quantize.quantize(x, dtype, block_shape=(1, 128))` for x
(R, K) with R a multiple of 8 and K of 128, and ``quantize_rows(x, dtype, block_rows=128)``
its block_shape=(128, 128) for R a multiple of 128: bitwise the same values and scales,
from one read of x. With read_transposed, x is (K, R) (or (B, K, R / B), R / B a multiple
of 128) and the values and scales are those of its (batch entries') transpose. XLA
computes the same thing in two kernels (the blocks' amax, then the scaled cast), which
read x twice; this kernel reads each block into registers once, takes its amax there and
writes its fp8 values and scale.

Design (persistent, one CTA per SM, warp-specialized like the GEMMs, `mgpu.ring`):
  * Work: (128, 128) tiles of the quantized operand (x, or read transposed x^T), row
    tile-major, CTA c taking tiles c, c + num_ctas, ...
    One warp of a producer warpgroup loads them by TMA into a ring of 128 KiB;
    several tiles in flight per SM are what keep HBM busy.
  * 1x128 blocks: two consumer warpgroups each take 64 rows of a tile into registers
    (the wgmma layout: a row's 128 values lie in 4 threads of a warp, so its amax is 32
    maxes in a thread and two shuffles), compute the row's scale exactly as
    `quantize._quantize` does (bit operations on float32: no rounding anywhere but the
    cast to fp8), and write the fp8 values and the (64,) scales into shared memory,
    which TMA stores to the values (R, K) and to the scales transposed, (K / 128, R): a
    block's scales are a contiguous run of rows there (the layout the GEMM kernel reads
    its lhs scales in; `quantize_rows` returns them as (R, K / 128)).
  * 128x128 blocks: a tile is one block, so one consumer warpgroup takes the whole
    tile (its amax is the max of the 128 rows' maxes, a reduction across the
    warpgroup's warps) and stores the block's scale on each of its rows, in the same
    layout; `quantize_rows` keeps one row per block. A warpgroup holds 128 values per
    thread, within the 256 registers a lone consumer gets.
  * Read transposed (`quantize(x, transpose=True)`: the weight gradient's operands,
    quantized along what were x's rows): the tile is x's (K, R) block, and each
    warpgroup loads its rows of the quantized operand (columns of the tile) through a
    transposed view of the tile, in the transposed wgmma layout, which a shuffle of 2x2
    pairs between lane pairs takes to the wgmma layout; the rest is the same. No
    transposed copy of x is written (XLA's transpose wrote and read x's bytes once more).
  * Not done here: a weight's values written in both layouts from one read (128x128
    blocks, the second read of the tile through the transposed view): on an H200 it ran
    0.75x quantize and then XLA's transpose of the fp8 values (2.0-2.1 TB/s against
    3.7-3.9), its one warpgroup busy with twice the arithmetic.
  * Rows past R (read in place): TMA reads zeros and clips the stores. Read transposed,
    every tile is whole.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.fp8.scales import pow2, saturation, scale_exponent
from pallas_gemm.mgpu import launch, ring
from pallas_gemm.mgpu.layout import swizzle_transforms

BLOCK = 128  # the scale block along K, and a tile's K extent
BLOCK_ROWS = 128  # rows of a tile: 64 per consumer warpgroup (1x128), or all of them
NUM_WGS = 2
RING_BYTES = 128 * 1024  # x tiles in flight per SM: 4 of bf16 / f16, 2 of f32
OUT_SLOTS = 2  # shared-memory output buffers per consumer warpgroup
INPUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def supports(shape, x_dtype, block_rows: int = 1) -> bool:
  """Whether `quantize_rows` takes an x of this (R, K) shape and dtype in blocks of
  block_rows x 128."""
  r, k = shape
  return (np.dtype(x_dtype) in INPUT_DTYPES and block_rows in (1, BLOCK_ROWS) and r > 0
          and r % max(8, block_rows) == 0 and k > 0 and k % BLOCK == 0)


def row_scales(x, dtype, whole_tile: bool):
  """(scale exponent e per row, x scaled and clipped) for x (rows, 128) float32, with
  `quantize._quantize`'s arithmetic (its `scale_exponent` and `saturation`): one block
  per row, or with whole_tile one block of all of x (every row gets its exponent)."""
  ax = jnp.abs(x)
  amax = jnp.max(jnp.where(ax < np.float32(np.inf), ax, 0.0), axis=1)  # inf, NaN: 0
  if whole_tile:  # amax is finite and >= 0, so amax * 0 is 0: the tile's amax on each row
    amax = amax * np.float32(0) + jnp.max(amax)
  e = scale_exponent(amax, dtype)
  inverse = pow2(-e)
  limit = saturation(e, dtype)
  scaled = x * lax.broadcast_in_dim(inverse, x.shape, [0])
  limit = lax.broadcast_in_dim(limit, x.shape, [0])
  return e, jnp.minimum(jnp.maximum(scaled, -limit), limit)


def _num_consumers(block_rows: int) -> int:
  """Consumer warpgroups per CTA: two of 64 rows each for 1x128 blocks, one for 128x128
  (a block's rows in one warpgroup)."""
  return NUM_WGS if block_rows == 1 else 1


def _kernel(x_gmem, values_gmem, scales_gmem, *, dtype, rows: int, batch_rows: int,
            k_blocks: int, num_ctas: int, block_rows: int, read_transposed: bool):
  """values_gmem (R, K) fp8 and scales_gmem (K / 128, R') f32 of x_gmem (R, K), or with
  read_transposed of x_gmem (B, K, R / B) read transposed (R = B * batch_rows)."""
  num_wgs = _num_consumers(block_rows)
  stages = RING_BYTES // (BLOCK_ROWS * BLOCK * x_gmem.dtype.itemsize)
  row_tiles = pl.cdiv(rows, BLOCK_ROWS)
  tiles = row_tiles * k_blocks
  cta = lax.axis_index("sm")
  local_tiles = lax.div(tiles - cta + num_ctas - 1, num_ctas)
  wg_rows = BLOCK_ROWS // num_wgs

  def coords(j):  # the CTA's j-th tile -> (row tile, k block)
    t = cta + j * num_ctas
    return lax.div(t, k_blocks), lax.rem(t, k_blocks)

  def rk(ref, ri, kj):  # the (row tile, k block) tile of an (R, K) ref
    return ref.at[pl.ds(ri * BLOCK_ROWS, BLOCK_ROWS), pl.ds(kj * BLOCK, BLOCK)]

  batch_tiles = batch_rows // BLOCK_ROWS  # read transposed: whole tiles per batch entry

  def kr(ref, ri, kj):  # the same tile of a (B, K, R / B) ref
    b, ri = lax.div(ri, batch_tiles), lax.rem(ri, batch_tiles)
    return ref.at[b, pl.ds(kj * BLOCK, BLOCK), pl.ds(ri * BLOCK_ROWS, BLOCK_ROWS)]

  scoped = dict(
      x_smem=plgpu.SMEM((stages, BLOCK_ROWS, BLOCK), x_gmem.dtype,
                        transforms=swizzle_transforms(BLOCK, x_gmem.dtype)),
      values_smem=plgpu.SMEM((num_wgs, OUT_SLOTS, wg_rows, BLOCK), dtype,
                             transforms=swizzle_transforms(BLOCK, dtype)),
      scales_smem=plgpu.SMEM((num_wgs, OUT_SLOTS, wg_rows), jnp.float32),
      produced=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=num_wgs, num_barriers=stages),
  )

  def read(tile_smem, rows_here):  # (len(rows_here), 128) of the quantized operand
    if not read_transposed:
      return plgpu.load(tile_smem.at[rows_here], layout=plgpu.Layout.WGMMA)
    # The tile holds (K, R): its columns are our rows. A transposed view loads in the
    # transposed wgmma layout; a shuffle of 2x2 pairs takes it to the wgmma layout.
    x = plgpu.load(tile_smem.at[:, rows_here].transpose((1, 0)),
                   layout=plgpu.Layout.WGMMA_TRANSPOSED)
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(x_smem, values_smem, scales_smem, produced, consumed):
    wg = lax.axis_index("wg")

    @ring.producer_warp(wg, num_wgs)
    def _loads():
      def load(j, slot):
        ri, kj = coords(j)
        plgpu.copy_gmem_to_smem((kr if read_transposed else rk)(x_gmem, ri, kj),
                                x_smem.at[slot], produced.at[slot])

      ring.fill(consumed, 0, local_tiles, step=lambda j: j, stages=stages, load=load)
      ring.drain(consumed, local_tiles, stages=stages)

    @ring.consumer_warpgroups(wg, num_wgs)
    def _consumers():
      my_rows = pl.ds(wg * wg_rows, wg_rows)

      @pl.loop(0, local_tiles)
      def _tile(j):
        ri, kj = coords(j)
        slot = lax.rem(j, stages)
        out = lax.rem(j, OUT_SLOTS)
        plgpu.barrier_wait(produced.at[slot])
        x = read(x_smem.at[slot], my_rows)
        plgpu.barrier_arrive(consumed.at[slot])
        e, q = row_scales(x.astype(jnp.float32), dtype, whole_tile=block_rows > 1)
        # The stores from OUT_SLOTS tiles ago must have read this slot.
        plgpu.wait_smem_to_gmem(OUT_SLOTS - 1, wait_read_only=True)
        values_smem[wg, out] = q.astype(dtype)
        scales_smem[wg, out] = pow2(e)
        plgpu.commit_smem()
        row0 = ri * BLOCK_ROWS + wg * wg_rows
        plgpu.copy_smem_to_gmem(values_smem.at[wg, out],
                                values_gmem.at[pl.ds(row0, wg_rows), pl.ds(kj * BLOCK, BLOCK)])
        plgpu.copy_smem_to_gmem(scales_smem.at[wg, out], scales_gmem.at[kj, pl.ds(row0, wg_rows)])

  del _scope
  plgpu.wait_smem_to_gmem(0)


def quantize_rows(x, dtype, *, block_rows: int = 1, read_transposed: bool = False,
                  num_sms: int | None = None, interpret=False):
  """(values (R, K) dtype, scales (R / block_rows, K / 128) f32) of x (R, K), `supports`
  it: each 1x128 (block_rows=1) or 128x128 (block_rows=128) block scaled by a power of
  two, as `quantize.quantize` does. read_transposed: x is (K, R), or (B, K, R / B) with
  R / B a multiple of 128 (whole tiles along x's last dim), and its (batch entries')
  transpose is quantized, read in place: no transposed copy of x."""
  if x.ndim not in ((2, 3) if read_transposed else (2,)):
    takes = "(K, R) or (B, K, R / B)" if read_transposed else "(R, K)"
    raise ValueError(f"x must be {takes} with read_transposed={read_transposed}; got shape"
                     f" {x.shape}")
  x3 = x[None] if read_transposed and x.ndim == 2 else x
  if read_transposed:
    b, k, batch_rows = x3.shape
    r = b * batch_rows
  else:
    (r, k), batch_rows = x.shape, x.shape[0]
  if not supports((r, k), x.dtype, block_rows):
    raise ValueError(f"x: shape {x.shape} / {x.dtype} with read_transposed={read_transposed};"
                     f" quantize_rows takes float32, bfloat16 or float16 with R (rows of the"
                     f" quantized operand) a multiple of {max(8, block_rows)} and K of 128,"
                     f" block_rows 1 or 128 (got {block_rows})")
  if read_transposed and batch_rows % BLOCK_ROWS:
    raise ValueError(f"x: shape {x.shape} read transposed: its last dim must be a multiple"
                     f" of {BLOCK_ROWS} (whole tiles)")
  dtype = jnp.dtype(dtype)
  k_blocks = k // BLOCK
  num_ctas = launch.grid_sms(num_sms, interpret, need_gpu=True)
  # The scales' rows padded to whole tiles: every warpgroup's (64,) or (128,) TMA store
  # lies inside. With 128x128 blocks each row holds its block's scale, and one row in
  # 128 is kept (a strided copy of R/32 bytes per 128 columns: 3% of the values').
  r_all = -(-r // BLOCK_ROWS) * BLOCK_ROWS
  body = functools.partial(_kernel, dtype=dtype, rows=r, batch_rows=batch_rows,
                           k_blocks=k_blocks, num_ctas=num_ctas, block_rows=block_rows,
                           read_transposed=read_transposed)
  out_type = (jax.ShapeDtypeStruct((r, k), dtype),
              jax.ShapeDtypeStruct((k_blocks, r_all), jnp.float32))
  kernel = launch.warpgroup_kernel(
      body, out_type=out_type, num_ctas=num_ctas,
      num_compute_wgs=_num_consumers(block_rows), kernel_name="pallas_gemm_quantize_fp8")
  values, scales_t = launch.call(kernel, x3, interpret=interpret)
  return values, scales_t[:, :r:block_rows].T
