"""Hopper (sm_90) GEMM written in Pallas on the Mosaic GPU backend.

Design (one CTA per SM, persistent), one concern per module:
  * `config`: ``Config``, the shared-memory budget and the checks, default configs.
  * Grid: ``num_sms`` CTAs; each walks the flattened (batch, m_tiles, n_tiles)
    space strided by the CTA count. Optionally CTAs pair up in clusters of 2 that
    compute adjacent tiles and multicast the operand tile they share
    (``Config.cluster_m`` / ``cluster_n``). Within a batch entry the output tiles
    are visited in this order: ``plgpu.planar_snake`` bands of
    ``grid_tile_width`` tiles along ``grid_minor_dim``, so CTAs that run together
    share A rows / B columns in L2.
  * `kernel`: the K pipeline, a ``stages``-deep ring of swizzled shared-memory buffers
    for (block_m, block_k) A tiles and (block_k, block_n) B tiles, filled by TMA. One
    warp of the producer warpgroup issues the loads, in one loop over all of the CTA's
    (tile, K block) steps, so the next tile's loads start as soon as a buffer frees,
    during the previous tile's epilogue. ``num_compute_wgs`` consumer warpgroups each
    own a slice of the CTA tile (split along ``wg_split``) and run ``plgpu.wgmma``
    into an f32 register accumulator.
  * `stream_k` (``Config.stream_k``): when the tiles leave the last round of CTAs
    idle enough to pay for it, the last tiles are cut into equal ranges of K
    steps, one per CTA, and a tile cut between CTAs is summed through an f32
    buffer in global memory, ordered by Pallas global semaphores.
  * `epilogue` (consumer warpgroups, overlapped with the producer already loading
    the next tile): the partial sum of a stream-K tile's other K range is added,
    the accumulator is scaled by alpha, beta*C is added (C fetched by TMA into
    shared memory), bias and activation, the cast to the out dtype, stores with TMA
    from double-buffered shared-memory (epi_block_m, epi_block_n) sub-tiles.
  * `split`: float32 from 16-bit pieces (``precision="float32_accurate"``,
    ``"float32_f16x3"``, the BF16_BF16_F32_X* presets).
  * `pair`: K split over two GPUs, summed by the kernels through peer memory.
  * `layout`: the TMA tiling, swizzle and padding shared by every kernel.

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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.core import precision as _precision
from pallas_gemm.mgpu import hw
from pallas_gemm.mgpu import launch as _launch
from pallas_gemm.matmul.mosaic import pair as _pair
from pallas_gemm.matmul.mosaic import split as _split
from pallas_gemm.matmul.mosaic.config import (SMEM_BYTES_PER_BLOCK, TUNING_GRID, _SUPPORTED_DTYPES,
                                       Config, _num_sms, _swizzle_minor, check_fits,
                                       check_layout, check_smem_budget, check_split,
                                       default_config, smem_bytes)
from pallas_gemm.matmul.mosaic.epilogue import Epilogue
from pallas_gemm.matmul.mosaic.kernel import Problem, kernel
from pallas_gemm.mgpu.layout import pad_for_tma, tma_padded_shape, tma_tile
from pallas_gemm.mgpu.unpad import unpad
from pallas_gemm.matmul.mosaic.pair import Peer, pair_reason
# gemm looks stream_k_schedule up here, so that a test can wrap it (mosaic.stream_k_schedule).
from pallas_gemm.matmul.mosaic.stream_k import StreamK, stream_k_schedule

__all__ = [
    "NAME", "FUSED_ACTIVATIONS", "FUSED_GATES", "INTERPRET_EFFECTS", "KEEPS_PRE",
    "SMEM_BYTES_PER_BLOCK", "TUNING_GRID",
    "Config", "Peer", "StreamK", "check_fits", "check_layout", "check_smem_budget",
    "check_split", "default_config", "gemm", "pair_gemm", "pair_reason", "smem_bytes",
    "stream_k_schedule", "supports", "unavailable_reason",
]

NAME = "mosaic"
# The bias and these activations run in the kernel's epilogue. Not gelu_exact: its
# test failed on the H200 with Mosaic GPU's erf lowering (cause not known);
# op.py applies it in XLA after the kernel's f32 result (bias still fused).
FUSED_ACTIVATIONS = (None, "relu", "gelu", "silu")
# c_gate: the epilogue multiplies by act'(C) in place of adding beta * C (op.py's gated
# backward GEMM); the same functions as above, and erf's derivative needs erf.
FUSED_GATES = ("relu", "gelu", "silu")
# keep_pre: the epilogue also stores the pre-activation z beside act(z) (op.Plan.keep_pre).
KEEPS_PRE = True
# Interpret mode (force_gpu_interpret_mode) keeps its simulated GPU state through ordered
# io_callbacks: effects the primitive declares, and which custom_partitioning cannot lower
# (op.partitioned).
INTERPRET_EFFECTS = True

# ----------------------------------------------------------------------------
# Availability
# ----------------------------------------------------------------------------


def unavailable_reason() -> str | None:
  """None when the kernel can run here: an sm_90 GPU, or a CPU (interpret)."""
  return hw.unavailable_reason()


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
# Launcher
# ----------------------------------------------------------------------------


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
    if (why := _pair.shape_reason(m, n, k, dtype, interpret)
        or _pair.tiles_reason(m, n, config)) is not None:
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
    # float16 pieces of operands scaled into float16's range; the epilogue runs in XLA
    # after the unscaling.
    a, b, ka, kb = _split.scale_operands(a, b, transpose_a=transpose_a,
                                         transpose_b=transpose_b)
    product = gemm(a, b, None, alpha=1.0, beta=0.0, transpose_a=transpose_a,
                   transpose_b=transpose_b, precision=dataclasses.replace(split, scaled=False),
                   out_dtype=jnp.float32, config=config, interpret=interpret)
    return _split.unscale(product, ka, kb, c, bias, transpose_a=transpose_a,
                          transpose_b=transpose_b, alpha=alpha, beta=beta,
                          activation=activation, c_gate=c_gate, keep_pre=keep_pre,
                          out_dtype=out_dtype)

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
    # (float16 pieces: of operands `split.scale_operands` scaled)
    a, b = (_precision.pieces(x, split) for x in (a, b))
    tile_dtype = jnp.dtype(split.dtype)

  if c is not None:
    if not jnp.issubdtype(c.dtype, jnp.floating) or c.dtype.itemsize > 4:
      c = c.astype(jnp.float32)
  c_dtype = None if c is None else c.dtype
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
      pad_for_tma(x, tile, minor) if split is None
      else [pad_for_tma(p, tile, minor) for p in x])
  a = pad(a, tma_tile(_swizzle_minor(config, a_minor, a_k_major, split), tile_dtype), a_minor)
  b = pad(b, tma_tile(_swizzle_minor(config, b_minor, b_k_major, split), tile_dtype), b_minor)
  if c is not None:
    c = pad_for_tma(c, tma_tile(config.epi_block_n, c.dtype), bn)
  m_out, n_out = tma_padded_shape(
      m, n, tma_tile(config.epi_block_n, out_dtype))
  n_out = max(n_out, bn)  # as for the operands: never narrower than the block
  if bias is not None:  # every sub-tile reads a full epi_n slice of it
    bias = jnp.pad(bias.astype(jnp.float32), (0, n_out - n))

  # One CTA (or cluster of CTAs) per SM (or SM pair).
  num_ctas = _num_sms(config, interpret) // config.cluster_size
  tiles = batch * -(-rows // (bm * config.cluster_m)) * -(-n // (bn * config.cluster_n))
  stream_k = None if peer else stream_k_schedule(config, tiles, -(-k // bk), num_ctas,
                                                 interpret)
  kernel_body = functools.partial(
      kernel,
      problem=Problem(config=config, m=rows, n=n, k=k, batch=batch, a_k_major=a_k_major,
                      b_k_major=b_k_major, b_shared=b_shared, num_ctas=num_ctas,
                      stream_k=stream_k, split=split, peer=peer),
      epilogue=Epilogue(alpha=float(alpha), beta=float(beta), activation=activation,
                        c_gate=c_gate))
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
      _pair.handshake(peer, config, num_ctas)

  body.__name__ = "pallas_gemm_mosaic"  # kernel name in profiles
  ab = (a, b) if split is None else (*a, *b)
  operands = tuple(x for x in (*ab, c, bias) if x is not None)

  call = _launch.warpgroup_kernel(
      body, out_type=out_type, num_ctas=num_ctas, num_compute_wgs=config.num_compute_wgs,
      cluster_size=config.cluster_size,
      approx_math=_approx_epilogue(activation, c_gate, out_dtype))
  outs = _launch.call(call, *operands, interpret=interpret)
  outs = outs[:1 + keep_pre]  # without the partials
  if (m_out, n_out) != (m, n):
    outs = tuple(unpad(out, m, n, interpret=interpret) for out in outs)
  return tuple(outs) if keep_pre else outs[0]


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
  send, finish = _pair.pair_configs(m, n, k, a.dtype, out_dtype, num_sms)
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
  more than reading C (0.10; H100)."""
  return (jnp.dtype(out_dtype) == jnp.bfloat16
          and bool({activation, c_gate} & {"gelu", "silu"}))
