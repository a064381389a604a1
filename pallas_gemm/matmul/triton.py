"""Portable GEMM backend: Pallas with the Triton lowering.

Computes ``alpha * op(a) @ op(b) + beta * c`` per batch entry (see ``_contract.md``).

Tiling hierarchy (the register-tiled SGEMM's of `cuda_sgemm.cu`, expressed for Triton):
  * thread block -- one program computes a ``block_m x block_n`` tile of C. The grid is
    ``(tiles, batch)``; the 1-D tile id is mapped to ``(tile_m, tile_n)`` in groups of
    ``group_m`` tile rows (Triton tutorial 03), so programs that run together share A
    panels and B panels in L2.
  * K pipeline -- BlockSpecs hand each program its ``block_m``-row panel of A and its
    ``block_n``-column panel of B over the full K; the kernel walks K in ``block_k``
    slices with a ``lax.fori_loop``, which Triton software-pipelines over
    ``num_stages`` shared-memory buffers (cp.async). A K grid axis would race on C.
  * warps / threads -- Triton splits the tile over ``num_warps`` warps and picks the
    per-thread fragments and the tensor-core (mma/wgmma) instruction itself.

Edges: M, N and K may have any size. Shapes are static, so masks are emitted only on the
axes that do not divide the block: loads past M/N are masked (they would read past the
buffer), the K tail is one peeled, masked step whose out-of-range A *and* B elements are
zero-filled (0 * garbage could be NaN), and stores past M/N are masked.

The Pallas Triton lowering is deprecated in jax 0.11 and emits a DeprecationWarning on
every compilation (each new shape/config); this module filters exactly that message.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

NAME = "triton"

# Emitted by jax/_src/pallas/triton/pallas_call_registration.py at each lowering. The
# lowering runs at jit-compile time, outside any call-site context manager, so a
# module-level filter scoped to this exact message is the only place it can go.
warnings.filterwarnings(
    "ignore",
    message=r"The Pallas Triton backend is deprecated",
    category=DeprecationWarning,
)

_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

# Triton's tensor-core dot needs every tile dimension >= 16.
_MIN_BLOCK = 16
# Triton tensors hold at most 2**20 elements; keep tiles well inside it.
_MAX_BLOCK = 512
# CUDA allows 1024 threads per block.
_MAX_WARPS = 32
_MAX_STAGES = 8


def _is_power_of_two(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tile shape and launch parameters of the Triton GEMM kernel.

  block_m, block_n, block_k: the C tile one program computes and the K slice it loads per
    pipeline step (CUDA names BM, BN, BK).
  group_m: tile rows per L2 group in the program-to-tile order.
  num_warps: warps per program (Triton splits the tile among them).
  num_stages: shared-memory buffers of Triton's software pipeline over K.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 32
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(
            f"Config.{field.name} must be an int, got {value!r} "
            f"({type(value).__name__})."
        )
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if not _is_power_of_two(value):
        raise ValueError(
            f"Config.{name} must be a power of two (Triton tensors need power-of-two "
            f"sizes), got {value}."
        )
      if not _MIN_BLOCK <= value <= _MAX_BLOCK:
        raise ValueError(
            f"Config.{name} must be in [{_MIN_BLOCK}, {_MAX_BLOCK}] (Triton's "
            f"tensor-core dot needs tile dims >= {_MIN_BLOCK}; larger tiles exceed "
            f"registers and shared memory), got {value}."
        )
    if not _is_power_of_two(self.group_m):
      raise ValueError(
          f"Config.group_m must be a power of two >= 1 (tile rows per L2 group), "
          f"got {self.group_m}."
      )
    if not _is_power_of_two(self.num_warps) or self.num_warps > _MAX_WARPS:
      raise ValueError(
          f"Config.num_warps must be a power of two in [1, {_MAX_WARPS}] (Triton lays "
          f"tiles out over power-of-two warp counts; CUDA caps a block at 1024 "
          f"threads), got {self.num_warps}."
      )
    if not 1 <= self.num_stages <= _MAX_STAGES:
      raise ValueError(
          f"Config.num_stages must be in [1, {_MAX_STAGES}] (shared-memory buffers of "
          f"the K pipeline), got {self.num_stages}."
      )


def shared_memory_bytes(config: Config, dtype) -> int:
  """Shared memory the K pipeline needs: num_stages buffers of an A and a B slice."""
  itemsize = np.dtype(dtype).itemsize
  per_stage = (config.block_m + config.block_n) * config.block_k * itemsize
  return config.num_stages * per_stage


def _pow2_at_least(x: int, floor: int) -> int:
  return max(floor, 1 << max(0, int(x) - 1).bit_length())


# Autotuning candidates (tuning.default_candidates reads TUNING_GRID).
TUNING_GRID = {
    "16bit": {("block_m", "block_n", "block_k", "num_warps"): (
                  (128, 256, 64, 8), (256, 128, 64, 8), (128, 128, 64, 8),
                  (128, 128, 64, 4), (64, 256, 64, 4), (128, 64, 64, 4),
                  (64, 128, 64, 4), (64, 64, 64, 4)),
              "num_stages": (3, 4), "group_m": (8,)},
    "f32": {("block_m", "block_n", "block_k", "num_warps"): (
                (128, 128, 32, 8), (128, 256, 32, 8), (256, 128, 32, 8),
                (128, 64, 32, 4), (64, 128, 32, 4), (64, 64, 32, 4)),
            "num_stages": (2, 3, 4), "group_m": (8,)},
}


def default_config(m: int, n: int, k: int, dtype, *, out_dtype=None, c_dtype=None,
                   precision=None) -> Config:
  """A shape/dtype-based starting point (measured on the H200 at 4096^3). The epilogue's
  dtypes and the precision do not change it."""
  del out_dtype, c_dtype, precision
  dtype = np.dtype(dtype)
  if dtype.itemsize == 2:
    block_m, block_n, block_k = 128, 256, 64
  else:
    block_m, block_n, block_k = 128, 128, 32
  # Skinny or small problems: no tile wider than the (rounded-up) matrix.
  block_m = min(block_m, _pow2_at_least(m, _MIN_BLOCK))
  block_n = min(block_n, _pow2_at_least(n, _MIN_BLOCK))
  block_k = min(block_k, _pow2_at_least(k, _MIN_BLOCK))
  # Too few tiles leave SMs idle (H100/H200 have 132): halve the larger side
  # while the grid is smaller than one wave and tiles stay >= 64.
  def tiles(bm, bn):
    return pl.cdiv(m, bm) * pl.cdiv(n, bn)
  while tiles(block_m, block_n) < 132:
    if block_n >= block_m and block_n > 64:
      block_n //= 2
    elif block_m > 64:
      block_m //= 2
    else:
      break
  area = block_m * block_n
  num_warps = 8 if area >= 128 * 128 else 4
  return Config(
      block_m=block_m,
      block_n=block_n,
      block_k=block_k,
      group_m=8,
      num_warps=num_warps,
      num_stages=3,
  )


def unavailable_reason() -> str | None:
  backend = jax.default_backend()
  if backend == "cpu":
    return None  # The Pallas interpreter runs the kernel.
  if backend != "gpu":
    return f"Pallas Triton needs a CUDA GPU (or the CPU interpreter); backend is {backend!r}."
  device = jax.devices()[0]
  cc = getattr(device, "compute_capability", None)
  try:
    major, minor = (int(x) for x in str(cc).split("."))
  except ValueError:
    return f"Pallas Triton here needs an NVIDIA GPU; {device.device_kind!r} reports {cc!r}."
  if (major, minor) < (8, 0):
    return (
        f"Pallas Triton GEMM needs compute capability >= 8.0 (bf16 tensor cores, "
        f"cp.async); {device.device_kind!r} has {cc}."
    )
  return None


def supports(dtype, precision) -> str | None:
  if np.dtype(dtype) not in _DTYPES:
    return f"dtype {np.dtype(dtype)} is not supported (expected float32, bfloat16 or float16)."
  if precision is not None and not isinstance(precision, lax.Precision):
    return f"precision must be None or a jax.lax.Precision, got {precision!r}."
  return None


def _tile_coords(tile, *, tiles_m: int, tiles_n: int, group_m: int):
  """Maps a 1-D tile id to (tile_m, tile_n), column-major within groups of group_m rows."""
  tiles_per_group = group_m * tiles_n
  group = lax.div(tile, tiles_per_group)
  first_m = group * group_m
  group_rows = jnp.minimum(tiles_m - first_m, group_m)
  in_group = lax.rem(tile, tiles_per_group)
  return first_m + lax.rem(in_group, group_rows), lax.div(in_group, group_rows)


def _and(x, y):
  if x is None:
    return y
  if y is None:
    return x
  return x & y


def _outer_mask(rows, cols, shape):
  """(r, c) mask from optional per-row and per-column validity vectors."""
  mask = _and(
      None if rows is None else rows[:, None],
      None if cols is None else cols[None, :],
  )
  return None if mask is None else jnp.broadcast_to(mask, shape)


def _load(ref, idx, mask):
  if mask is None:
    return ref[idx]
  return pltriton.load(ref.at[idx], mask=mask, other=0)


def _gemm_kernel(
    a_ref, b_ref, *refs,
    m: int, n: int, k: int, config: Config, tiles_m: int, tiles_n: int,
    transpose_a: bool, transpose_b: bool, precision, alpha: float, beta: float,
):
  # a_ref: (block_m, K), or (K, block_m) when transpose_a   -- A panel, full K
  # b_ref: (K, block_n), or (block_n, K) when transpose_b   -- B panel, full K
  # c_ref: (block_m, block_n), only when beta != 0
  # o_ref: (block_m, block_n)
  *maybe_c_ref, o_ref = refs
  bm, bn, bk = config.block_m, config.block_n, config.block_k

  # Stage 1: which C tile, and which of its rows/columns exist (None: all of them).
  tile_m, tile_n = _tile_coords(
      pl.program_id(0), tiles_m=tiles_m, tiles_n=tiles_n, group_m=config.group_m
  )
  rows_ok = None
  if m % bm:
    rows_ok = tile_m * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0) < m  # (bm,)
  cols_ok = None
  if n % bn:
    cols_ok = tile_n * bn + lax.broadcasted_iota(jnp.int32, (bn,), 0) < n  # (bn,)

  def load_a(k0, k_ok):
    if transpose_a:
      return _load(a_ref, (pl.ds(k0, bk), slice(None)), _outer_mask(k_ok, rows_ok, (bk, bm)))
    return _load(a_ref, (slice(None), pl.ds(k0, bk)), _outer_mask(rows_ok, k_ok, (bm, bk)))

  def load_b(k0, k_ok):
    if transpose_b:
      return _load(b_ref, (slice(None), pl.ds(k0, bk)), _outer_mask(cols_ok, k_ok, (bn, bk)))
    return _load(b_ref, (pl.ds(k0, bk), slice(None)), _outer_mask(k_ok, cols_ok, (bk, bn)))

  # Contract A's K axis (0 when it is stored K-major) with B's K axis (1 when N-major):
  # the Triton lowering turns these into tt.trans of the tile feeding tt.dot.
  dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))

  def mma(acc, a, b):
    return acc + lax.dot_general(
        a, b, dims, precision=precision, preferred_element_type=jnp.float32
    )

  # Stage 2: the K loop over whole block_k slices (no K mask), pipelined by Triton.
  acc = jnp.zeros((bm, bn), jnp.float32)
  full_steps, tail = divmod(k, bk)
  if full_steps:
    def body(step, acc):
      k0 = pl.multiple_of(step * bk, bk)
      return mma(acc, load_a(k0, None), load_b(k0, None))
    acc = lax.fori_loop(0, full_steps, body, acc)
  # The ragged K tail: one masked step, out-of-range A and B elements read as zero.
  if tail:
    # A traced start: a static one past K would fail Pallas' trace-time bounds check.
    k0 = jnp.asarray(full_steps * bk, jnp.int32)
    k_ok = lax.broadcasted_iota(jnp.int32, (bk,), 0) < tail  # (bk,)
    acc = mma(acc, load_a(k0, k_ok), load_b(k0, k_ok))

  # Stage 3: epilogue and write-back, masked at the M/N edges.
  out_mask = _outer_mask(rows_ok, cols_ok, (bm, bn))
  if alpha != 1.0:
    acc = acc * alpha
  if beta != 0.0:
    [c_ref] = maybe_c_ref
    c = _load(c_ref, (slice(None), slice(None)), out_mask).astype(jnp.float32)
    acc = acc + beta * c
  out = acc.astype(o_ref.dtype)
  if out_mask is None:
    o_ref[...] = out
  else:
    pltriton.store(o_ref, out, mask=out_mask)


def gemm(
    a: jax.Array,
    b: jax.Array,
    c: jax.Array | None,
    *,
    alpha: float,
    beta: float,
    transpose_a: bool,
    transpose_b: bool,
    precision,
    out_dtype,
    config: Config,
    interpret: bool,
) -> jax.Array:
  """``alpha * op(a) @ op(b) + beta * c`` with the Pallas Triton kernel (see _contract.md)."""
  reason = supports(a.dtype, precision)
  if reason is not None:
    raise ValueError(f"a: {reason}")
  if a.ndim != 3 or b.ndim != 3:
    raise ValueError(f"a and b must be 3-D (batch, rows, cols), got a{a.shape} and b{b.shape}.")
  batch = a.shape[0]
  k, m = a.shape[1:] if transpose_a else a.shape[2:0:-1]
  n, k_b = b.shape[1:] if transpose_b else b.shape[2:0:-1]
  if k_b != k:
    raise ValueError(
        f"b: contraction size {k_b} does not match a's {k} "
        f"(a{a.shape}, b{b.shape}, transpose_a={transpose_a}, transpose_b={transpose_b})."
    )
  batch_b = b.shape[0]
  if batch_b not in (1, batch):
    raise ValueError(f"b: batch {batch_b} must be 1 or a's batch {batch}.")
  if beta != 0.0 and (c is None or c.shape != (batch, m, n)):
    raise ValueError(
        f"c: expected shape {(batch, m, n)} for beta={beta}, got "
        f"{None if c is None else c.shape}."
    )

  bm, bn, bk = config.block_m, config.block_n, config.block_k
  tiles_m, tiles_n = pl.cdiv(m, bm), pl.cdiv(n, bn)
  coords = functools.partial(
      _tile_coords, tiles_m=tiles_m, tiles_n=tiles_n, group_m=config.group_m
  )

  def tile_m_of(t):
    return coords(t)[0]

  def tile_n_of(t):
    return coords(t)[1]

  def b_batch(i):
    return i if batch_b == batch else 0  # batch_b == 1: one B shared by every entry

  # Grid (tile, batch): program_id(0) is the tile (CUDA x, launched first), so all tiles
  # of one batch entry are resident together.
  if transpose_a:
    a_spec = pl.BlockSpec((None, k, bm), lambda t, i: (i, 0, tile_m_of(t)))  # (K, block_m)
  else:
    a_spec = pl.BlockSpec((None, bm, k), lambda t, i: (i, tile_m_of(t), 0))  # (block_m, K)
  if transpose_b:
    b_spec = pl.BlockSpec((None, bn, k), lambda t, i: (b_batch(i), tile_n_of(t), 0))  # (block_n, K)
  else:
    b_spec = pl.BlockSpec((None, k, bn), lambda t, i: (b_batch(i), 0, tile_n_of(t)))  # (K, block_n)
  c_spec = pl.BlockSpec(
      (None, bm, bn), lambda t, i: (i, tile_m_of(t), tile_n_of(t))
  )  # (block_m, block_n)

  operands, in_specs = [a, b], [a_spec, b_spec]
  if beta != 0.0:  # beta == 0: C is never read (it may hold NaNs, or be None)
    operands.append(c)
    in_specs.append(c_spec)

  if np.dtype(a.dtype) == np.float32:
    # HIGHEST lowers to IEEE fp32 FMA-based mma; anything else to TF32 tensor cores.
    dot_precision = (
        lax.Precision.HIGHEST if precision == lax.Precision.HIGHEST else lax.Precision.DEFAULT
    )
  else:
    dot_precision = None  # bf16/f16 tensor cores, f32 accumulation

  kernel = functools.partial(
      _gemm_kernel,
      m=m, n=n, k=k, config=config, tiles_m=tiles_m, tiles_n=tiles_n,
      transpose_a=transpose_a, transpose_b=transpose_b, precision=dot_precision,
      alpha=float(alpha), beta=float(beta),
  )
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((batch, m, n), out_dtype),
      grid=(tiles_m * tiles_n, batch),
      in_specs=in_specs,
      out_specs=c_spec,
      compiler_params=pltriton.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages
      ),
      interpret=interpret,
      name=f"pallas_gemm_triton_{bm}x{bn}x{bk}",
  )(*operands)
