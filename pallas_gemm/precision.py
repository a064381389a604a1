"""What `precision=` means in pallas_gemm, and the bf16 splits behind the FP32 emulations.

A gemm precision is one of
  * None or a `jax.lax.Precision` (as for jnp.dot: for float32 inputs HIGHEST is IEEE
    fp32, the others allow TF32);
  * a `jax.lax.DotAlgorithmPreset`, with jnp.dot's meaning (the input dtypes it names
    must match the operands');
  * "float32_accurate": float32 inputs on tensor cores with an error no worse than IEEE
    SGEMM's. The name follows jax's own precision names ("float32", "tensorfloat32",
    "bfloat16" say what accuracy one gets, not how); the suffix says that this is
    float32's accuracy, not its algorithm.

The emulations split each float32 operand into bf16 pieces, x = p0 + p1 + p2 (+ tiny),
with |p1| <= 2^-8 |x| and |p2| <= 2^-16 |x| (round-to-nearest splits, each piece 8
significant bits), and sum the piece products p_i q_j that matter (`Split.products`).
An XLA pass writes the pieces (`split`), and the Mosaic GPU kernel loads them
by TMA (see `mosaic` for why the split is no longer made inside the kernel).

Error model (relative to sum_k |a_ik b_kj|, per output element):
  * dropped products: X3 drops p1 q1 and smaller, <= 2^-16 per product (~2^-18
    typical); X6 drops p1 q2, p2 q1, p2 q2, <= 2^-23 (~2^-25 typical): below
    float32's own rounding (2^-24), so X6 is the float32_accurate scheme. X9 adds
    those three back: <= 2^-24 from the last piece's rounding.
  * accumulation: Hopper's tensor cores add into an f32 accumulator with truncation
    (not IEEE round-to-nearest), so a long K accumulated in the tensor core drifts:
    jnp.dot's X6 error grows from 4.4e-6 (4096^3) to 9.1e-6 (8192^3). The kernel sums
    each K block's products (smallest first) into a zeroed accumulator and adds the
    block into an f32 register sum with IEEE adds, so the drift is bounded by one
    block's truncations, and the block sums round like SGEMM's partial sums.
  * range: pieces are not rescaled. For |x| >= 2^-102 every remainder is 0 or a
    normal float32 and every piece a normal bf16, so the pieces sum to x within
    2^-24 |x|. Below that the last remainder can be subnormal, and a backend that
    flushes subnormals (XLA's CPU backend does) makes it 0: the split keeps 16 bits
    there, and a subnormal x (below 2^-126) becomes 0, an absolute error under
    2^-126 |b| per product. The pieces before the last are rounded from their
    remainder clamped to bf16's largest finite value, so no piece overflows where x
    does not; inf and NaN propagate as in IEEE arithmetic (an infinite x has pieces
    max, max, inf: sums of its products are inf, or NaN where multiplied by 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

FLOAT32_ACCURATE = "float32_accurate"
Preset = jax.lax.DotAlgorithmPreset
_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


@dataclasses.dataclass(frozen=True)
class Split:
  """A float32 GEMM from bf16 pieces: `pieces` per operand, `products` (i, j) = p_i q_j,
  listed smallest first (the order the kernel accumulates them in)."""

  pieces: int
  products: tuple[tuple[int, int], ...]

  @property
  def name(self) -> str:
    return f"bf16x{len(self.products)}"


def _smallest_first(pieces: int, max_order: int) -> tuple[tuple[int, int], ...]:
  pairs = [(i, j) for i in range(pieces) for j in range(pieces) if i + j <= max_order]
  return tuple(sorted(pairs, key=lambda p: (-(p[0] + p[1]), p)))


_X6 = Split(3, _smallest_first(3, 2))
SPLITS: dict = {
    Preset.BF16_BF16_F32: Split(1, ((0, 0),)),
    Preset.BF16_BF16_F32_X3: Split(2, _smallest_first(2, 1)),
    Preset.BF16_BF16_F32_X6: _X6,
    Preset.BF16_BF16_F32_X9: Split(3, _smallest_first(3, 4)),
    FLOAT32_ACCURATE: _X6,
}


def normalize(precision):
  """The gemm precision for a user's `precision=` (see the module docstring).

  Returns None, a jax.lax.Precision, a DotAlgorithmPreset or FLOAT32_ACCURATE.
  Raises ValueError/TypeError naming `precision` for anything else.
  """
  if precision is None or isinstance(precision, (jax.lax.Precision, Preset)):
    return None if precision == Preset.DEFAULT else precision
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2 or precision[0] != precision[1]:
      raise ValueError(f"precision must be one Precision for both operands; got {precision!r}")
    return normalize(precision[0])
  if isinstance(precision, str):
    if precision == FLOAT32_ACCURATE:
      return precision
    try:
      return jax.lax.Precision(precision)
    except ValueError:
      pass
    try:
      return normalize(Preset[precision.upper()])
    except KeyError:
      raise ValueError(
          f"precision must be None, a jax.lax.Precision name ('default', 'high', 'highest'), "
          f"a jax.lax.DotAlgorithmPreset name or {FLOAT32_ACCURATE!r}; got {precision!r}"
      ) from None
  raise TypeError(f"precision must be None, a str, a jax.lax.Precision or a "
                  f"jax.lax.DotAlgorithmPreset; got {type(precision).__name__}")


def check_dtype(precision, dtype) -> None:
  """Raises ValueError when `precision` does not apply to inputs of `dtype`."""
  dtype = np.dtype(dtype)
  if precision == FLOAT32_ACCURATE and dtype != np.float32:
    raise ValueError(f"precision={FLOAT32_ACCURATE!r} is for float32 inputs; got {dtype}")
  if isinstance(precision, Preset):
    allowed = precision.supported_lhs_types
    if allowed is not None and dtype not in [np.dtype(t) for t in allowed]:
      raise ValueError(
          f"precision={precision.name} takes inputs of "
          f"{', '.join(np.dtype(t).name for t in allowed)}; got {dtype}")


def effective(precision, dtype):
  """`precision` with the presets that name plain arithmetic on `dtype` replaced by it:
  a bf16 product of bf16 inputs, f16 of f16 inputs (None: exact products), fp32 of
  float32 (HIGHEST). Other presets are kept. TF32_TF32_F32 is kept too: it rounds the
  inputs to TF32, where Precision.DEFAULT lets wgmma truncate them (mosaic at 4097^3:
  relerr 7.8e-4 vs jnp.dot's 2.9e-4, H100, session 8)."""
  dtype = np.dtype(dtype)
  if not isinstance(precision, Preset):
    return precision
  if dtype.itemsize == 2 and precision in (Preset.BF16_BF16_F32, Preset.F16_F16_F32):
    return None
  if dtype == np.float32 and precision == Preset.F32_F32_F32:
    return jax.lax.Precision.HIGHEST
  return precision


def for_lax(precision):
  """What jax.lax.dot_general gets for a gemm precision: "float32_accurate" becomes
  Precision.HIGHEST (IEEE SGEMM, the contract's own yardstick); the rest pass as they are."""
  return jax.lax.Precision.HIGHEST if precision == FLOAT32_ACCURATE else precision


def split_of(precision, dtype) -> Split | None:
  """The bf16 split that computes float32 inputs at `precision`, or None."""
  if np.dtype(dtype) != np.float32:
    return None
  return SPLITS.get(precision)


def split(x: jax.Array, pieces: int) -> list[jax.Array]:
  """x (float32) as `pieces` bf16 arrays, largest first (round-to-nearest splits).

  Runs in XLA before the kernel (`mosaic.gemm`: one fusion with three outputs, the
  kernel's operands; stacked into one array they took a second pass). Every piece but the last
  is rounded from its remainder clamped to bf16's largest finite value: the first so
  that it never overflows where x is finite, the others so that an infinite x leaves
  infinite remainders (inf - max = inf) rather than inf - inf = NaN. The remainders
  are exact in float32.
  """
  out = []
  rest = x
  for i in range(pieces):
    src = jnp.clip(rest, -_BF16_MAX, _BF16_MAX) if i + 1 < pieces else rest
    # Rounded to bf16 by reduce_precision, not by a bf16 round trip: XLA:GPU (which
    # allows excess precision) drops f32 -> bf16 -> f32 as a no-op, which made every
    # remainder 0 and the product a bf16 one (H100, session 11).
    piece = lax.reduce_precision(src, exponent_bits=8, mantissa_bits=7)
    out.append(piece.astype(jnp.bfloat16))
    if i + 1 < pieces:
      rest = rest - piece
  return out


def emulate(a: jax.Array, b: jax.Array, s: Split) -> jax.Array:
  """The split product a @ b (2-D float32) with each piece product in float32 (the
  kernel's arithmetic, less its accumulation order): a CPU check of the split."""
  ap, bp = split(a, s.pieces), split(b, s.pieces)
  out = jnp.zeros((a.shape[0], b.shape[1]), jnp.float32)
  for i, j in s.products:
    out = out + jnp.dot(ap[i].astype(jnp.float32), bp[j].astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
  return out
