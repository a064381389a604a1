"""The front door of the grouped GEMM: `ragged_dot` and `ragged_dot_general`.

    out = pallas_gemm.ragged_dot(lhs, rhs, group_sizes)     # jax.lax.ragged_dot's semantics

lhs (M, K) holds the rows of G groups one after another (group g: `group_sizes[g]` rows);
rhs (G, K, N) one matrix per group; out[rows of g] = lhs[rows of g] @ rhs[g], and rows past
sum(group_sizes) are zeros. `group_sizes` may be traced (no host sync).

`group_offset` (expert parallelism; jax 0.11.2's lax documents it but implements it on no
platform, so these are this module's semantics, those of the megablox `gmm` the lax
docstring comes from): a scalar (or (1,)) integer, possibly traced. `group_sizes` then
counts every global group (G_total >= G entries, rows in global order) and rhs holds
groups [group_offset, group_offset + G): local group i is global group group_offset + i,
computed with rhs[i] on its global rows; every other row of the result is zero. A local
group whose global index is outside [0, G_total) is empty. Without group_offset,
G_total == G (lax's rule). The weight-gradient form with group_offset returns
len(group_sizes) groups, entry i being global group group_offset + i.

What reaches the kernels (`mosaic_forward.forward`, `mosaic_weight_grad.weight_grad`):
`ops.kernel_groups` first normalises every call to the G local groups' sizes (each >= 0;
the kernels cut rows past M) and a row start; the kernels then get either
    group_sizes (G,) int32 and group_offset None: group 0 starts at row 0, or
    group_sizes (G + 1,) int32 = [row_start, local sizes...] and group_offset 1: rows
      before row_start form a group the call does not compute,
the same group_offset semantics as above, so no offset past the table and no negative size
reaches a kernel. Forward: rows in no computed group are written as zeros. Weight grad: an
empty group's (K, N) result is zeros.
lhs/rhs: one 16-bit dtype (bf16 or f16), M, K, N, G >= 1; out_dtype bf16, f16 or f32.

Backends: "xla" (jax.lax.ragged_dot_general: the reference; on a GPU XLA lowers it through a
dense (G, M, K) operand, G times the work), "mosaic" (the Hopper kernels; their interpreter
on a CPU), "auto" (mosaic on an sm_90 GPU for the forms and dtypes it takes, else xla).
float32 inputs run on xla, as lax computes them (its precision argument, TF32 by default on
a GPU): the kernels are written for 16-bit operands.
NaN and Inf: lax's dense formulation multiplies every rhs[g] by the zeros of the rows
outside group g, so on xla a NaN or Inf in column n of any rhs[g], even of a group of no
rows, makes column n NaN in every other row (0 * Inf), rows past sum(group_sizes)
included. The kernels read only a row's own group's matrix.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax.lax import canonicalize_precision  # lax's own normalisation of precision

from pallas_gemm.core import sharding
from pallas_gemm.core.checks import SUPPORTED_DTYPES, dtype_of  # gemm's operand checks
from pallas_gemm.mgpu import hw
from pallas_gemm.grouped import ops

BACKENDS = ("auto", "xla", "mosaic")
_16BIT = (np.dtype(jnp.bfloat16), np.dtype(np.float16))

# The three forms a MoE layer and its gradients use (lhs (M, K) ragged along M):
_DIMS = {
    # rhs (G, K, N) -> (M, N)
    "forward": jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0]),
    # rhs (G, N, K) -> (M, N)
    "forward_t": jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0]),
    # rhs (M, N), ragged along the contracted M -> (G, K, N)
    "weight_grad": jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[]),
}


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None, *, backend: str = "auto", config=None):
  """jax.lax.ragged_dot: lhs (M, K), rhs (G, K, N), group_sizes (G,) -> (M, N).

  precision / preferred_element_type as jax.lax.ragged_dot; group_offset: see the module
  docstring. backend: "auto", "xla" or "mosaic"; config: the Mosaic kernels' Config.
  """
  return ragged_dot_general(lhs, rhs, group_sizes, _DIMS["forward"], precision,
                            preferred_element_type, group_offset, backend=backend,
                            config=config)


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None, *,
                       backend: str = "auto", config=None):
  """jax.lax.ragged_dot_general. The kernels take the three forms of `_DIMS` (lhs (M, K);
  rhs (G, K, N), (G, N, K), or (M, N) for the ragged-contracting weight gradient); any
  other form lax accepts runs on xla (backend "auto" or "xla"; no group_offset)."""
  lhs_dtype, rhs_dtype = dtype_of(lhs, "lhs"), dtype_of(rhs, "rhs")
  check_group_sizes_type(group_sizes)
  dims = ragged_dot_dimension_numbers
  if not isinstance(dims, jax.lax.RaggedDotDimensionNumbers):
    raise TypeError("ragged_dot_dimension_numbers must be a jax.lax.RaggedDotDimensionNumbers; "
                    f"got {type(dims).__name__}")
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
  _check_config(config)
  precision = canonicalize_precision(precision)
  form = _form(lhs, rhs, dims)
  if form is None:
    if group_offset is not None or backend == "mosaic":
      what = "group_offset" if group_offset is not None else "backend='mosaic'"
      raise ValueError(
          f"{what} takes the forms lhs (M, K) with rhs (G, K, N), (G, N, K) or (M, N) "
          f"(ragged along lhs's M); got ragged_dot_dimension_numbers={dims} for lhs "
          f"{tuple(lhs.shape)}, rhs {tuple(rhs.shape)}")
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims, precision=precision,
                                      preferred_element_type=preferred_element_type)
  num_groups = _check_shapes(form, lhs, rhs, group_sizes, group_offset is not None)
  offset = None if group_offset is None else _group_offset(group_offset, group_sizes, num_groups)
  check_concrete_sizes(group_sizes)
  out_dtype = _out_dtype(lhs_dtype, rhs_dtype, preferred_element_type)
  chosen = choose_backend(backend, lhs_dtype, rhs_dtype, precision, out_dtype)
  plan = ops.Plan(form="weight_grad" if form == "weight_grad" else "forward",
                  num_groups=num_groups, backend=chosen, out_dtype=out_dtype,
                  transpose_rhs=form == "forward_t", precision=precision,
                  config=config if chosen == "mosaic" else None,
                  interpret=chosen == "mosaic" and not hw.on_gpu(),
                  offset=offset is not None)
  shape = ops.out_shape(plan, lhs.shape, rhs.shape)
  m, k = lhs.shape
  if 0 in (m, k, num_groups) or 0 in shape:  # nothing for a kernel to do: all zeros
    return jnp.zeros(shape, out_dtype)
  args = sharding.same_varying(*(a for a in (lhs, rhs, jnp.asarray(group_sizes), offset)
                                 if a is not None))
  return ops.bind(plan, *args)


# ----------------------------------------------------------------------------- validation


def check_group_sizes_type(group_sizes):
  if not hasattr(group_sizes, "shape") or not hasattr(group_sizes, "dtype"):
    raise TypeError("group_sizes must be an integer array of shape (G,); got "
                    f"{type(group_sizes).__name__}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"group_sizes.dtype must be an integer type (int32); got {group_sizes.dtype}")


def _check_config(config):
  """config is the kernels' (unused where the call runs on xla); checked on every backend."""
  if config is None:
    return
  from pallas_gemm.grouped.config import Config  # noqa: PLC0415 - with the kernels
  if not isinstance(config, Config):
    raise TypeError(f"config must be None or a pallas_gemm.grouped.config.Config; got "
                    f"{type(config).__module__}.{type(config).__qualname__}")


def _form(lhs, rhs, dims) -> str | None:
  """Which of `_DIMS` the call is (the forms the kernels take), or None."""
  if lhs.ndim != 2:
    return None
  for name, form_dims in _DIMS.items():
    if (dims == form_dims and rhs.ndim == (2 if name == "weight_grad" else 3)):
      return name
  return None


def _check_shapes(form: str, lhs, rhs, group_sizes, has_offset: bool) -> int:
  """Validates the shapes of one of `_DIMS`' forms; returns G, the local groups."""
  if group_sizes.ndim != 1:
    raise ValueError(f"group_sizes must have shape (G,) (rank 1); got shape {tuple(group_sizes.shape)}")
  m, k = lhs.shape
  total = group_sizes.shape[0]
  if form == "weight_grad":
    if rhs.shape[0] != m:
      raise ValueError(
          "ragged-contracting form: lhs (M, K) and rhs (M, N) must have the same rows; got "
          f"lhs {tuple(lhs.shape)}, rhs {tuple(rhs.shape)}")
    return total
  g = rhs.shape[0]
  rhs_k = rhs.shape[2] if form == "forward_t" else rhs.shape[1]
  if rhs_k != k:
    layout = "(G, N, K)" if form == "forward_t" else "(G, K, N)"
    raise ValueError(f"lhs (M, K) and rhs {layout} must share K; got lhs {tuple(lhs.shape)}, "
                     f"rhs {tuple(rhs.shape)}")
  if not has_offset and total != g:
    raise ValueError(f"group_sizes must have one entry per group of rhs: shape ({g},); got "
                     f"shape {tuple(group_sizes.shape)}")
  if has_offset and total < g:
    raise ValueError(f"with group_offset, group_sizes counts every global group: at least rhs's "
                     f"{g}; got shape {tuple(group_sizes.shape)}")
  return g


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_concrete_sizes(group_sizes):
  """Negative sizes are caught where group_sizes is concrete. Traced, they cannot be
  checked without a host sync: xla then computes what lax does (a negative size moves
  the next group's start back), the kernels count them as 0. A sum over M is not an
  error: lax cuts the groups at row M, and so do the kernels."""
  if _is_concrete(group_sizes):
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
      raise ValueError(f"group_sizes must be >= 0; got {sizes.tolist()}")


def _group_offset(group_offset, group_sizes, num_groups: int):
  """group_offset as an int32 scalar array; checked against group_sizes where concrete."""
  if isinstance(group_offset, (bool, np.bool_)) or not (
      isinstance(group_offset, (int, np.integer)) or hasattr(group_offset, "dtype")):
    raise TypeError(f"group_offset must be an integer scalar or a (1,) integer array; got "
                    f"{type(group_offset).__name__}")
  offset = jnp.asarray(group_offset) if not isinstance(group_offset, jax.Array) else group_offset
  if not jnp.issubdtype(offset.dtype, jnp.integer):
    raise TypeError(f"group_offset.dtype must be an integer type (int32); got {offset.dtype}")
  if offset.shape not in ((), (1,)):
    raise ValueError(f"group_offset must be a scalar or have shape (1,); got shape {offset.shape}")
  if _is_concrete(group_offset):
    # Traced, an offset outside this range leaves the missing global groups empty.
    value, total = int(np.asarray(group_offset).reshape(())), group_sizes.shape[0]
    if not 0 <= value <= max(total - num_groups, 0):
      raise ValueError(f"group_offset must lie in [0, {max(total - num_groups, 0)}] "
                       f"(len(group_sizes) {total} - the {num_groups} local groups); got {value}")
  return offset.reshape(()).astype(jnp.int32)


def _out_dtype(lhs_dtype, rhs_dtype, preferred_element_type) -> np.dtype:
  """lax.dot_general's result dtype: preferred_element_type made canonical (float64 is
  float32 while x64 is off), else the operand dtype of wider range, then precision
  (float16 x bfloat16 is bfloat16; jnp's promotion would give float32)."""
  if preferred_element_type is not None:
    try:
      out = np.dtype(preferred_element_type)
    except TypeError:
      raise TypeError(f"preferred_element_type must be None or a floating dtype; got "
                      f"{preferred_element_type!r}") from None
    if not jnp.issubdtype(out, jnp.floating):
      raise TypeError(f"preferred_element_type must be a floating dtype for floating inputs; "
                      f"got {out}")
    preferred_element_type = out
  # The x64 setting is part of the key: it decides what float64 means.
  return _lax_dot_dtype(lhs_dtype, rhs_dtype, preferred_element_type,
                        jax.dtypes.canonicalize_dtype(np.float64))


@functools.lru_cache(maxsize=64)
def _lax_dot_dtype(lhs_dtype, rhs_dtype, preferred_element_type, float64) -> np.dtype:
  del float64  # the cache key only
  operand = lambda dtype: jax.ShapeDtypeStruct((1, 1), dtype)  # noqa: E731
  dot = functools.partial(jax.lax.dot, preferred_element_type=preferred_element_type)
  return np.dtype(jax.eval_shape(dot, operand(lhs_dtype), operand(rhs_dtype)).dtype)


# ----------------------------------------------------------------------------- backends


def mosaic_reason(lhs_dtype, rhs_dtype, precision, out_dtype) -> str | None:
  """None when the Mosaic kernels can compute this call here, else why not."""
  if lhs_dtype != rhs_dtype or lhs_dtype not in _16BIT:
    return (f"the kernels take lhs and rhs of one 16-bit dtype (bfloat16 or float16); got "
            f"{lhs_dtype.name} and {rhs_dtype.name}")
  if out_dtype not in SUPPORTED_DTYPES:
    return f"preferred_element_type {out_dtype.name}: the kernels write bfloat16, float16 or float32"
  if isinstance(precision, (str, jax.lax.DotAlgorithmPreset)):
    return f"precision={precision}: the kernels compute 16-bit products with f32 accumulation only"
  try:
    importlib.import_module("pallas_gemm.grouped.mosaic_forward")
    importlib.import_module("pallas_gemm.grouped.mosaic_weight_grad")
  except ImportError as e:
    return f"the Mosaic ragged_dot kernels cannot be imported: {e}"
  return hw.unavailable_reason()


def choose_backend(backend: str, lhs_dtype, rhs_dtype, precision, out_dtype) -> str:
  """"xla" or "mosaic" for a call asking for `backend` (ValueError: "mosaic" asked where
  the kernels cannot compute the call)."""
  if backend == "xla":
    return "xla"
  return pick_backend(backend, mosaic_reason(lhs_dtype, rhs_dtype, precision, out_dtype))


def pick_backend(backend: str, reason: str | None, what: str = "this call") -> str:
  """"xla" or "mosaic" for a call asking for `backend`, given why the kernels cannot
  compute it here (reason None: they can); ValueError where "mosaic" was asked."""
  if backend == "xla":
    return "xla"
  if backend == "mosaic":
    if reason is not None:
      raise ValueError(f"backend='mosaic' cannot compute {what}: {reason}")
    return "mosaic"
  # auto: the grouped kernels where they run natively. XLA's GPU ragged_dot multiplies
  # a dense (G, M, K) operand (G times the FLOPs and memory); on a CPU the interpreter is
  # for testing, not speed.
  return "mosaic" if reason is None and hw.on_gpu() else "xla"
