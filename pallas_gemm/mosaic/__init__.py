"""Hopper (sm_90) GEMM written in Pallas on the Mosaic GPU backend.

Design (one CTA per SM, persistent):
  * Grid: ``num_sms`` CTAs; each walks the flattened (batch, m_tiles, n_tiles)
    space strided by the CTA count. Optionally CTAs pair up in clusters of 2 that
    compute adjacent tiles and multicast the operand tile they share
    (``Config.cluster_m`` / ``cluster_n``). Within a batch entry the output tiles
    are visited in this order: ``plgpu.planar_snake`` bands of
    ``grid_tile_width`` tiles along ``grid_minor_dim``, so CTAs that run together
    share A rows / B columns in L2.
  * Stream-K (``Config.stream_k``): when the tiles leave the last round of CTAs
    idle enough to pay for it, the last tiles are cut into equal ranges of K
    steps, one per CTA, and a tile cut between CTAs is summed through an f32
    buffer in global memory, ordered by Pallas global semaphores
    (``stream_k_schedule``, ``StreamK``, ``_warp_producer_kernel``).
  * K pipeline: a ``stages``-deep ring of swizzled shared-memory buffers for
    (block_m, block_k) A tiles and (block_k, block_n) B tiles (tiling/swizzle
    transforms), filled by TMA. ``Config.producer`` picks who issues the loads:
    one warp of the producer warpgroup, in one loop over all of the CTA's
    (tile, K block) steps (default), or ``plgpu.emit_pipeline_warp_specialized``
    over ``plgpu.BlockSpec``s (the whole producer warpgroup, one pipeline per
    tile, consecutive pipelines chained with ``plgpu.PipelinePipeline`` where K
    allows it). ``num_compute_wgs`` consumer warpgroups each own a slice of the
    CTA tile (split along ``wg_split``) and run ``plgpu.wgmma`` into an f32
    register accumulator.
  * Epilogue (consumer warpgroups, overlapped with the producer already loading
    the next tile): the partial sum of a stream-K tile's other K range is added,
    the accumulator is scaled by alpha, beta*C is added (C
    fetched by TMA into shared memory), the result is cast to the out dtype,
    written to a double-buffered shared-memory slot and stored with TMA in
    (epi_block_m, epi_block_n) sub-tiles.

Shapes, edges and layouts (costs in parentheses):
  * Ragged M, N, K: TMA loads zero-fill out-of-bounds parts of a tile and TMA
    stores clip them, so aligned inputs are never copied.
  * Mosaic GPU describes a swizzled TMA through a tiled view of the whole
    global array, (rows/8, cols/swizzle_elems, 8, swizzle_elems), so an
    operand's last two dims must be multiples of (8, swizzle_elems) (64
    elements for 16-bit, 32 for f32), which also gives TMA's 16-byte row
    stride. An operand that is not (e.g. bf16 4097 x 4097) is zero-padded by
    ``jnp.pad`` (one extra read+write of it); a misaligned output is computed
    into a padded buffer and sliced (one extra read+write of the output, by
    a Pallas Triton copy kernel where available: XLA's slice is 3x slower).
    Operands already aligned are passed through untouched.
  * Batch: folded into the persistent tile loop (no Python loop, one launch).
    batch_b == 1 shares one B among all batch entries with no copy.
  * transpose_a / transpose_b with 16-bit inputs: native. The shared-memory tile
    is loaded in the stored layout and handed to wgmma through ``.T``, which
    wgmma supports for 16-bit types (no copy).
  * f32 inputs run as TF32 (refused for Precision.HIGHEST). wgmma reads 32-bit
    operands only K-major, so B is consumed as (N, K) and A as (M, K): with
    transpose_b=False (or transpose_a=True) that operand is copied once with
    ``jnp.swapaxes`` (one extra read+write of it, ~8% of a 4096^3 TF32 GEMM).
  * float32 from bf16 pieces (``precision="float32_accurate"`` and the BF16_BF16_F32_X*
    presets, `precision.Split`): one XLA fusion writes both operands' bf16 pieces
    before the kernel (1.5x the f32 bytes for 3 pieces), three arrays per operand in
    its stored layout, passed as three kernel operands; every pipeline stage loads all
    piece tiles by TMA, and each K block's piece products go into a zeroed accumulator
    that is added to an f32 register sum. An MN-major operand's piece tiles take the
    K-major tile's 64-byte swizzle (wgmma wants one swizzle on both operands), so no
    operand is transposed. The pieces used to be made inside the kernel from f32 tiles
    (no extra HBM pass): the split, its shared-memory stores and the wait before the
    products held that kernel at 1.35x SGEMM (H100, session 8). Measured on the H200
    (`probe.py split_kernels`): with the pieces stacked in one K-major array XLA wrote
    f32 transposed copies first and a second pass for the stack, 20-25% of a call at
    4096^3 / 4097^3 (session 12); three arrays in the stored layout take one pass for
    both operands, 0.083 ms of a 1.106 ms call at 4096^3 (session 13). The kernel's six
    bf16 products run at cuBLAS's bf16 rate at 8192^3: 2.1-2.2x SGEMM.
  * float32 from float16 pieces (``precision="float32_f16x3"``, `_scaled_split`): A's rows
    and B's columns are scaled by powers of two into float16's range, and the same kernel
    runs two float16 pieces per operand and three products. The f32 result is then scaled
    back and the epilogue runs in XLA. On the H200 this is 3.5x / 3.8x / 2.9x SGEMM at
    4096^3 / 8192^3 / 4097^3 (session 14).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.epilogue import activate, apply, derivative
from pallas_gemm import precision as _precision
from pallas_gemm import tuning
from pallas_gemm.mosaic.layout import (_pad_for_tma, _round_up, _swizzle_transforms, _tma_padded_shape,
                                        _tma_tile, _unpad)

NAME = "mosaic"
# The bias and these activations run in the kernel's epilogue. Not gelu_exact: with
# Mosaic GPU's erf lowering its test failed on the H200 (session 7, run 3: the log was
# cut by a timeout before the report, so why is not known yet);
# op.py applies it in XLA after the kernel's f32 result (bias still fused).
FUSED_ACTIVATIONS = (None, "relu", "gelu", "silu")
# c_gate: the epilogue multiplies by act'(C) in place of adding beta * C (op.py's gated
# backward GEMM); the same functions as above, and erf's derivative needs erf.
FUSED_GATES = ("relu", "gelu", "silu")
# keep_pre: the epilogue also stores the pre-activation z beside act(z) (op.Plan.keep_pre).
KEEPS_PRE = True

# Shared memory per block on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SMEM_BYTES_PER_BLOCK = 232448
# Mosaic GPU reserves this much for cross-warp reductions (CompilerParams).
_RESERVED_SMEM_BYTES = 128 * 4 * 4
# SM count used by interpret mode (the CPU has none) when Config.num_sms is None.
_INTERPRET_NUM_SMS = 4
# Registers per thread left to the producer warpgroup (setmaxnreg).
_PRODUCER_REGISTERS = 40

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                     jnp.dtype(jnp.float16))


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tuning parameters of the Mosaic GPU kernel.

  block_m, block_n: the CTA output tile. It is split among the consumer
    warpgroups along ``wg_split``; each warpgroup's part is a wgmma accumulator
    of (block_m / num_compute_wgs, block_n) or (block_m, block_n /
    num_compute_wgs) f32 values.
  block_k: K per pipeline step. block_k * itemsize must be a multiple of 32
    bytes (swizzle); 64 (16-bit) or 32 (f32) gives the 128-byte swizzle. With an
    FP32 split the tiles are bf16 pieces: a multiple of 16 (32 gives 64-byte rows).
  stages: depth of the TMA ring (``max_concurrent_steps``).
  num_compute_wgs: consumer warpgroups (1 or 2); one producer warpgroup is added.
  wg_split: "m" or "n", the dimension of the CTA tile split among warpgroups.
  grid_minor_dim, grid_tile_width: output tile order (``plgpu.planar_snake``):
    bands of ``grid_tile_width`` tiles along ``grid_minor_dim``.
  epi_block_m, epi_block_n: sub-tile of the epilogue (shared memory -> TMA
    store), double-buffered per consumer warpgroup.
  wgmma_wait: wgmma groups left in flight at the end of a K step (0 or 1). 1
    overlaps consecutive wgmmas and delays the release of a stage by one step.
  producer: who issues the TMA loads of the K pipeline.
    "warp" (default): one warp of the producer warpgroup runs a single loop over
    all of the CTA's (tile, K block) steps through one ring of ``stages`` buffers
    (``plgpu.warp_map``; the next tile's loads start as soon as a buffer frees,
    during the previous tile's epilogue). "warpgroup": the K pipeline of each tile
    is ``plgpu.emit_pipeline_warp_specialized`` over ``plgpu.BlockSpec``s, whose
    producer runs in all 128 threads of the warpgroup (consecutive tiles' pipelines
    chained with ``plgpu.PipelinePipeline`` where K allows it). Same tiles and
    barriers; "warp" issues ~25% fewer instructions and measured 0.5-0.9% faster
    on the H200 (bf16 4096^3 / 8192^3, f16 8192^3).
  cluster_m, cluster_n: CTAs per cluster along m or n (1 or 2, not both 2).
    The two CTAs of a cluster_m=2 cluster compute vertically adjacent tiles
    that share their B tiles: each CTA loads half of every B tile and TMA
    multicasts it to both, halving B's L2->SM traffic (cluster_n=2: A's).
  num_sms: CTAs of the persistent grid. None: the device's SM count on GPU, 4
    in interpret mode.
  stream_k: cut the last tiles into K ranges (``producer="warp"`` only; None: on
    with the warp producer, off with the warpgroup one). When the tiles leave the
    last round of CTAs idle enough (bf16 8192^3: 1024 cluster tiles on 66
    clusters, 15.5 rounds), every CTA first runs the full rounds as whole tiles,
    then an equal range of (tile, K block) steps of the rest (the partial round, and
    the last full one if the partial one is under half a round), so that all CTAs
    finish together. A tile cut between CTAs is summed through global memory (see
    ``_warp_producer_kernel``), which costs more than it saves when the last round
    is nearly full (bf16 4096^3: 3.88 rounds): ``stream_k_schedule`` decides per
    launch. Interpret mode runs whole tiles: its interpreter has no global
    semaphores (jax 0.11.2).
  pingpong: each of the two consumer warpgroups computes whole CTA tiles, taking
    the CTA's tiles in turn (CUTLASS's "ping-pong" schedule), instead of both
    sharing every tile. The producer loads the tiles' K steps in order through the
    one ring, so one warpgroup's main loop runs while the other's epilogue (alpha,
    C, bias, activation, stores) does: the tensor cores do not wait for the epilogue.
    A warpgroup then holds a whole tile's accumulator (at most 128 x 128, 128 f32
    registers per thread). Needs producer="warp" and no stream-K or FP32 split, and
    wgmma_wait=1 (with 0, one warpgroup alone leaves the tensor cores idle between K
    steps: 0.72x). Off by default: on the H200 (session 14) 128x128 pingpong tiles ran
    plain bf16 products 3% slower than the 256x128 cooperative ones (they move 1.5x
    the operand bytes per FLOP), and the MLP step's two epilogue-heavy GEMMs (GELU + z,
    gelu'(C)), 1-2% faster called in turn with jnp.dot, were 1-1.5% slower inside the
    step (`probe.py step_kernels`).
  """

  block_m: int = 128
  block_n: int = 256
  block_k: int = 64
  stages: int = 4
  num_compute_wgs: int = 2
  wg_split: Literal["m", "n"] = "n"
  grid_minor_dim: Literal["m", "n"] = "n"
  grid_tile_width: int = 8
  epi_block_m: int = 64
  epi_block_n: int = 64
  wgmma_wait: int = 0
  producer: Literal["warp", "warpgroup"] = "warp"
  cluster_m: int = 1
  cluster_n: int = 1
  num_sms: int | None = None
  stream_k: bool | None = None
  pingpong: bool = False

  def __post_init__(self):
    def fail(field, why):
      raise ValueError(
          f"Config.{field}={getattr(self, field)!r} is invalid: {why}")

    for field in ("block_m", "block_n", "block_k", "stages", "num_compute_wgs",
                  "grid_tile_width", "epi_block_m", "epi_block_n", "cluster_m",
                  "cluster_n"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        fail(field, "must be a positive int")
    if self.num_compute_wgs not in (1, 2):
      fail("num_compute_wgs", "must be 1 or 2 (1 producer + at most 2 consumer"
           " warpgroups fit the register file with these accumulators)")
    if self.wg_split not in ("m", "n"):
      fail("wg_split", "must be 'm' or 'n'")
    if self.grid_minor_dim not in ("m", "n"):
      fail("grid_minor_dim", "must be 'm' or 'n'")
    if self.wgmma_wait not in (0, 1):
      fail("wgmma_wait", "must be 0 or 1")
    if self.producer not in ("warp", "warpgroup"):
      fail("producer", "must be 'warp' or 'warpgroup'")
    if self.stream_k is not None and not isinstance(self.stream_k, bool):
      fail("stream_k", "must be None or a bool")
    if self.stream_k and self.producer != "warp":
      fail("stream_k", "needs producer='warp' (the warpgroup producer's pipelines"
           " run whole tiles)")
    if not isinstance(self.pingpong, bool):
      fail("pingpong", "must be a bool")
    if self.pingpong:
      if self.num_compute_wgs != 2 or self.producer != "warp" or self.stream_k:
        fail("pingpong", "needs num_compute_wgs=2, producer='warp' and stream_k off"
             " (the two warpgroups take whole tiles in turn from the warp producer's ring)")
      if self.block_m * self.block_n > 128 * 128:
        fail("pingpong", f"gives each warpgroup a {self.block_m}x{self.block_n} f32"
             " accumulator; at most 128x128 (128 registers per thread) leaves room"
             " for the epilogue")
    if self.cluster_m not in (1, 2) or self.cluster_n not in (1, 2):
      fail("cluster_m" if self.cluster_m not in (1, 2) else "cluster_n",
           "must be 1 or 2")
    if self.cluster_m == self.cluster_n == 2:
      fail("cluster_n", "a cluster spans 2 CTAs along m or along n, not both")
    if self.stages <= self.wgmma_wait:
      fail("stages", f"must exceed wgmma_wait={self.wgmma_wait} (a stage is"
           " released only after its wgmma completed)")
    if self.num_sms is not None and (
        not isinstance(self.num_sms, int) or self.num_sms < self.cluster_size):
      fail("num_sms", f"must be None or an int >= the cluster size"
           f" {self.cluster_size}")
    wg_m, wg_n = self.wg_block_m, self.wg_block_n
    split = self.block_m if self.wg_split == "m" else self.block_n
    if split % self.num_compute_wgs and not self.pingpong:
      fail(f"block_{self.wg_split}", f"must divide evenly among"
           f" num_compute_wgs={self.num_compute_wgs} warpgroups")
    if wg_m % 64:
      fail("block_m", f"gives a warpgroup tile of {wg_m} rows; wgmma needs a"
           " multiple of 64 rows per warpgroup")
    if wg_n % 8 or wg_n > 256:
      fail("block_n", f"gives a warpgroup tile of {wg_n} columns; wgmma needs"
           " a multiple of 8, at most 256")
    if self.block_m > 256 or self.block_n > 256:
      fail("block_m" if self.block_m > 256 else "block_n",
           "a TMA box dimension is at most 256 elements")
    if self.block_k % 8 or self.block_k > 256:
      fail("block_k", "must be a multiple of 8 (wgmma K step) and at most 256")
    if self.epi_block_m % 64 or wg_m % self.epi_block_m:
      fail("epi_block_m", f"must be a multiple of 64 (wgmma register layout)"
           f" dividing the warpgroup tile's {wg_m} rows")
    if self.epi_block_n % 16 or wg_n % self.epi_block_n:
      fail("epi_block_n", f"must be a multiple of 16 (a swizzled smem row is"
           f" at least 32 bytes) dividing the warpgroup tile's {wg_n} columns")
    if self.block_n % 16:
      fail("block_n", "must be a multiple of 16 (a swizzled smem row of B is"
           " at least 32 bytes)")

  @property
  def wg_block_m(self) -> int:
    """Rows of one consumer warpgroup's accumulator."""
    if self.wg_split == "m" and not self.pingpong:
      return self.block_m // self.num_compute_wgs
    return self.block_m

  @property
  def wg_block_n(self) -> int:
    """Columns of one consumer warpgroup's accumulator."""
    if self.wg_split == "n" and not self.pingpong:
      return self.block_n // self.num_compute_wgs
    return self.block_n

  @property
  def uses_stream_k(self) -> bool:
    """stream_k, or for None: whether the producer is the warp producer (not pingpong)."""
    if self.stream_k is None:
      return self.producer == "warp" and not self.pingpong
    return self.stream_k

  @property
  def cluster_size(self) -> int:
    return self.cluster_m * self.cluster_n

  @property
  def out_slots(self) -> int:
    """Epilogue buffers per warpgroup (one if a single sub-tile covers it)."""
    sub_tiles = (self.wg_block_m // self.epi_block_m) * (
        self.wg_block_n // self.epi_block_n)
    return min(2, sub_tiles)

  replace = dataclasses.replace


def smem_bytes(config: Config, dtype, out_dtype, c_dtype=None,
               k: int | None = None, split: _precision.Split | None = None) -> int:
  """Shared memory one CTA of the kernel allocates (an upper bound).

  c_dtype: dtype of C, None when C is not read. A C of the out dtype is staged
  in the output buffer; another dtype needs its own buffer.
  k: the problem's K, which caps the ring at ceil(K / block_k) stages.
  split: the FP32 emulation's bf16 split (its ring holds split.pieces bf16 tiles of each
    operand per stage), or None.
  """
  itemsize = jnp.dtype(dtype).itemsize if split is None else 2 * split.pieces
  stages = config.stages
  if k is not None:
    stages = min(stages, -(-k // config.block_k))
  ring = stages * (config.block_m * config.block_k
                   + config.block_k * config.block_n) * itemsize
  epi = config.epi_block_m * config.epi_block_n
  out = config.num_compute_wgs * config.out_slots * epi * jnp.dtype(
      out_dtype).itemsize
  c = 0 if not _c_separate(c_dtype, out_dtype) else (
      config.num_compute_wgs * epi * jnp.dtype(c_dtype).itemsize)
  # The ring (pingpong: a set of `produced` barriers per warpgroup); C loads (2 per wg).
  barriers = 8 * ((3 if config.pingpong else 2) * stages + 2 * config.num_compute_wgs)
  # Each buffer is aligned to 1024 bytes (128-byte swizzle atoms).
  return (sum(_round_up(x, 1024) for x in (ring, out, c) if x)
          + barriers + _RESERVED_SMEM_BYTES)


def check_layout(config: Config, dtype, *, a_k_major: bool,
                 b_k_major: bool, split=None) -> None:
  """Raises ValueError if the config's tiles do not fit the smem swizzle.

  A warpgroup's slice of a shared-memory tile along its minor (contiguous)
  dimension must start on a swizzle atom (128 bytes; with an FP32 split, whose
  MN-major piece tiles take the K-major tile's swizzle, that swizzle's width), and
  every minor dimension must hold at least 32 bytes (the smallest swizzle).
  """
  itemsize = jnp.dtype(dtype).itemsize
  if config.block_k * itemsize % 32:
    raise ValueError(
        f"Config.block_k={config.block_k} gives {config.block_k * itemsize}"
        f"-byte rows for {jnp.dtype(dtype).name}; swizzled smem rows need a"
        " multiple of 32 bytes")
  a_minor = config.block_k if a_k_major else config.block_m
  b_minor = config.block_k if b_k_major else config.block_n
  a_swizzle = plgpu.find_swizzle(_swizzle_minor(config, a_minor, a_k_major, split)
                                 * itemsize * 8)
  b_swizzle = plgpu.find_swizzle(_swizzle_minor(config, b_minor, b_k_major, split)
                                 * itemsize * 8)
  if a_swizzle != b_swizzle:
    raise ValueError(
        f"Config: the A tile's contiguous dim ({a_minor} elements) gets a"
        f" {a_swizzle}-byte swizzle but the B tile's ({b_minor}) a {b_swizzle}"
        "-byte one; wgmma needs both operands with the same swizzle (make"
        " block_n/block_m/block_k a multiple of 128 bytes)")
  if config.num_compute_wgs > 1 and not config.pingpong:
    if config.wg_split == "n" and not b_k_major:
      minor, what = config.wg_block_n, "wg_block_n (block_n / num_compute_wgs)"
    elif config.wg_split == "m" and not a_k_major:
      minor, what = config.wg_block_m, "wg_block_m (block_m / num_compute_wgs)"
    else:
      return
    if minor * itemsize % (128 if split is None else a_swizzle):
      raise ValueError(
          f"Config: {what}={minor} splits a shared-memory tile along its"
          f" contiguous dimension at {minor * itemsize} bytes for"
          f" {jnp.dtype(dtype).name}; the split must fall on a swizzle atom"
          f" ({128 if split is None else a_swizzle} bytes; use a wider tile or the"
          " other wg_split)")


def check_smem_budget(config: Config, dtype, out_dtype, c_dtype=None,
                      k: int | None = None, split: _precision.Split | None = None) -> None:
  """Raises ValueError if the kernel would not fit an sm_90 block's smem."""
  used = smem_bytes(config, dtype, out_dtype, c_dtype, k, split)
  if used > SMEM_BYTES_PER_BLOCK:
    raise ValueError(
        f"Config {config} needs {used} bytes of shared memory for"
        f" dtype={jnp.dtype(dtype).name}, out_dtype={jnp.dtype(out_dtype).name}"
        + (f", c_dtype={jnp.dtype(c_dtype).name}" if c_dtype is not None else "")
        + (f", split {split.name}" if split is not None else "")
        + f"; sm_90 allows {SMEM_BYTES_PER_BLOCK} per block (shared-memory"
        " budget: stages*(block_m+block_n)*block_k*itemsize + epilogue"
        " buffers; with a split the ring holds bf16 pieces). Lower stages, block_k,"
        " the block tile or the epi_block.")


def check_fits(config: Config, dtype, out_dtype, c_dtype=None, k: int | None = None,
               precision=None) -> None:
  """Raises ValueError if the config cannot run a call with these dtypes and precision
  (shared memory; with an FP32 split, `check_split` too). For tuned and candidate configs."""
  split = _precision.split_of(precision, dtype)
  if split is not None:
    check_split(config, split)
  check_smem_budget(config, dtype, out_dtype, c_dtype, k, split)


def check_split(config: Config, split: _precision.Split) -> None:
  """Raises ValueError if the config cannot run the FP32 emulation (see `_warp_producer_kernel`)."""
  if config.producer != "warp":
    raise ValueError(f"Config.producer={config.producer!r}: the FP32 split runs with the"
                     " 'warp' producer only")
  if config.pingpong:
    raise ValueError("Config.pingpong=True: the FP32 split runs with both warpgroups"
                     " sharing each tile")
  if config.wg_block_m * config.wg_block_n > 64 * 128:
    raise ValueError(
        f"Config: a warpgroup tile of {config.wg_block_m}x{config.wg_block_n} is too large"
        " for the FP32 split, which keeps two f32 accumulators of it in registers (at most"
        " 64x128)")


def default_config(m: int, n: int, k: int, dtype, *, out_dtype=None,
                   c_dtype=None, precision=None) -> Config:
  """Picks a config by shape and dtype (fits the shared-memory budget).

  out_dtype defaults to dtype; c_dtype is C's dtype (None: no C). Both change
  the epilogue's shared memory, so pass them when they are known. precision
  matters for float32 emulated from bf16 pieces (`precision.split_of`).
  """
  dtype = jnp.dtype(dtype)
  out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
  block_k = 128 // dtype.itemsize  # 128-byte rows: the widest swizzle.
  split = _precision.split_of(precision, dtype)
  if split is not None:
    # Two f32 accumulators per warpgroup (the running sum and the K block's) cap its
    # tile at 64x128. A 128x128 CTA tile (two warpgroups of 64 rows) with 3 pieces of
    # each operand and 32-wide K blocks loads 48 KB per K step, as the 256x128 bf16
    # tiles do, for six products; that leaves room for 3 stages and the epilogue. CTA pairs
    # sharing A (multicast): 4097^3 89.6 vs 85.0 TFLOP/s, 8192^3 112.6 vs 111.1, 4096^3
    # even (H100, session 11); 64x256 tiles split by columns ran 7-15% slower.
    # float16 pieces (float32_f16x3, two per operand): 64-wide K blocks in the same 64 KB
    # per stage (and a 64x32 f32 epilogue sub-tile to fit): 180 / 200 / 128 TFLOP/s at
    # 4096^3 / 8192^3 / 4097^3 against 156 / 163 / 115 with 32-wide blocks (H200, session
    # 14, run 5): three products per K block are too few to cover the block's sync.
    f16 = split.dtype == "float16"
    big = m > 64 and n > 128
    cfg = Config(block_m=128 if m > 64 else 64, block_n=128, block_k=64 if f16 else 32,
                 stages=3, num_compute_wgs=2 if m > 64 else 1, wg_split="m", epi_block_m=64,
                 epi_block_n=32 if f16 else 64, grid_minor_dim="n", grid_tile_width=8,
                 cluster_n=2 if big else 1)
  elif max(m, n) <= 64 or (m <= 128 and n <= 128):
    # Tiny problems: one warpgroup, a small tile, fewer wasted zero rows.
    # B's block must keep the 128-byte swizzle of A (wgmma needs one swizzle).
    block_n = min(128, _round_up(n, 128 // dtype.itemsize))
    cfg = Config(block_m=64, block_n=block_n, block_k=block_k, stages=4,
                 num_compute_wgs=1, wg_split="n", epi_block_m=64,
                 epi_block_n=_largest_divisor(block_n, 64, 16),
                 grid_tile_width=4)
  elif m <= 64:
    # Skinny M (e.g. 16 x 8192 x 8192): 64-row tiles, wide N, deep ring.
    cfg = Config(block_m=64, block_n=256, block_k=block_k, stages=6,
                 num_compute_wgs=2, wg_split="n", epi_block_m=64,
                 epi_block_n=64)
  elif n <= 64:
    # Narrow N: a 64-wide tile split by rows (a 32-column warpgroup slice would
    # break the 128-byte swizzle atom).
    cfg = Config(block_m=128, block_n=64, block_k=block_k, stages=6,
                 num_compute_wgs=2, wg_split="m", epi_block_m=64,
                 epi_block_n=_largest_divisor(64, 64, 16))
  elif m >= 256 and n >= 256:
    # 256 x 128 CTA tiles, two consumer warpgroups of 128 x 128 each, and CTAs
    # paired along n so that each pair loads its shared A tile once (multicast).
    # On the H200 this beat 128 x 256 without clusters by 1-2% at 4096^3 and
    # 8192^3 (benchmarks/results/2026-11-22-h200/session2/run{1,2}_mosaic_probe.log).
    # wgmma_wait=1 added 0-0.7% there but is not the default: it rests on the
    # pipeline's delay_release, which skips the release of each tile's last
    # stage (see _kernel), too thin a margin for a default.
    cfg = Config(block_m=256, block_n=128, block_k=block_k, stages=4,
                 num_compute_wgs=2, wg_split="m", epi_block_m=64,
                 epi_block_n=64, grid_minor_dim="n", grid_tile_width=8,
                 cluster_n=2)
    if dtype.itemsize == 2:
      # 1.5x wider tiles (3 stages fit) when they need clearly fewer rounds of
      # tiles over the SMs: bf16 4097^3 takes 5 rounds of 256x128 clusters and 3
      # of 256x192 tiles, 493 vs 543 TFLOP/s on the H200 (run8_mosaic_probe_wide.log);
      # a round of them cost 1.40x one of 256x128 there, so 1.45 with a 10% margin
      # keeps 256x128 where both are close (4096^3: 797 vs 743).
      wide = Config(block_m=256, block_n=192, block_k=block_k, stages=3,
                    num_compute_wgs=2, wg_split="m", epi_block_m=64,
                    epi_block_n=64, grid_minor_dim="n", grid_tile_width=8)
      if 1.45 * _rounds(wide, m, n) <= 0.9 * _rounds(cfg, m, n):
        cfg = wide
  else:
    # 128 x 256 CTA tile, two consumer warpgroups of 128 x 128 each.
    cfg = Config(block_m=128, block_n=256, block_k=block_k, stages=4,
                 num_compute_wgs=2, wg_split="n", epi_block_m=64,
                 epi_block_n=64, grid_minor_dim="n", grid_tile_width=8)
  # Shrink the epilogue, then the ring, until it fits.
  while smem_bytes(cfg, dtype, out_dtype, c_dtype, k, split) > SMEM_BYTES_PER_BLOCK:
    if cfg.epi_block_n > 32 or (cfg.epi_block_n > 8 and cfg.stages <= 2):
      cfg = cfg.replace(epi_block_n=cfg.epi_block_n // 2)
    elif cfg.stages > 2:
      cfg = cfg.replace(stages=cfg.stages - 1)
    else:
      break
  return cfg


def _rounds(config: Config, m: int, n: int) -> int:
  """Rounds of CTA tiles (clusters) over the SMs for an m x n output."""
  tiles_m = -(-m // config.block_m)
  tiles_n = -(-n // config.block_n)
  clusters = -(-tiles_m // config.cluster_m) * -(-tiles_n // config.cluster_n)
  return -(-clusters // (tuning.num_sms() // config.cluster_size))


def _sub_tiles(config: Config) -> list[tuple[slice, slice]]:
  """The (epi_block_m, epi_block_n) sub-tiles of a warpgroup's accumulator, row-major:
  the epilogue stores them one by one, and a stream-K hand-over writes and reads the
  f32 partials in the same pieces."""
  em, en = config.epi_block_m, config.epi_block_n
  return [(slice(i * em, (i + 1) * em), slice(j * en, (j + 1) * en))
          for i in range(config.wg_block_m // em) for j in range(config.wg_block_n // en)]


def _c_separate(c_dtype, out_dtype) -> bool:
  return c_dtype is not None and jnp.dtype(c_dtype) != jnp.dtype(out_dtype)


def _largest_divisor(x: int, at_most: int, multiple_of: int) -> int:
  for d in range(at_most, 0, -multiple_of):
    if x % d == 0:
      return d
  return multiple_of


# ----------------------------------------------------------------------------
# Availability
# ----------------------------------------------------------------------------


def unavailable_reason() -> str | None:
  """None when the kernel can run here: an sm_90 GPU, or a CPU (interpret)."""
  try:
    device = jax.devices()[0]
  except RuntimeError as e:  # no backend at all
    return f"no JAX device: {e}"
  if device.platform == "cpu":
    return None  # Mosaic GPU interpret mode runs on the CPU.
  if device.platform != "gpu":
    return f"Mosaic GPU needs an NVIDIA GPU, the default device is {device.platform}"
  cc = getattr(device, "compute_capability", None)
  if cc is None or str(cc) not in ("9.0", "9.0a"):
    return (f"the kernel uses wgmma, which needs sm_90 (Hopper); the device"
            f" {device.device_kind} has compute capability {cc}")
  return None


def supports(dtype, precision) -> str | None:
  """None when the kernel can compute this dtype/precision, else why not."""
  dtype = jnp.dtype(dtype)
  if dtype not in _SUPPORTED_DTYPES:
    return f"dtype {dtype.name} is not supported (float32, bfloat16, float16)"
  if _precision.split_of(precision, dtype) is not None:
    return None  # float32 from bf16 pieces
  if isinstance(precision, (str, lax.DotAlgorithmPreset)):
    return (f"precision={getattr(precision, 'name', precision)} has no Mosaic GPU kernel"
            f" for {dtype.name} inputs (backend='xla' runs it)")
  if dtype == jnp.float32 and _is_highest(precision):
    return ("float32 with Precision.HIGHEST needs IEEE fp32 products; wgmma"
            " computes 32-bit inputs as TF32 (precision='float32_accurate' gives"
            " SGEMM's accuracy on tensor cores)")
  return None


def _is_highest(precision) -> bool:
  if isinstance(precision, (tuple, list)):
    return any(_is_highest(p) for p in precision)
  return precision in (lax.Precision.HIGHEST, "highest", "float32")


# ----------------------------------------------------------------------------
# Stream-K schedule
# ----------------------------------------------------------------------------

# K steps that cutting the last round must save each CTA (see stream_k_schedule).
_STREAM_K_MIN_SAVED_STEPS = 24


@dataclasses.dataclass(frozen=True)
class StreamK:
  """Which steps each CTA runs when the last tiles are cut along K.

  Tiles are numbered g = batch entry * tiles per batch entry + planar-snake index.
  CTA c first runs the whole tiles c + r * num_ctas for r < dp_rounds, then its range
  [c * sk_iters // num_ctas, (c + 1) * sk_iters // num_ctas) of the remaining
  (tile, K block) steps, numbered (g - dp_rounds * num_ctas) * k_iters + kk.
  The remaining tiles number between half a round and 1.5 rounds, so every range
  holds at least k_iters // 2 steps (a tile is cut among at most three consecutive
  CTAs) and at most three pieces (the end of a tile begun by an earlier CTA, a whole
  tile, the beginning of a tile that later CTAs end), or one piece from the middle
  of a tile.
  """

  num_ctas: int
  k_iters: int
  dp_rounds: int
  sk_iters: int

  def range(self, cta):
    """[start, end) of the CTA's stream-K steps (ints or int32 arrays)."""
    return (lax.div(cta * self.sk_iters, self.num_ctas),
            lax.div((cta + 1) * self.sk_iters, self.num_ctas))

  def piece(self, start, end, i):
    """Piece i (0, 1, 2) of the range: (tile g, k0, k1, first step); empty if k0 >= k1.

    Pieces end on tile boundaries: piece i spans [p_i, p_i+1) with
    p_i = clamp((start // k_iters + i) * k_iters, start, end).
    """
    first_tile = lax.div(start, self.k_iters)
    lo = lax.max(start, lax.min((first_tile + i) * self.k_iters, end))
    hi = lax.max(start, lax.min((first_tile + i + 1) * self.k_iters, end))
    tile = lax.div(lo, self.k_iters)
    k0 = lo - tile * self.k_iters
    return (self.dp_rounds * self.num_ctas + tile, k0, k0 + hi - lo,
            self.dp_rounds * self.k_iters + lo - start)


def stream_k_schedule(config: Config, tiles: int, k_iters: int, num_ctas: int,
                      interpret: bool) -> StreamK | None:
  """The stream-K schedule of a launch, or None to run whole tiles only.

  tiles: CTA (cluster) tiles over all batch entries; num_ctas: CTAs (clusters).
  Cut only the last, partial round when it holds at least half a round of tiles,
  else it and the last full round: CTAs at different K offsets of their tiles
  share fewer operand tiles in L2, so the cut part is kept small (on the H200,
  cutting the last full round too cost 4% at bf16 4096^3 and 12% at 4097^3,
  where the operands' whole K extent no longer fit in L2).
  None when stream-K is off, in interpret mode (no global semaphores), when the
  grid has more CTAs than the device has SMs (a CTA may then wait for one that is
  not scheduled yet: CUDA does not promise the order), when the
  tiles fill whole rounds or are under half a round, or when it would save each
  CTA fewer than _STREAM_K_MIN_SAVED_STEPS K steps: the idle share of the last
  round times k_iters. The hand-over of the cut tiles (their f32 partials written
  and read through L2 by all CTAs at once, and the zeroing of the semaphores) cost
  ~12 us per call on the H200, ~17 K steps of a 256x128 bf16 tile (run 4 of
  session 6: bf16 8192^3 saves 0.48 * 128 = 62 steps and ran 2% faster, 6144^3
  0.27 * 96 = 26 steps, 1% faster; 4096^3 0.12 * 64 = 8 steps, 4% slower).
  """
  rest = tiles % num_ctas
  if (not config.uses_stream_k or interpret or rest == 0
      or num_ctas * config.cluster_size > tuning.num_sms()
      or (num_ctas - rest) * k_iters < _STREAM_K_MIN_SAVED_STEPS * num_ctas
      or (2 * rest < num_ctas and tiles < num_ctas)):
    return None
  sk_tiles = rest if 2 * rest >= num_ctas else rest + num_ctas
  sk_iters = sk_tiles * k_iters
  if (num_ctas + 1) * sk_iters >= 2**31:  # the int32 range arithmetic
    return None
  return StreamK(num_ctas=num_ctas, k_iters=k_iters,
                 dp_rounds=(tiles - sk_tiles) // num_ctas, sk_iters=sk_iters)


# ----------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------


def _swizzle_minor(config: Config, minor: int, k_major: bool, split) -> int:
  """The minor size that picks a smem tile's swizzle: its minor (last) dim, except for an
  FP32 split's MN-major operand. Its bf16 pieces keep the operand's stored layout (no XLA
  transpose before the split) and its tile takes the K-major tile's swizzle (block_k
  wide, 64 bytes for block_k=32): wgmma needs the same swizzle on both operands."""
  return config.block_k if split is not None and not k_major else minor


@dataclasses.dataclass(frozen=True)
class Peer:
  """One of the two kernels of a K split over the two devices of mesh axis ``axis``
  (`pair_gemm`): each device holds a K half of a and b, and owns one half of the rows.

  send=True: the device computes the *other* device's rows of its partial product and
  the kernel stores them, f32, into the other device's output (over NVLink, TMA
  stores to a peer address) instead of its own. send=False: the device computes its
  own rows, adds what the other device sent (C, f32) and runs the epilogue; with
  gather, it stores the finished rows into both devices' (M, N) outputs, so both end
  with the whole result and no collective runs. A kernel that stores to the peer
  ends with a handshake (`_handshake`): every warpgroup waits for its stores, adds 1
  to its CTA's semaphore on the other device and takes 1 from its own CTA's. A CTA
  finishes only once its twin CTA's warpgroups have all signalled, so a finished
  kernel means the peer's stores into this device are complete (the next kernel may
  read them). Both devices must run the same grid (the same SM count).
  """
  axis: str
  send: bool
  gather: bool = False

  def __post_init__(self):
    if self.send and self.gather:
      raise ValueError("Peer: a send kernel stores its partial rows to the peer only")

  @property
  def stores_remote(self) -> bool:
    return self.send or self.gather


def _kernel(a_gmem, b_gmem, c_gmem, bias_gmem, out_gmem, pre_gmem, partials_gmem, *,
            config: Config,
            m: int, n: int, k: int, batch: int, a_k_major: bool, b_k_major: bool,
            b_shared: bool, alpha: float, beta: float, c_separate: bool,
            activation: str | None, num_ctas: int, stream_k: StreamK | None,
            split: _precision.Split | None = None, c_gate: str | None = None,
            peer: Peer | None = None):
  """One persistent CTA (of num_ctas, or of num_ctas clusters).

  a_gmem: (batch, M, K) if a_k_major else (batch, K, M)
  b_gmem: (batch_b, N, K) if b_k_major else (batch_b, K, N)
  c_gmem: (batch, M, N) or None; out_gmem: (batch, M, N') with N' >= N (2M rows for a
    gathering `peer`).
  pre_gmem: None, or like out_gmem: the pre-activation (keep_pre), stored beside it.
  bias_gmem: (N',) f32 or None, added to every row before the activation.
  c_gate: None, or an activation whose derivative at C multiplies the product (C is
    then not added).
  num_ctas: CTAs of the grid, or clusters of CTAs (both CTAs of a cluster run the same
    tiles' two halves, so the schedule counts clusters).
  partials_gmem: None, or with stream_k (num_ctas * cluster_size * num_compute_wgs,
    wg_block_m, wg_block_n) f32: per warpgroup, the sum it hands over for a tile that
    another CTA finishes.
  split: float32 operands computed from bf16 pieces (see `_warp_producer_kernel`), or None.
    a_gmem and b_gmem are then tuples of split.pieces bf16 arrays, the operand's pieces
    (largest first), each shaped as above.
  peer: None, or one kernel of a K split over two devices (`Peer`): the tile space is
    then m rows of a's 2 * m, the half at a_row0.
  """
  cfg = config
  dtype = (a_gmem if split is None else a_gmem[0]).dtype
  out_dtype = out_gmem.dtype
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  wg_m, wg_n = cfg.wg_block_m, cfg.wg_block_n
  epi_m, epi_n = cfg.epi_block_m, cfg.epi_block_n
  m_tiles, n_tiles, k_iters = pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)
  # The pipeline shrinks its ring to k_iters stages when K is short, after checking
  # stages > delay_release; with k_iters <= wgmma_wait that check no longer holds and
  # the kernel faulted on the H200 (8192x8192x64, wgmma_wait=1). One K step has
  # nothing to overlap, so wait for each wgmma then.
  wgmma_wait = cfg.wgmma_wait if k_iters > cfg.wgmma_wait else 0
  if split is not None:
    wgmma_wait = 0  # the split step waits for its own products
  # The tile loop walks clusters: (cluster_m x cluster_n) adjacent CTA tiles. With
  # an odd tile count the last cluster's second CTA gets a tile past the edge: its
  # TMA loads read zeros (it still has to take part in the multicast) and its
  # stores are clipped away.
  m_iters, n_iters = pl.cdiv(m_tiles, cfg.cluster_m), pl.cdiv(n_tiles, cfg.cluster_n)
  num_wgs = cfg.num_compute_wgs
  # Chain the per-tile pipelines of a CTA (``plgpu.PipelinePipeline``): the producer
  # loads the next tile's first K blocks into each stage as soon as the current
  # tile's last steps free it, instead of draining the ring at the end of every tile
  # and refilling it during the epilogue. The pipeline allows it when every tile
  # uses each stage equally often and no release is delayed. Every CTA must run at
  # least two tiles (a START and a STOP): a lone START would leave the producer's last
  # barrier phases unobserved (harmless on the GPU, an error in interpret mode, and
  # nothing to chain anyway).
  chained = (wgmma_wait == 0
             and k_iters % min(cfg.stages, k_iters) == 0
             and batch * m_iters * n_iters >= 2 * num_ctas)

  a_block = (bm, bk) if a_k_major else (bk, bm)
  b_block = (bn, bk) if b_k_major else (bk, bn)
  a_transforms = _swizzle_transforms(_swizzle_minor(cfg, a_block[1], a_k_major, split), dtype)
  b_transforms = _swizzle_transforms(_swizzle_minor(cfg, b_block[1], b_k_major, split), dtype)
  out_transforms = _swizzle_transforms(epi_n, out_dtype)
  # A K split over two devices (`Peer`): which half of a's rows this kernel computes,
  # and where each output sub-tile goes: [(ref, row offset)].
  a_row0, destinations = 0, lambda ref: [(ref, None)]
  if peer is not None:
    me = lax.axis_index(peer.axis)
    other = {peer.axis: 1 - me}
    a_row0 = (1 - me if peer.send else me) * m

    def destinations(ref):
      if peer.send:
        return [(plgpu.remote_ref(ref, other), None)]
      if peer.gather:
        return [(ref, a_row0), (plgpu.remote_ref(ref, other), a_row0)]
      return [(ref, None)]

  def get_pipeline(body, compute_context, pipeline_state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_iters,),
        memory_registers=_PRODUCER_REGISTERS,
        in_specs=[
            plgpu.BlockSpec(  # A tile: (bm, bk) or (bk, bm)
                a_block,
                (lambda kk: (0, kk)) if a_k_major else (lambda kk: (kk, 0)),
                transforms=a_transforms,
                delay_release=wgmma_wait,
                # CTAs of a cluster along n share their A tiles (multicast).
                collective_axes=("cluster",) if cfg.cluster_n > 1 else (),
            ),
            plgpu.BlockSpec(  # B tile: (bn, bk) or (bk, bn)
                b_block,
                (lambda kk: (0, kk)) if b_k_major else (lambda kk: (kk, 0)),
                transforms=b_transforms,
                delay_release=wgmma_wait,
                collective_axes=("cluster",) if cfg.cluster_m > 1 else (),
            ),
        ],
        wg_axis="wg",
        num_compute_wgs=num_wgs,
        max_concurrent_steps=cfg.stages,
        compute_context=compute_context,
        pipeline_state=pipeline_state,
    )

  def a_window(bi, mi, piece=0):  # rows [mi*bm, +bm) of batch bi (its piece), all K
    ms = pl.ds(mi * bm if peer is None else a_row0 + mi * bm, bm)
    a = a_gmem if split is None else a_gmem[piece]
    return a.at[bi, ms, :] if a_k_major else a.at[bi, :, ms]

  def b_window(bi, ni, piece=0):  # columns [ni*bn, +bn) of batch bi (its piece), all K
    bb = 0 if b_shared else bi
    b = b_gmem if split is None else b_gmem[piece]
    ns = pl.ds(ni * bn, bn)
    return b.at[bb, ns, :] if b_k_major else b.at[bb, :, ns]

  def _epilogue(acc, bi, row0, col0, wg, out_smem, c_smem, c_barrier, partial=None):
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
      if alpha != 1.0:
        val = val * jnp.float32(alpha)
      if c_val is not None:
        if c_gate is not None:
          val = val * derivative(c_val, c_gate)
        else:
          if beta != 1.0:
            c_val = c_val * jnp.float32(beta)
          val = val + c_val
      if bias_gmem is not None:  # (epi_n,) columns, broadcast over the sub-tile's rows
        bias = plgpu.load(bias_gmem.at[pl.ds(col0 + es_n.start, epi_n)],
                          layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
        val = val + lax.broadcast_in_dim(bias, (epi_m, epi_n), [1])
      values = [activate(val, activation)] + ([val] if pre_gmem is not None else [])
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

  def tile_coords(bi, lin):  # (batch entry, m tile, n tile) of tile lin of entry bi
    mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters),
                                0 if cfg.grid_minor_dim == "m" else 1,
                                cfg.grid_tile_width)
    if cfg.cluster_size > 1:
      cta = lax.axis_index("cluster")
      mi, ni = mi * cfg.cluster_m, ni * cfg.cluster_n
      mi, ni = (mi + cta, ni) if cfg.cluster_m > 1 else (mi, ni + cta)
    return bi, mi, ni

  # How the CTA tile is split among the consumer warpgroups (None: pingpong's
  # warpgroups take whole tiles).
  wg_split = None if cfg.pingpong else cfg.wg_split

  def wg_origin(wg):  # this warpgroup's part of the CTA tile, in CTA-tile coordinates
    return {"m": (wg * wg_m, 0), "n": (0, wg * wg_n), None: (0, 0)}[wg_split]

  def wgmma(acc_ref, a_smem, b_smem, wg):  # acc_ref += (wg_m, bk) @ (bk, wg_n)
    wg_m0, wg_n0 = wg_origin(wg)
    wg_ms, wg_ns = pl.ds(wg_m0, wg_m), pl.ds(wg_n0, wg_n)
    if a_k_major:
      a_op = a_smem.at[wg_ms, :] if wg_split == "m" else a_smem
    else:
      a_op = (a_smem.at[:, wg_ms] if wg_split == "m" else a_smem).T
    if b_k_major:
      b_op = (b_smem.at[wg_ns, :] if wg_split == "n" else b_smem).T
    else:
      b_op = b_smem.at[:, wg_ns] if wg_split == "n" else b_smem
    plgpu.wgmma(acc_ref, a_op, b_op)

  # Epilogue buffers: per consumer warpgroup, out_slots output sub-tiles and C's.
  epilogue_allocs = dict(out_smem=plgpu.SMEM(
      (num_wgs, cfg.out_slots, epi_m, epi_n), out_dtype, transforms=out_transforms))
  if c_gmem is not None:
    # Two per warpgroup: its sub-tiles' C loads alternate between them (prefetch_c).
    epilogue_allocs["c_barrier"] = plgpu.Barrier(num_barriers=2 * num_wgs)
    if c_separate:
      epilogue_allocs["c_smem"] = plgpu.SMEM(
          (num_wgs, epi_m, epi_n), c_gmem.dtype,
          transforms=_swizzle_transforms(epi_n, c_gmem.dtype))

  if cfg.producer == "warp":
    _warp_producer_kernel(
        cfg=cfg, a_block=a_block, b_block=b_block, a_transforms=a_transforms,
        b_transforms=b_transforms, dtype=dtype, a_k_major=a_k_major, b_k_major=b_k_major,
        k_iters=k_iters, wgmma_wait=wgmma_wait, tiles=(batch, m_iters * n_iters),
        num_ctas=num_ctas, stream_k=stream_k, partials_gmem=partials_gmem,
        tile_coords=tile_coords, wg_origin=wg_origin, wgmma=wgmma, a_window=a_window,
        b_window=b_window, epilogue=_epilogue, epilogue_allocs=epilogue_allocs,
        split=split)
    return

  ignore = lambda *_, **__: None
  zero = jnp.int32(0)
  scoped = dict(
      pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
          a_window(zero, zero), b_window(zero, zero)),
      **epilogue_allocs,
  )

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(pipeline_allocs, out_smem, c_barrier=None, c_smem=None):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((batch, m_iters * n_iters), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      bi, mi, ni = tile_coords(*loop_info.index)
      wg_m0, wg_n0 = wg_origin(wg)

      def mma_body(_, a_smem, b_smem, acc_ref):
        wgmma(acc_ref, a_smem, b_smem, wg)
        plgpu.wgmma_wait(wgmma_wait)
        return acc_ref

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped,
                           acc_ref=plgpu.ACC((wg_m, wg_n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...]  # (wg_m, wg_n) f32
          _epilogue(acc, bi, mi * bm + wg_m0, ni * bn + wg_n0, wg, out_smem,
                    c_smem, c_barrier)

      state = None
      if chained:
        # START fills the ring, STEADY continues it, STOP drains it (the producer
        # waits for the last releases); every CTA has >= 2 tiles (see `chained`).
        state = jnp.where(
            loop_info.local_index == 0, jnp.int32(plgpu.PipelinePipeline.START),
            jnp.where(loop_info.local_index == loop_info.num_local_steps - 1,
                      jnp.int32(plgpu.PipelinePipeline.STOP),
                      jnp.int32(plgpu.PipelinePipeline.STEADY)))
      get_pipeline(mma_body, compute_context, state)(
          a_window(bi, mi), b_window(bi, ni), allocations=pipeline_allocs)

  del _scope  # run_scoped ran it
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _warp_producer_kernel(*, cfg, a_block, b_block, a_transforms, b_transforms, dtype,
                          a_k_major, b_k_major, k_iters, wgmma_wait, tiles, num_ctas,
                          stream_k, partials_gmem, tile_coords, wg_origin, wgmma,
                          a_window, b_window, epilogue, epilogue_allocs, split=None):
  """Config.producer == "warp": the CTA's K steps as one ring.

  The CTA's work is a sequence of pieces, each a tile and a range [k0, k1) of its K
  blocks: whole tiles (k0 = 0, k1 = k_iters) strided by the CTA count, then, with
  stream_k, up to three pieces of a K range (see ``StreamK``). Step s (counted over
  all pieces) uses buffer s % stages. One warp of the producer warpgroup issues the
  TMA loads of every step, after the buffer's release from step s - stages; the
  consumer warpgroups wait for step s's loads, run wgmma, release the buffer (one
  step later with wgmma_wait=1) and, after a piece's last step, run the epilogue
  while the producer is already loading the next piece.

  A tile cut among CTAs c < c + 1 (< c + 2) (stream-K): c runs its first K blocks as
  the last piece of its range, the others the rest, each as its first piece. The
  last of them stores its f32 accumulator to partials_gmem and signals a global
  semaphore (release); a middle one waits for it (acquire), adds it and hands the
  sum on the same way; c waits for c + 1's, adds it in its epilogue and writes the
  tile. Waits go only from a CTA to the first piece of the next one, the ones that
  wait for nothing come last, and all CTAs are resident (one per SM;
  ``stream_k_schedule`` refuses a grid larger than the device), so there is no cycle;
  a first piece ends at about the time the previous CTA's range does, so a partial
  is normally ready when it is needed.

  split: None, or the FP32 emulation's `precision.Split`: each step then loads the
  split.pieces bf16 pieces of both tiles (a (stages, pieces, ...) ring) and issues the
  split's piece products in place of one wgmma.

  cfg.pingpong: the CTA's tile j is consumer warpgroup j % 2's alone; the ring is the same,
  each step is released by one warpgroup, and each warpgroup waits for its steps' loads
  on its own set of `produced` barriers. (A barrier's phase is tracked per thread, by
  the waits that thread makes: a warpgroup waiting on a slot only for its own tiles
  would lose count of the phases the other's tiles complete there.)
  """
  num_wgs, bk = cfg.num_compute_wgs, cfg.block_k
  # A ring deeper than K is never filled (smem_bytes counts it this way too).
  stages = min(cfg.stages, k_iters)
  releases = 1 if cfg.pingpong else num_wgs  # consumer warpgroups per step
  a_multicast = ("cluster",) if cfg.cluster_n > 1 else None
  b_multicast = ("cluster",) if cfg.cluster_m > 1 else None
  if a_multicast or b_multicast:
    # Loads into both CTAs of a cluster: a slot is free once both CTAs released it.
    consumed = plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=releases,
                                    num_barriers=stages)
  else:
    consumed = plgpu.Barrier(num_arrivals=releases, num_barriers=stages)
  ring_pieces = () if split is None else (split.pieces,)  # the split's bf16 pieces
  loads = 2 * (1 if split is None else split.pieces)  # TMA loads per step
  scoped = dict(
      a_smem=plgpu.SMEM((stages, *ring_pieces, *a_block), dtype, transforms=a_transforms),
      b_smem=plgpu.SMEM((stages, *ring_pieces, *b_block), dtype, transforms=b_transforms),
      produced=plgpu.Barrier(num_arrivals=loads,
                             num_barriers=stages * (2 if cfg.pingpong else 1)),
      consumed=consumed,
      **epilogue_allocs,
  )
  batch, per_batch = tiles
  cta = lax.axis_index("sm")  # the CTA, or the cluster: both CTAs run the same pieces
  if stream_k is not None:
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
    if stream_k is None:
      local_tiles = lax.div(batch * per_batch - cta + num_ctas - 1, num_ctas)
    else:
      local_tiles = stream_k.dp_rounds

    @pl.loop(0, local_tiles)
    def _whole_tiles(j):
      body(cta + j * num_ctas, 0, k_iters, j * k_iters, False)

    if stream_k is None:
      return local_tiles * k_iters
    start, end = stream_k.range(cta)

    @pl.loop(0, 3)
    def _pieces(i):
      g, k0, k1, step = stream_k.piece(start, end, i)

      @pl.when(k0 < k1)
      def _():
        body(g, k0, k1, step, True)

    return stream_k.dp_rounds * k_iters + end - start

  def coords(g):  # tile g -> (batch entry, m tile, n tile)
    return tile_coords(lax.div(g, per_batch), lax.rem(g, per_batch))

  def owner(first):  # pingpong: the consumer warpgroup of the piece whose first step is
    # `first`, the CTA's tile j = first / k_iters (it runs no stream-K pieces)
    return lax.rem(lax.div(first, k_iters), 2)

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(a_smem, b_smem, produced, consumed, out_smem, c_barrier=None, c_smem=None):
    wg = lax.axis_index("wg")

    def ready(to, slot):  # the `produced` barrier of a slot's loads for warpgroup `to`
      return produced.at[to * stages + slot] if cfg.pingpong else produced.at[slot]

    @pl.when(wg == num_wgs)
    def _producer():
      plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

      @plgpu.warp_map
      def _per_warp(warp):
        @pl.when(warp == 0)
        def _loads():
          def load_piece(g, k0, k1, first, cut):
            del cut  # the loads do not depend on it
            bi, mi, ni = coords(g)
            srcs = [(a_window(bi, mi, i), b_window(bi, ni, i), (i,) if ring_pieces else ())
                    for i in range(split.pieces if split else 1)]

            to = owner(first) if cfg.pingpong else None  # the consumer warpgroup

            @pl.loop(k0, k1)
            def _k(kk):
              step = first + kk - k0
              slot = lax.rem(step, stages)

              @pl.when(step >= stages)
              def _():
                plgpu.barrier_wait(consumed.at[slot])

              ks = pl.ds(kk * bk, bk)
              for a_src, b_src, piece in srcs:
                plgpu.copy_gmem_to_smem(a_src.at[:, ks] if a_k_major else a_src.at[ks, :],
                                        a_smem.at[(slot, *piece)], ready(to, slot),
                                        collective_axes=a_multicast)
                plgpu.copy_gmem_to_smem(b_src.at[:, ks] if b_k_major else b_src.at[ks, :],
                                        b_smem.at[(slot, *piece)], ready(to, slot),
                                        collective_axes=b_multicast)

          steps = for_each_piece(load_piece)

          # After the CTA's last loads: wait for the last releases, so no arrival
          # (from this CTA or the cluster peer) is pending when the CTA exits.
          @pl.loop(jnp.maximum(steps - stages, 0), steps)
          def _drain(step):
            plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

    @pl.when(wg < num_wgs)
    def _consumers():
      # The register split emit_pipeline_warp_specialized makes (its private
      # _compute_registers): what the producer leaves of 512 per thread-slot, shared by
      # the consumer warpgroups, at most 256, a multiple of 8.
      plgpu.set_max_registers(min(256, (512 - _PRODUCER_REGISTERS) // num_wgs) // 8 * 8,
                              action="increase")

      def mma_piece(g, k0, k1, first, cut):
        bi, mi, ni = coords(g)
        wg_m0, wg_n0 = wg_origin(wg)

        def finish(acc):  # the epilogue, or the stream-K hand-over
          write = functools.partial(epilogue, acc, bi, mi * cfg.block_m + wg_m0,
                                    ni * cfg.block_n + wg_n0, wg, out_smem, c_smem,
                                    c_barrier)
          if not cut:
            write()
            return
          mine = (cta * cfg.cluster_size + rank) * num_wgs + wg
          nexts = mine + cfg.cluster_size * num_wgs  # same warpgroup of CTA cta + 1
          begins_tile, ends_tile = k0 == 0, k1 == k_iters

          def hand_over(add_next):  # this piece's sum (+ the next CTA's) to the tile's
            if add_next:            # earlier CTAs
              plgpu.semaphore_wait(semaphores.at[nexts], 1, memory_scope="gpu")
            for es in _sub_tiles(cfg):
              val = acc[es]
              if add_next:
                val = val + plgpu.load(partials_gmem.at[(nexts, *es)],
                                       layout=plgpu.Layout.WGMMA, optimized=False)
              partials_gmem[(mine, *es)] = val
            plgpu.semaphore_signal(semaphores.at[mine], 1, memory_scope="gpu")

          # An earlier CTA ends this tile. A piece from the middle of the tile first
          # adds what CTA cta + 1 did of the rest: the tile's first CTA reads one sum.
          pl.when(~begins_tile & ends_tile)(lambda: hand_over(False))
          pl.when(~begins_tile & ~ends_tile)(lambda: hand_over(True))

          @pl.when(begins_tile & ~ends_tile)  # CTA cta + 1 has (the sum of) the rest
          def _finish():
            plgpu.semaphore_wait(semaphores.at[nexts], 1, memory_scope="gpu")
            write(partial=partials_gmem.at[nexts])

          @pl.when(begins_tile & ends_tile)
          def _whole():
            write()

        if split is not None:
          # FP32 from bf16 pieces. Each K block's piece products (smallest first) go
          # into a zeroed accumulator, which is then added to the running f32 sum
          # `total`, carried in registers, with IEEE adds: the tensor core's truncating
          # accumulation never runs longer than one K block.
          def _k(kk, total):
            step = first + kk - k0
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(ready(wg, slot))

            def block_sum(blk_ref):
              for i, j in split.products:
                wgmma(blk_ref, a_smem.at[slot, i], b_smem.at[slot, j], wg)
              return blk_ref[...]  # waits for the products

            total = total + pl.run_scoped(block_sum, plgpu.ACC(total.shape, jnp.float32))
            plgpu.barrier_arrive(consumed.at[slot])
            return total

          finish(lax.fori_loop(k0, k1, _k, jnp.zeros((cfg.wg_block_m, cfg.wg_block_n),
                                                      jnp.float32)))
          return

        @functools.partial(pl.run_scoped,
                           acc_ref=plgpu.ACC((cfg.wg_block_m, cfg.wg_block_n), jnp.float32))
        def _acc_scope(acc_ref):
          @pl.loop(k0, k1)
          def _k(kk):
            step = first + kk - k0
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(ready(wg, slot))
            wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot], wg)
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


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def _num_sms(config: Config, interpret: bool) -> int:
  if config.num_sms is not None:
    return config.num_sms
  if interpret:
    return _INTERPRET_NUM_SMS
  device = jax.devices()[0]
  if device.platform == "cpu":
    raise ValueError("interpret=False needs a GPU; on the CPU pass interpret=True")
  return tuning.num_sms()


def gemm(a, b, c, *, alpha: float, beta: float, transpose_a: bool,
         transpose_b: bool, precision, out_dtype, config: Config,
         interpret: bool, bias=None, activation: str | None = None,
         c_gate: str | None = None, keep_pre: bool = False, peer: Peer | None = None):
  """act(alpha * op(a) @ op(b) + beta * c + bias) on Hopper (see the backend contract),
  or with c_gate: act'(c) * alpha * op(a) @ op(b) (C read as for beta * c). keep_pre:
  returns (act(z), z), z the pre-activation, both stored by the epilogue. peer: one
  kernel of `pair_gemm` (inside a shard_map / partitioned call over ``peer.axis``).

  a: (batch, M, K), or (batch, K, M) if transpose_a
  b: (batch_b, K, N), or (batch_b, N, K) if transpose_b; batch_b in {1, batch}
  c: None or (batch, M, N); bias: None or (N,); activation: None or a name in
  `epilogue.ACTIVATIONS`. All of the epilogue runs in f32 in the kernel, before the cast.
  """
  dtype = jnp.dtype(a.dtype)
  if (why := supports(dtype, precision)) is not None:
    raise ValueError(f"a.dtype / precision: {why}")
  if b.dtype != dtype:
    raise ValueError(f"b.dtype={b.dtype} must equal a.dtype={dtype}")
  if a.ndim != 3 or b.ndim != 3:
    raise ValueError(f"a and b must be 3-D, got a.shape={a.shape},"
                     f" b.shape={b.shape}")
  batch = a.shape[0]
  m, k = (a.shape[2], a.shape[1]) if transpose_a else (a.shape[1], a.shape[2])
  n, k_b = (b.shape[1], b.shape[2]) if transpose_b else (b.shape[2], b.shape[1])
  if k_b != k:
    raise ValueError(f"K mismatch: op(a) has K={k}, op(b) has K={k_b}"
                     f" (a.shape={a.shape}, b.shape={b.shape},"
                     f" {transpose_a=}, {transpose_b=})")
  if b.shape[0] not in (1, batch):
    raise ValueError(f"b.shape[0]={b.shape[0]} must be 1 or batch={batch}")
  out_dtype = jnp.dtype(out_dtype)
  if c_gate is not None and (c_gate not in FUSED_GATES or c is None or bias is not None
                             or activation is not None):
    raise ValueError(f"c_gate={c_gate!r} needs a c, no bias or activation, and one of "
                     f"{FUSED_GATES}")
  if keep_pre and (activation is None or c_gate is not None):
    raise ValueError("keep_pre needs an activation and no c_gate")
  if beta == 0.0 and c_gate is None:
    c = None  # BLAS semantics: C is not read when beta == 0.
  rows = m  # the rows this kernel computes
  if peer is not None:
    if (why := _pair_shape_reason(m, n, k, dtype, interpret)
        or _pair_tiles_reason(m, n, config)) is not None:
      raise ValueError(f"peer={peer}: {why}")
    if (devices := lax.axis_size(peer.axis)) != 2:
      raise ValueError(f"peer={peer}: mesh axis {peer.axis!r} has {devices} devices, not 2")
    if peer.send and (c is not None or bias is not None or activation is not None
                      or keep_pre or out_dtype != jnp.float32):
      raise ValueError("peer.send computes a bare f32 partial product")
    if c_gate is not None or _precision.split_of(precision, dtype) is not None:
      raise ValueError("peer: no c_gate or FP32 split")
    rows = m // 2
  if c is not None and c.shape != (batch, rows, n):
    raise ValueError(f"c.shape={c.shape}, expected {(batch, rows, n)}")
  split = _precision.split_of(precision, dtype)
  if split is not None and split.scaled:
    return _scaled_split(a, b, c, split, alpha=alpha, beta=beta, transpose_a=transpose_a,
                         transpose_b=transpose_b, out_dtype=out_dtype, config=config,
                         interpret=interpret, bias=bias, activation=activation,
                         c_gate=c_gate, keep_pre=keep_pre)

  # Operand layouts. 16-bit wgmma reads either major order from smem; 32-bit
  # (TF32) needs both operands K-major, so copy the one that is not. The FP32
  # emulation's pieces are bf16: they keep the stored layout (see `_swizzle_minor`).
  a_k_major = not transpose_a
  b_k_major = transpose_b
  b_shared = b.shape[0] == 1 and batch > 1
  if dtype.itemsize == 4 and split is None:
    if not a_k_major:
      a, a_k_major = jnp.swapaxes(a, 1, 2), True
    if not b_k_major:
      b, b_k_major = jnp.swapaxes(b, 1, 2), True
  tile_dtype = dtype
  if split is not None:
    # One XLA pass splits each f32 operand into its bf16 pieces, separate arrays in the
    # operand's layout, and the kernel loads every piece tile by TMA (module docstring).
    # (float16 pieces: of operands `_scaled_split` scaled)
    a, b = (_precision.pieces(x, split) for x in (a, b))
    tile_dtype = jnp.dtype(split.dtype)

  if c is not None:
    if not jnp.issubdtype(c.dtype, jnp.floating) or c.dtype.itemsize > 4:
      c = c.astype(jnp.float32)
  c_dtype = None if c is None else c.dtype
  c_separate = _c_separate(c_dtype, out_dtype)
  if (smem_bytes(config, dtype, out_dtype, c_dtype, k, split) > SMEM_BYTES_PER_BLOCK
      and config == default_config(m, n, k, dtype, precision=precision)):
    # The shape default assumed out_dtype == dtype and no C of another dtype:
    # re-pick it knowing both, instead of failing a call that gave no config.
    config = default_config(m, n, k, dtype, out_dtype=out_dtype,
                            c_dtype=c_dtype, precision=precision)
  check_layout(config, tile_dtype, a_k_major=a_k_major, b_k_major=b_k_major, split=split)
  check_fits(config, dtype, out_dtype, c_dtype, k, precision)

  bm, bn, bk = config.block_m, config.block_n, config.block_k
  a_minor, b_minor = (bk if a_k_major else bm), (bk if b_k_major else bn)
  pad = lambda x, tile, minor: (  # noqa: E731 - the operand, or each of its pieces
      _pad_for_tma(x, tile, minor) if split is None
      else [_pad_for_tma(p, tile, minor) for p in x])
  a = pad(a, _tma_tile(_swizzle_minor(config, a_minor, a_k_major, split), tile_dtype), a_minor)
  b = pad(b, _tma_tile(_swizzle_minor(config, b_minor, b_k_major, split), tile_dtype), b_minor)
  if c is not None:
    c = _pad_for_tma(c, _tma_tile(config.epi_block_n, c.dtype), bn)
  m_out, n_out = _tma_padded_shape(
      m, n, _tma_tile(config.epi_block_n, out_dtype))
  n_out = max(n_out, bn)  # as for the operands: never narrower than the block
  if bias is not None:  # every sub-tile reads a full epi_n slice of it
    bias = jnp.pad(bias.astype(jnp.float32), (0, n_out - n))

  # One CTA (or cluster of CTAs) per SM (or SM pair).
  num_ctas = _num_sms(config, interpret) // config.cluster_size
  tiles = batch * -(-rows // (bm * config.cluster_m)) * -(-n // (bn * config.cluster_n))
  stream_k = None if peer else stream_k_schedule(config, tiles, -(-k // bk), num_ctas,
                                                 interpret)
  kernel_body = functools.partial(
      _kernel, config=config, m=rows, n=n, k=k, batch=batch, a_k_major=a_k_major,
      b_k_major=b_k_major, b_shared=b_shared,
      alpha=float(alpha), beta=float(beta), c_separate=c_separate,
      activation=activation, num_ctas=num_ctas, stream_k=stream_k, split=split,
      c_gate=c_gate, peer=peer)
  if peer is not None and not peer.gather:
    m_out = m = rows  # (pair_reason: no padding)
  out_type = (jax.ShapeDtypeStruct((batch, m_out, n_out), out_dtype),) * (1 + keep_pre)
  if stream_k is not None:  # + the partial accumulators handed between CTAs
    out_type += (jax.ShapeDtypeStruct(
        (num_ctas * config.cluster_size * config.num_compute_wgs, config.wg_block_m,
         config.wg_block_n), jnp.float32),)

  def body(*refs):  # a, b (or their pieces)[, c][, bias], out[, pre][, partials]
    if split is None:
      a_gmem, b_gmem, *rest = refs
    else:
      a_gmem, b_gmem = refs[:split.pieces], refs[split.pieces:2 * split.pieces]
      rest = list(refs[2 * split.pieces:])
    c_gmem = rest.pop(0) if c is not None else None
    bias_gmem = rest.pop(0) if bias is not None else None
    out_gmem = rest.pop(0)
    pre_gmem = rest.pop(0) if keep_pre else None
    kernel_body(a_gmem, b_gmem, c_gmem, bias_gmem, out_gmem, pre_gmem,
                rest.pop(0) if stream_k is not None else None)
    if peer is not None and peer.stores_remote:
      _handshake(peer, config, num_ctas)

  body.__name__ = "pallas_gemm_mosaic"  # kernel name in profiles
  ab = (a, b) if split is None else (*a, *b)
  operands = tuple(x for x in (*ab, c, bias) if x is not None)

  cluster = (dict(cluster=(config.cluster_size,), cluster_names=("cluster",))
             if config.cluster_size > 1 else {})
  call = plgpu.kernel(
      body,
      out_type=out_type,
      grid=(num_ctas,),
      grid_names=("sm",),
      **cluster,
      num_threads=config.num_compute_wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          approx_math=_approx_epilogue(activation, c_gate, out_dtype)),
  )
  if interpret:
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
      outs = call(*operands)
  else:
    outs = call(*operands)
  outs = outs[:1 + keep_pre]  # without the partials
  if (m_out, n_out) != (m, n):
    outs = tuple(_unpad(out, m, n, interpret) for out in outs)
  return tuple(outs) if keep_pre else outs[0]


def _scaled_split(a, b, c, split: _precision.Split, *, alpha, beta, transpose_a, transpose_b,
                  out_dtype, config, interpret, bias, activation, c_gate, keep_pre):
  """`gemm` for a scaled split (precision "float32_f16x3"): A's rows and B's columns
  scaled by powers of two into float16's range (`precision.scale_exponents`), the kernel's
  f32 product of their pieces, scaled back (ldexp: exact), then the epilogue in XLA (it
  must follow the unscaling; one pass over the output)."""
  ka = _precision.scale_exponents(a, 1 if transpose_a else 2)  # per row of op(a)
  kb = _precision.scale_exponents(b, 2 if transpose_b else 1)  # per column of op(b)
  product = gemm(jnp.ldexp(a, ka), jnp.ldexp(b, kb), None, alpha=1.0, beta=0.0,
                 transpose_a=transpose_a, transpose_b=transpose_b,
                 precision=dataclasses.replace(split, scaled=False), out_dtype=jnp.float32,
                 config=config, interpret=interpret)
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


def _handshake(peer: Peer, config: Config, num_ctas: int) -> None:
  """The end of a kernel that stores into the other device (see `Peer`): each warpgroup
  waits until its stores are written, adds 1 to its twin's semaphore on the other
  device (one per CTA of the grid) and waits to take 1 from its own. A CTA's twins
  signal as many times as it waits, so the semaphores end every call at 0."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=False)
  cta = lax.axis_index("sm")
  if config.cluster_size > 1:
    cta = cta * config.cluster_size + lax.axis_index("cluster")
  sems = pl.get_global(plgpu.SemaphoreType.REGULAR((num_ctas * config.cluster_size,)))
  me = lax.axis_index(peer.axis)
  plgpu.semaphore_signal(sems.at[cta], 1, device_id={peer.axis: 1 - me})
  plgpu.semaphore_wait(sems.at[cta], 1)


def _pair_configs(m: int, n: int, k: int, dtype, out_dtype, num_sms) -> tuple[Config, Config]:
  """The configs of `pair_gemm`'s two kernels: the shape defaults for one device's half
  of the rows, with an f32 output (send) and an f32 C (finish)."""
  send = default_config(m // 2, n, k, dtype, out_dtype=jnp.float32)
  finish = default_config(m // 2, n, k, dtype, out_dtype=out_dtype, c_dtype=jnp.float32)
  return send.replace(num_sms=num_sms), finish.replace(num_sms=num_sms)


def _pair_shape_reason(m: int, n: int, k: int, dtype, interpret: bool) -> str | None:
  """What keeps a local problem from the pair kernels whatever their configs, or None:
  they are kept to what needs no padding and no stream-K."""
  if interpret:
    return "the interpreter has no peer memory or global semaphores"
  if jnp.dtype(dtype).itemsize != 2:
    return f"needs 16-bit operands, got {jnp.dtype(dtype)}"
  if m % 256 or n % 128 or k % 128:
    return f"needs M a multiple of 256, N and K of 128, got {(m, n, k)}"
  return None


def _pair_tiles_reason(m: int, n: int, config: Config) -> str | None:
  """Why one device's half of the rows (M/2 x N) is not whole tiles of config, or None."""
  if (m // 2) % (config.block_m * config.cluster_m) or n < config.block_n:
    return f"M/2={m // 2} rows are not whole tiles of {config}"
  return None


def pair_reason(m: int, n: int, k: int, dtype, out_dtype, interpret: bool,
                num_sms: int | None = None) -> str | None:
  """Why `pair_gemm` cannot run this local problem, or None: 16-bit operands, M a
  multiple of 256, N and K of 128, each device's half of the rows a whole number of
  tiles of both kernels' configs."""
  if why := _pair_shape_reason(m, n, k, dtype, interpret):
    return why
  for cfg in _pair_configs(m, n, k, dtype, out_dtype, num_sms):
    if why := _pair_tiles_reason(m, n, cfg):
      return why
  return None


def pair_gemm(a, b, *, axis: str, gather: bool, alpha: float, transpose_a: bool,
              transpose_b: bool, out_dtype, num_sms: int | None = None, bias=None,
              activation: str | None = None, keep_pre: bool = False):
  """act(alpha * op(a) @ op(b) + bias) with K split over the two devices of mesh axis
  ``axis``, called on each device's K halves (inside shard_map or a partitioned call).

  Two kernels, no collective: the first computes the other device's rows of this
  device's partial product and stores them (f32) straight into the other device's
  memory; the second computes this device's rows, adds the f32 partial it received
  and finishes them (bias, activation, cast). The sum is f32, cast once, as for one
  GEMM. gather: both devices end with all (batch, M, N) rows (the second kernel stores
  each finished sub-tile into both outputs); else each has its (batch, M / 2, N) rows.
  The stores to the peer overlap the kernels' main loops (TMA, no SMs of their own),
  where NCCL's reduce-scatter and all-gather run after the GEMM.
  """
  m, k = (a.shape[2], a.shape[1]) if transpose_a else (a.shape[1], a.shape[2])
  n = b.shape[1] if transpose_b else b.shape[2]
  send, finish = _pair_configs(m, n, k, a.dtype, out_dtype, num_sms)
  common = dict(alpha=alpha, transpose_a=transpose_a, transpose_b=transpose_b,
                precision=None, interpret=False)
  received = gemm(a, b, None, beta=0.0, out_dtype=jnp.float32, config=send,
                  peer=Peer(axis, send=True), **common)
  return gemm(a, b, received, beta=1.0, out_dtype=out_dtype, config=finish, bias=bias,
              activation=activation, keep_pre=keep_pre,
              peer=Peer(axis, send=False, gather=gather), **common)


def _approx_epilogue(activation, c_gate, out_dtype) -> bool:
  """Whether the epilogue's tanh / exp run as the SFU's approximations (tanh.approx.f32,
  relative error ~2^-11): for a bf16 result, whose rounding (2^-9) is 4x coarser. With
  libdevice's tanh the gelu'(C) gate took 0.14 ms of the MLP step's 1.60 ms dz GEMM,
  more than reading C (0.10; H100, session 10, `probe.py gate`)."""
  return (jnp.dtype(out_dtype) == jnp.bfloat16
          and bool({activation, c_gate} & {"gelu", "silu"}))
