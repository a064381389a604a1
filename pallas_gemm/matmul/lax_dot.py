"""`jax.lax.dot_general` on top of `gemm`: an adapter from dimension numbers to one GEMM.

    out = dot_general(lhs, rhs, (((1,), (0,)), ((), ())))      # lhs @ rhs
    nn.Dense(features, dot_general=dot_general)                 # Flax linen
    jnp.einsum("bij,bjk->bik", x, y, _dot_general=dot_general)

Same signature and results as `jax.lax.dot_general` (output dims ordered batch, lhs free,
rhs free). Every case is normalised to ONE `gemm` call: each operand is transposed to
(batch..., free..., contract...) or (batch..., contract..., free...), whichever its dims
already are in (an identity permutation is not even emitted), then reshaped to (B, M, K)
/ (B, K, M) and (B, K, N) / (B, N, K) and the layout is told to `gemm` through
transpose_a / transpose_b. Without batch dims both operands are 2-D: the lhs free dims
fold into M, so a Dense layer on (batch, seq, features) is one (batch*seq, K) @ (K, N).
The result's shape and dtype are lax's (it is never weakly typed, lax's is when both
operands are).

What `gemm` cannot compute goes to `jax.lax.dot_general` with the same arguments, counted
in `FALLBACKS` (keyed by reason; counted when traced, so once per jit compilation):
  "input dtype"   an operand that is not float32/bfloat16/float16 (ints, f64, complex);
  "output dtype"  preferred_element_type (after JAX's canonicalisation) outside those three;
  "precision"     a custom `DotAlgorithm`, or a `DotAlgorithmPreset` whose input types are
                  not the operands' (see `_gemm_precision`); the presets themselves go
                  to gemm, which runs the float32 emulations in its own kernel;
  "explicit sharding"  an operand whose type is sharded over Explicit mesh axes: lax gives
                  the result a sharding type from its own rules, which the reshapes around
                  `gemm` and its primitive do not reproduce (in auto mode, shardings are
                  not types and `gemm` partitions as op.py says).

`gemm` takes one precision for both operands: of an unequal pair such as (HIGH, HIGHEST)
the higher is used (IEEE f32 when either operand asks for it).

`out_sharding` (Flax NNX always passes it, usually None; lax accepts it only over
Explicit mesh axes) is applied to the result with `jax.sharding.reshard`, as lax does for
`broadcast_in_dim`'s out_sharding; the GEMM's own partitioning is `gemm`'s (see op.py).
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.matmul import api
from pallas_gemm.core import precision as _precisions, sharding

# Reason -> how many dot_general calls (traces) went to jax.lax.dot_general instead of gemm.
FALLBACKS: collections.Counter[str] = collections.Counter()

_PRECISION_RANK = {jax.lax.Precision.DEFAULT: 0, jax.lax.Precision.HIGH: 1,
                   jax.lax.Precision.HIGHEST: 2}


def _gemm_precision(precision, dtype=np.float32) -> tuple[bool, object]:
  """(whether gemm can honour `precision` for inputs of `dtype`, the one value to pass it).

  The one place that decides which precisions gemm takes; `precision` has already passed
  lax.dot_general's own check.
  """
  if precision is None:
    # lax reads jax_default_matmul_precision (flag or context manager) for None; gemm's
    # Pallas kernels would not, so resolve it here, at trace time, as lax does.
    precision = jax.config.jax_default_matmul_precision
    if precision is None:
      return True, None
  if isinstance(precision, jax.lax.DotAlgorithm):
    return False, None  # a custom algorithm: only XLA knows it
  pair = precision if isinstance(precision, (tuple, list)) else (precision,)
  try:
    values = [jax.lax.Precision(p) for p in pair]
  except (ValueError, TypeError):  # a DotAlgorithmPreset, or its name: gemm's own check
    try:
      preset = _precisions.normalize(precision)
      _precisions.check_dtype(preset, dtype)
    except (ValueError, TypeError):
      return False, None
    return True, preset
  # gemm takes one value for both operands: the higher keeps the promise made to either.
  return True, max(values, key=_PRECISION_RANK.__getitem__)


def _layout(lhs_batch, lhs_contract, lhs_free, rhs_batch, rhs_contract, rhs_free):
  """(lhs permutation, rhs permutation, transpose_a, transpose_b) with the fewest transposes.

  The contracting pairs may be listed in any order as long as both sides agree, so two
  orders are tried: ascending in lhs and ascending in rhs. With each, lhs is put as
  (batch, free, contract) or (batch, contract, free) and rhs as (batch, contract, free) or
  (batch, free, contract); the first candidate needing the fewest physical transposes wins,
  so the plain (M, K) @ (K, N) layout is kept on ties. Batch and free dims keep their order:
  it is the output's.
  """
  lhs_identity = tuple(range(len(lhs_batch + lhs_contract + lhs_free)))
  rhs_identity = tuple(range(len(rhs_batch + rhs_contract + rhs_free)))
  pairs = list(zip(lhs_contract, rhs_contract))
  best = None
  for order in (sorted(pairs), sorted(pairs, key=lambda p: p[1])):
    lc, rc = tuple(p[0] for p in order), tuple(p[1] for p in order)
    for transpose_a in (False, True):
      lhs_perm = lhs_batch + (lc + lhs_free if transpose_a else lhs_free + lc)
      for transpose_b in (False, True):
        rhs_perm = rhs_batch + (rhs_free + rc if transpose_b else rc + rhs_free)
        cost = (lhs_perm != lhs_identity) + (rhs_perm != rhs_identity)
        if best is None or cost < best[0]:
          best = (cost, lhs_perm, rhs_perm, transpose_a, transpose_b)
  return best[1:]


def _transpose(x, perm):
  # An identity permutation emits nothing at all, so the common layouts stay copy-free.
  return x if perm == tuple(range(x.ndim)) else jnp.transpose(x, perm)


def _size(x, dims) -> int:
  return math.prod(x.shape[d] for d in dims)


def _fallback(reason, lhs, rhs, dimension_numbers, precision, preferred_element_type,
              out_sharding):
  FALLBACKS[reason] += 1
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                             out_sharding=out_sharding)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                out_sharding=None, backend="auto"):
  """`jax.lax.dot_general` computed by one `pallas_gemm.gemm` call where gemm can.

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding: as for
      `jax.lax.dot_general`. Accumulation is float32. An unequal precision pair uses the
      higher of the two. Cases gemm cannot take fall back to `jax.lax.dot_general`
      (counted in `FALLBACKS`; see the module docstring).
    backend: passed to `gemm` ("auto" | "xla" | "triton" | "mosaic" | "cuda"). Bind it
      with `functools.partial(dot_general, backend=...)` to pass this to Flax or einsum.

  Raises what `jax.lax.dot_general` raises for bad dimension numbers, precision or
  preferred_element_type (it checks them first).
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  args = (dimension_numbers, precision, preferred_element_type, out_sharding)
  # lax's own checks, and its output shape and dtype (after canonicalisation: f64 -> f32
  # without x64; mixed inputs follow XLA's rule, e.g. bf16 x f16 -> bf16, not jnp's f32).
  out_type = jax.eval_shape(
      lambda x, y: jax.lax.dot_general(x, y, dimension_numbers, precision,
                                       preferred_element_type, out_sharding=out_sharding),
      lhs, rhs)

  if not all(np.dtype(x.dtype) in api.SUPPORTED_DTYPES for x in (lhs, rhs)):
    return _fallback("input dtype", lhs, rhs, *args)
  if np.dtype(out_type.dtype) not in api.SUPPORTED_DTYPES:
    return _fallback("output dtype", lhs, rhs, *args)
  ok, gemm_precision = _gemm_precision(precision, jnp.promote_types(lhs.dtype, rhs.dtype))
  if not ok:
    return _fallback("precision", lhs, rhs, *args)
  if sharding.explicitly_sharded(lhs) or sharding.explicitly_sharded(rhs):
    return _fallback("explicit sharding", lhs, rhs, *args)

  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = (
      [tuple(int(d) for d in dims) for dims in pair] for pair in dimension_numbers)
  lhs_free = tuple(d for d in range(lhs.ndim) if d not in lhs_batch + lhs_contract)
  rhs_free = tuple(d for d in range(rhs.ndim) if d not in rhs_batch + rhs_contract)
  lhs_perm, rhs_perm, transpose_a, transpose_b = _layout(
      lhs_batch, lhs_contract, lhs_free, rhs_batch, rhs_contract, rhs_free)
  m, k, n = _size(lhs, lhs_free), _size(lhs, lhs_contract), _size(rhs, rhs_free)
  lead = (_size(lhs, lhs_batch),) if lhs_batch else ()  # no batch dims: 2-D operands
  a = _transpose(lhs, lhs_perm).reshape(lead + ((k, m) if transpose_a else (m, k)))
  b = _transpose(rhs, rhs_perm).reshape(lead + ((n, k) if transpose_b else (k, n)))
  result = api.gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b,
                    precision=gemm_precision, out_dtype=out_type.dtype, backend=backend)
  result = result.reshape(out_type.shape)  # (B, M, N) -> (batch..., lhs free..., rhs free...)
  if out_sharding is not None:
    result = jax.sharding.reshard(result, out_sharding)
  return result
