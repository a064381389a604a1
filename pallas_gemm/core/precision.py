"""What `precision=` means in pallas_gemm, and the bf16 splits behind the FP32 emulations.

A gemm precision is one of
  * None or a `jax.lax.Precision` (as for jnp.dot: for float32 inputs HIGHEST is IEEE
    fp32, the others allow TF32);
  * a `jax.lax.DotAlgorithmPreset`, with jnp.dot's meaning (the input dtypes it names
    must match the operands');
  * "float32_accurate": float32 inputs on tensor cores with IEEE SGEMM's error: below it
    where many terms of a size are summed, within 2x of it where a few terms dominate (the
    dropped cross terms, up to 2^-23 of a product, beside SGEMM's 2^-24). The name
    follows jax's own precision names ("float32", "tensorfloat32", "bfloat16" say what
    accuracy one gets, not how); the suffix says that this is float32's accuracy, not its
    algorithm.
  * "float32_f16x3": float32 inputs on tensor cores, each element kept to 2^-22 of
    itself (23 bits, float32 has 24) or to 2^-38 of its row's (A) or column's (B) largest
    magnitude; see "float16 pieces" below. Opt-in, named by its
    algorithm: its error is below SGEMM's where many terms of similar size are summed
    (SGEMM's rounding grows with K), and up to 1.75x SGEMM's where a few terms dominate
    (measured on the H200).

The emulations split each float32 operand into bf16 pieces, x = p0 + p1 + p2 (+ tiny),
with |p1| <= 2^-8 |x| and |p2| <= 2^-16 |x| (round-to-nearest splits, each piece 8
significant bits), and sum the piece products p_i q_j that matter (`Split.products`).
An XLA pass writes the pieces (`split`), and the Mosaic GPU kernel loads them
by TMA (see `mosaic/split.py` for why the split is not made inside the kernel).

Why bf16 X6 carries float32_accurate (H100/H200 ceilings: bf16 989 TFLOP/s, TF32 495):
  * bf16 X6: ~165 TFLOP/s for the six products, and its dropped terms (<= 2^-23) are below
    float32's own rounding. Measured 2.2-2.6x SGEMM (H200).
  * 3xTF32: the same ~165 TFLOP/s ceiling, but two TF32 pieces keep ~22 bits (the
    dropped lo*lo term is ~2^-22), and wgmma reads 32-bit operands only K-major (a
    transposed copy for one operand). Not built: no faster, and less accurate.
  * bf16 X9: ~110 TFLOP/s, for terms X6 already keeps below float32's rounding.
  * Ozaki int8 slices: ~247 TFLOP/s at 8 moduli, but the exponent scaling and the
    reconstruction are memory-bound passes outside the GEMM (the published GH200 figure is
    1.7-1.8x SGEMM at 4096^3, below X6's 2.5x here), and per-row scaling loses precision
    on rows with a wide dynamic range (the "range" family). Not built.
  * float16 pieces, 3 products (~330 TFLOP/s): measured fastest (3.5-3.8x SGEMM), but not
    exact where SGEMM is (below), so it is the opt-in float32_f16x3.

float16 pieces ("float32_f16x3"): each row of A and column of B is scaled by a power of two
(exact) so that its largest finite magnitude lies in [2^13, 2^14), split into two float16
pieces x = p0 + p1 + r (round-to-nearest, 11 significant bits each, |r| <= 2^-22 |x|, and
<= 2^-25 absolute where p1 is a float16 subnormal: 2^-38 of the line's largest at most; p0 is 0
below 2^-14), and p0 q0 + p0 q1 + p1 q0 run as three float16 products
(p1 q1 <= 2^-22 dropped), accumulated as below; the result is scaled back. On the H200
its relerr was 0.2-0.26x SGEMM's on N(0,1) and wide-range inputs at
4096^3-8192^3, but 0.8-1.75x SGEMM's on the "range" inputs of the tests (magnitudes
2^0..2^115 in one row: a few terms dominate, and 23 bits per element show beside
float32's 24). Where SGEMM is exact it is not: one_hot(ids) @ table changes a quarter of the
gathered elements (by up to 2^-23 of themselves on N(0,1) tables). With that, and elements
below 2^-39 of their line's largest becoming 0, float32_accurate stays bf16 X6. (No cheap
guard on the inputs tells these cases apart: a one-hot row has no dynamic range at all.)

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
    does not. An infinite x has pieces max, max, inf, so beside an N(0,1)-sized b its
    products sum to IEEE's +-inf (NaN where multiplied by 0), and NaN propagates.
  * not IEEE at overflow: a cross product such as p0 q1 has the
    sign of q1, a remainder, not of the true product. It overflows where the true
    product exceeds float32's range by 2^8 (a result that overflows), where an infinite
    x meets |b| > 2^8 (X3, X6), and for X9's p2 q1 and p2 q2 with any b. The sum is then
    NaN where SGEMM gives +-inf: non-finite either way, but the wrong one. The float16
    pieces do not have this (their lines are scaled first, and the result overflows only
    when scaled back); scaling the bf16 lines the same way would fix it, at the cost of a
    reduction pass over both operands.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

FLOAT32_ACCURATE = "float32_accurate"
FLOAT32_F16X3 = "float32_f16x3"
_OWN_NAMES = (FLOAT32_ACCURATE, FLOAT32_F16X3)
Preset = jax.lax.DotAlgorithmPreset
_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


@dataclasses.dataclass(frozen=True)
class Split:
  """A float32 GEMM from 16-bit pieces: `pieces` per operand, `products` (i, j) = p_i q_j,
  listed smallest first (the order the kernel accumulates them in).

  dtype: the pieces' type. "float16" pieces (11 significant bits, 5 exponent bits) are
    made from operands scaled by powers of two into float16's range, per row of A and
    column of B (`scaled`; `scale_exponents`, `f16_pieces`).
  """

  pieces: int
  products: tuple[tuple[int, int], ...]
  dtype: str = "bfloat16"
  scaled: bool = False

  @property
  def name(self) -> str:
    return f"{'f16' if self.dtype == 'float16' else 'bf16'}x{len(self.products)}"


def _smallest_first(pieces: int, max_order: int) -> tuple[tuple[int, int], ...]:
  pairs = [(i, j) for i in range(pieces) for j in range(pieces) if i + j <= max_order]
  return tuple(sorted(pairs, key=lambda p: (-(p[0] + p[1]), p)))


_X6 = Split(3, _smallest_first(3, 2))
# "float32_f16x3": two float16 pieces of operands scaled per row of A / column of B, three
# products (p0 q1, p1 q0, p0 q0): half of X6's products at the same 16-bit rate.
F16X3 = Split(2, _smallest_first(2, 1), dtype="float16", scaled=True)
SPLITS: dict = {
    Preset.BF16_BF16_F32: Split(1, ((0, 0),)),
    Preset.BF16_BF16_F32_X3: Split(2, _smallest_first(2, 1)),
    Preset.BF16_BF16_F32_X6: _X6,
    Preset.BF16_BF16_F32_X9: Split(3, _smallest_first(3, 4)),
    FLOAT32_ACCURATE: _X6,
    FLOAT32_F16X3: F16X3,
}


def normalize(precision):
  """The gemm precision for a user's `precision=` (see the module docstring).

  Returns None, a jax.lax.Precision, a DotAlgorithmPreset, FLOAT32_ACCURATE or
  FLOAT32_F16X3.
  Raises ValueError/TypeError naming `precision` for anything else.
  """
  if precision is None or isinstance(precision, (jax.lax.Precision, Preset)):
    return None if precision == Preset.DEFAULT else precision
  if isinstance(precision, jax.lax.DotAlgorithm):  # (a NamedTuple, not a pair)
    raise ValueError(f"precision: gemm takes a jax.lax.DotAlgorithmPreset, not a custom "
                     f"jax.lax.DotAlgorithm; got {precision!r}")
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2 or normalize(precision[0]) != normalize(precision[1]):
      raise ValueError(f"precision must be one Precision for both operands; got {precision!r}")
    return normalize(precision[0])
  if isinstance(precision, str):
    if precision in _OWN_NAMES:
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
          f"a jax.lax.DotAlgorithmPreset name, {FLOAT32_ACCURATE!r} or {FLOAT32_F16X3!r};"
          f" got {precision!r}"
      ) from None
  raise TypeError(f"precision must be None, a str, a jax.lax.Precision or a "
                  f"jax.lax.DotAlgorithmPreset; got {type(precision).__name__}")


def check_dtype(precision, dtype) -> None:
  """Raises ValueError when `precision` does not apply to inputs of `dtype`."""
  dtype = np.dtype(dtype)
  if precision in _OWN_NAMES and dtype != np.float32:
    raise ValueError(f"precision={precision!r} is for float32 inputs; got {dtype}")
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
  relerr 7.8e-4 vs jnp.dot's 2.9e-4, H100)."""
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
  return jax.lax.Precision.HIGHEST if precision in _OWN_NAMES else precision


def split_of(precision, dtype) -> Split | None:
  """The split that computes float32 inputs at `precision` (a Split passes as itself:
  the backends' own calls for a scaled split's parts), or None."""
  if np.dtype(dtype) != np.float32:
    return None
  return precision if isinstance(precision, Split) else SPLITS.get(precision)


# float16 pieces: the scaled operand's largest magnitude lies in [2^13, 2^14), below
# float16's largest finite value (65504) with room for rounding (`f16_pieces` has the
# resulting bound per element).
_F16_TOP = 14
_F16 = dict(exponent_bits=5, mantissa_bits=10)  # reduce_precision to float16
_F16_MAX = float(jnp.finfo(jnp.float16).max)


def scale_exponents(x: jax.Array, axis: int) -> jax.Array:
  """k (int32, keepdims over `axis`): x * 2^k has its largest finite magnitude along
  `axis` in [2^13, 2^14) (k = 14 for a line of zeros). Infinities and NaNs are left out of
  the maximum, so that the finite values beside them keep their scale (and their pieces
  stay finite): an inf still gives inf products, a NaN NaN ones."""
  finite = jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)
  _, e = jnp.frexp(jnp.max(finite, axis=axis, keepdims=True))
  return _F16_TOP - e


def f16_pieces(xs: jax.Array) -> list[jax.Array]:
  """The two float16 pieces of a scaled operand (x * 2^k, `scale_exponents`), largest first.

  The first piece is rounded by reduce_precision, not by a float16 round trip (which
  XLA:GPU may drop as it dropped bf16's), from x clamped to float16's largest finite value
  (an infinite x then leaves an infinite remainder): it rounds as float16 does but flushes
  float16's subnormals to 0, so the piece is an exact float16 value and the remainder
  exact in float32. The remainder is then converted (round to nearest), keeping float16's
  subnormals: it loses bits only below 2^-14, i.e. each element is kept within
  max(2^-22 |x|, 2^-25) of itself, 2^-25 being at most 2^-38 of its line's largest.
  """
  hi = lax.reduce_precision(jnp.clip(xs, -_F16_MAX, _F16_MAX), **_F16)
  return [hi.astype(jnp.float16), (xs - hi).astype(jnp.float16)]


def pieces(x: jax.Array, s: Split) -> list[jax.Array]:
  """x's pieces for split `s`: float16 ones of an already scaled x, else bf16 ones."""
  return f16_pieces(x) if s.dtype == "float16" else split(x, s.pieces)


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
    # remainder 0 and the product a bf16 one (H100).
    piece = lax.reduce_precision(src, exponent_bits=8, mantissa_bits=7)
    out.append(piece.astype(jnp.bfloat16))
    if i + 1 < pieces:
      rest = rest - piece
  return out


def emulate(a: jax.Array, b: jax.Array, s: Split) -> jax.Array:
  """The split product a @ b (2-D float32) with each piece product in float32 (the
  kernel's arithmetic, less its accumulation order): a CPU check of the split."""
  if s.scaled:
    ka, kb = scale_exponents(a, 1), scale_exponents(b, 0)
    a, b = jnp.ldexp(a, ka), jnp.ldexp(b, kb)
    return jnp.ldexp(_piece_products(pieces(a, s), pieces(b, s), s), -(ka + kb))
  return _piece_products(pieces(a, s), pieces(b, s), s)


def _piece_products(ap, bp, s: Split) -> jax.Array:
  out = jnp.zeros((ap[0].shape[0], bp[0].shape[1]), jnp.float32)
  for i, j in s.products:
    out = out + jnp.dot(ap[i].astype(jnp.float32), bp[j].astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
  return out
