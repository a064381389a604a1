"""`ragged_dot` as a JAX primitive: what it does under AD, vmap and jit.

`api.ragged_dot_general` validates, picks a backend and binds `ragged_dot_p` on one of
two normalised forms (lhs always (M, K), rows ordered by group):

- "forward":     out (M, N) = lhs[rows of g] @ rhs[g] per group, rhs (G, K, N), or
                 (G, N, K) read transposed (`transpose_rhs`); rows in no group are 0.
- "weight_grad": out (G, K, N) = lhs[rows of g].T @ rhs[rows of g] per group, rhs (M, N)
                 (lax's ragged-contracting mode); an empty group gives zeros.

Operands: lhs, rhs, group_sizes, and with `Plan.offset` an int32 scalar group_offset
(see api.py for its semantics). Every rule JAX needs lives here:

- JVP: the op is linear in lhs and in rhs separately, so the tangent is
  ``f(dlhs, rhs) + f(lhs, drhs)``: two more `ragged_dot_p`, the same backend.
- transpose: the cotangent of lhs or rhs as one `ragged_dot_p` of the same backend:
  forward -> dlhs by the forward kernel with rhs read transposed, drhs by the
  weight-gradient kernel; weight_grad -> two forward calls. With JVP this gives `grad`,
  `jvp`, `linearize`, `jacfwd`/`jacrev` (a `custom_vjp` would give no forward mode).
- batching: a vmapped axis becomes a `lax.map` of the kernel over it (each entry has its
  own groups, so the entries do not fold into one ragged problem without copying rhs).
- lowering: the backend call on the operands (`_kernel`), through the partitioning rule
  below (`_partition`) so that XLA runs each device's shard instead of gathering the
  operands; inside `jax.shard_map` it is the local computation of each shard.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec
# Private but stable: core.ShapedArray / core.typeof have no public alias.
from jax._src import core

from pallas_gemm.core import primitive, sharding

FORMS = ("forward", "weight_grad")
F32 = np.dtype(np.float32)
_16BIT = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one call: hashable, the primitive's only parameter."""
  form: str              # one of FORMS
  num_groups: int        # G: rhs's groups (forward), the result's (weight_grad)
  backend: str           # "xla" or "mosaic"
  out_dtype: np.dtype
  transpose_rhs: bool = False   # forward only: rhs is (G, N, K)
  precision: Any = None         # as jax.lax takes it (xla); 16-bit kernels accumulate in f32
  config: Any = None            # the Mosaic kernels' Config, or None for their default
  interpret: bool = False       # Mosaic GPU's interpreter (CPU)
  offset: bool = False          # a group_offset operand follows group_sizes

  def __post_init__(self):
    if self.form not in FORMS:
      raise ValueError(f"Plan.form must be one of {FORMS}; got {self.form!r}")
    if self.transpose_rhs and self.form != "forward":
      raise ValueError("Plan.transpose_rhs applies to the forward form only")


def bind(plan: Plan, lhs, rhs, group_sizes, group_offset=None):
  args = (lhs, rhs, group_sizes) + ((group_offset,) if plan.offset else ())
  return ragged_dot_p.bind(*args, plan=plan)


# ----------------------------------------------------------------------------- groups


def local_groups(group_sizes, group_offset, num_groups: int):
  """(sizes, row_start) of the G = num_groups local groups: local group i is global group
  group_offset + i (size 0 where that group does not exist), and its rows follow the
  rows of every global group before group_offset. Sizes are left as given (negative
  ones included), as lax reads them."""
  total = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  index = group_offset + jnp.arange(num_groups, dtype=jnp.int32)
  exists = (index >= 0) & (index < total)
  local = jnp.where(exists, sizes[jnp.clip(index, 0, max(total - 1, 0))], 0)
  row_start = jnp.sum(jnp.where(jnp.arange(total) < group_offset, sizes, 0), dtype=jnp.int32)
  return local, row_start


def kernel_groups(group_sizes, row_start, m: int):
  """The groups as the Mosaic kernels take them: sizes >= 0 (a negative size, only
  possible traced, the front door rejecting concrete ones, counts as 0) and row_start in
  [0, m]. Rows past m are the kernels' to cut (`mgpu.rows.local_rows` clips every group
  to [0, m], as lax's dense formulation has no rows past m): one elementwise pass here,
  where cutting them here too would be a cumulative sum more, a few kernels of a decode
  step's layer."""
  start = None if row_start is None else jnp.clip(row_start, 0, m).astype(jnp.int32)
  return jnp.maximum(group_sizes.astype(jnp.int32), 0), start


def _kernel(plan: Plan, lhs, rhs, group_sizes, group_offset=None):
  """The backend call on (local) operands."""
  if group_offset is not None:
    group_sizes, row_start = local_groups(group_sizes, group_offset, plan.num_groups)
  else:
    row_start = None
  return run(plan, lhs, rhs, group_sizes, row_start)


_NO_MESH = jax.sharding.AbstractMesh((), ())


def run(plan: Plan, lhs, rhs, group_sizes, row_start):
  """The backend call on groups given as plan.num_groups sizes whose rows start at
  row_start (None: row 0); plan.offset is not read."""
  m = lhs.shape[0]
  if plan.backend == "xla":
    from pallas_gemm.grouped import xla as module  # noqa: PLC0415
    kwargs = dict(precision=plan.precision)
  else:
    group_sizes, row_start = kernel_groups(group_sizes, row_start, m)
    if row_start is not None:
      # The kernels' own group_offset form: the rows before row_start become a group 0
      # of G + 1, and the call computes groups [1, G + 1) with rhs's G matrices.
      group_sizes, row_start = jnp.concatenate([row_start[None], group_sizes]), jnp.int32(1)
    module = importlib.import_module(f"pallas_gemm.grouped.{plan.backend}_{plan.form}")
    kwargs = {} if plan.form == "forward" else dict(num_groups=plan.num_groups)
  common = dict(out_dtype=plan.out_dtype, config=plan.config, interpret=plan.interpret, **kwargs)
  # group_sizes and row_start are int32 (above), as the kernels' index arithmetic. lax's
  # ops (xla) trace with no mesh in context: this is the local computation, and under
  # Explicit mesh axes lax would infer shardings for it and refuse ragged_dot_general's.
  mesh = _NO_MESH if plan.backend == "xla" else jax.sharding.get_abstract_mesh()
  with primitive.kernel_x64(plan.backend), jax.sharding.use_abstract_mesh(mesh):
    if plan.form == "forward":
      return module.forward(lhs, rhs, group_sizes, row_start, transpose_rhs=plan.transpose_rhs,
                            **common)
    return module.weight_grad(lhs, rhs, group_sizes, row_start, **common)


def out_shape(plan: Plan, lhs_shape, rhs_shape) -> tuple[int, ...]:
  if plan.form == "forward":
    return (lhs_shape[0], rhs_shape[1] if plan.transpose_rhs else rhs_shape[2])
  return (plan.num_groups, lhs_shape[1], rhs_shape[1])


# ----------------------------------------------------------------------------- primitive

# requires_devices: custom_partitioning lowers only with the device assignment known.
ragged_dot_p = primitive.new_primitive("pallas_gemm_ragged_dot", requires_devices=True)


@ragged_dot_p.def_effectful_abstract_eval
def _abstract_eval(lhs, rhs, group_sizes, *rest, plan):
  avals = (lhs, rhs, group_sizes, *rest)
  primitive.check_manual_axes("ragged_dot", "lhs, rhs, group_sizes (and group_offset)", avals)
  shape = out_shape(plan, lhs.shape, rhs.shape)
  spec = jax.sharding.PartitionSpec(*([None] * len(shape)))
  out = core.ShapedArray(shape, np.dtype(plan.out_dtype), sharding=lhs.sharding.update(spec=spec),
                         manual_axis_type=lhs.manual_axis_type)
  return out, _effects(plan, *primitive.plain(avals))


@functools.lru_cache(maxsize=256)
def _effects(plan: Plan, *avals):
  """None on a GPU; Mosaic GPU's interpreter (CPU) keeps its simulated GPU state through
  ordered io_callbacks, which the primitive must declare."""
  if not plan.interpret:
    return primitive.no_effects
  return primitive.interpret_effects(functools.partial(_kernel, plan), *avals)


# ----------------------------------------------------------------------------- JVP


def _jvp(primals, tangents, *, plan):
  lhs, rhs, group_sizes, *offset = primals
  dlhs, drhs = tangents[:2]
  out = bind(plan, lhs, rhs, group_sizes, *offset)
  terms = []
  if type(dlhs) is not ad.Zero:
    terms.append(bind(plan, dlhs, rhs, group_sizes, *offset))
  if type(drhs) is not ad.Zero:
    terms.append(bind(plan, lhs, drhs, group_sizes, *offset))
  if not terms:
    return out, primitive.zero_like(out)
  return out, functools.reduce(jnp.add, terms)


ad.primitive_jvps[ragged_dot_p] = _jvp


# ----------------------------------------------------------------------------- transpose


def cotangent_backend(plan: Plan, x_dtype, y_dtype) -> tuple[str, np.dtype | None]:
  """(backend, operand dtype) for a cotangent product of operands x, y (one of them the
  cotangent). The Mosaic kernels take one 16-bit dtype: a float32 cotangent of bfloat16
  operands (preferred_element_type=float32) is rounded to bfloat16 for them (bf16 keeps
  float32's exponent range; the rounding is the one a bf16 product's output carries).
  A float32 cotangent of float16 operands keeps its width (rounding it could overflow
  under loss scaling) and that product runs on xla, as does anything else mosaic cannot
  take. None: the operands go to xla as they are (lax promotes)."""
  if plan.backend == "xla":
    return "xla", None
  x_dtype, y_dtype = np.dtype(x_dtype), np.dtype(y_dtype)
  if x_dtype == y_dtype and x_dtype in _16BIT:
    return plan.backend, x_dtype
  narrow = {x_dtype, y_dtype} - {F32}
  if {x_dtype, y_dtype} <= {F32, np.dtype(jnp.bfloat16)} and narrow:
    return plan.backend, np.dtype(jnp.bfloat16)
  return "xla", None


def _transpose(ct, lhs, rhs, group_sizes, *offset, plan):
  lhs_lin, rhs_lin = ad.is_undefined_primal(lhs), ad.is_undefined_primal(rhs)
  assert not (lhs_lin and rhs_lin), "ragged_dot is bilinear: lhs and rhs cannot both be linear"
  assert not ad.is_undefined_primal(group_sizes), "group_sizes is not differentiable"
  rest = [None] * (1 + len(offset))
  if type(ct) is ad.Zero:
    return [None, None] + rest
  lhs_aval = lhs.aval if lhs_lin else core.typeof(lhs)
  rhs_aval = rhs.aval if rhs_lin else core.typeof(rhs)

  def call(form, x, y, *, aval, transpose_rhs=False):
    backend, dtype = cotangent_backend(plan, x.dtype, y.dtype)
    if dtype is not None:
      x, y = x.astype(dtype), y.astype(dtype)
    # xla computes in the forward's output dtype and converts, as lax's transpose does;
    # the kernels round their f32 accumulators to the operand's dtype once.
    out_dtype = plan.out_dtype if backend == "xla" else np.dtype(aval.dtype)
    p = dataclasses.replace(plan, form=form, transpose_rhs=transpose_rhs, backend=backend,
                            out_dtype=out_dtype, config=None,
                            interpret=plan.interpret and backend != "xla")
    return sharding.typed_like(bind(p, x, y, group_sizes, *offset).astype(aval.dtype), aval)

  if plan.form == "forward":
    if lhs_lin:  # dlhs (M, K) = ct (M, N) @ rhs[g]^T: the forward kernel, rhs read transposed
      return [call("forward", ct, rhs, aval=lhs_aval, transpose_rhs=not plan.transpose_rhs),
              None] + rest
    # drhs: per group lhs^T @ ct (G, K, N), or ct^T @ lhs (G, N, K) for a transposed rhs
    x, y = (ct, lhs) if plan.transpose_rhs else (lhs, ct)
    return [None, call("weight_grad", x, y, aval=rhs_aval)] + rest
  # weight_grad: out[g] = lhs_g^T @ rhs_g with ct (G, K, N)
  if lhs_lin:  # dlhs (M, K) = rhs (M, N) @ ct[g]^T
    return [call("forward", rhs, ct, aval=lhs_aval, transpose_rhs=True), None] + rest
  return [None, call("forward", lhs, ct, aval=rhs_aval)] + rest  # drhs (M, N) = lhs @ ct[g]


ad.primitive_transposes[ragged_dot_p] = _transpose


# ----------------------------------------------------------------------------- batching


def _batch(args, dims, *, plan):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  mapped = [d is not None for d in dims]
  moved = [jnp.moveaxis(x, d, 0) if d is not None else x for x, d in zip(args, dims)]

  def one(entries):
    it = iter(entries)
    return ragged_dot_p.bind(*[next(it) if bat else x for x, bat in zip(moved, mapped)],
                             plan=plan)

  if size == 0:
    shape = out_shape(plan, *(x.shape[int(b):] for x, b in zip(moved[:2], mapped[:2])))
    return jnp.zeros((0,) + shape, plan.out_dtype), 0
  return jax.lax.map(one, [x for x, bat in zip(moved, mapped) if bat]), 0


batching.primitive_batchers[ragged_dot_p] = _batch


# ----------------------------------------------------------------------------- sharding
# Through `custom_partitioning`, XLA's partitioner (Shardy) runs each device's shard:
#   forward      lhs (M, K), rhs (G, K, N) [or (G, N, K)] -> out (M, N)
#     M split:   each device computes its rows; its groups are the global groups cut to
#                its row window (computed locally from the replicated group_sizes).
#     N split:   tensor parallel: each device its columns. No communication.
#     G split:   expert parallel: each device its groups (group_offset moved by the
#                groups before them); rows of other devices' groups are zero there, so
#                one psum of the result (an all-reduce of disjoint rows, exact in the
#                result's dtype) finishes it.
#     K split:   f32 partial sums, one psum, then the result's dtype.
#   weight_grad  lhs (M, K), rhs (M, N) -> out (G, K, N)
#     M split:   f32 partial sums over each device's rows, one psum.
#     K, N split, or the result wanted split on G: each device its part. No communication.
# A dimension that does not divide over its axes is not split (gathered as XLA would).
# group_sizes and group_offset are small and replicated. With rows split, a negative
# group size (possible only traced) counts as 0, as the Mosaic kernels read it. Rows are
# chosen before groups: lhs and rhs both split over one axis run row-split, rhs gathered.


def _factors(plan: Plan, mesh, arg_shapes, result_shape) -> dict:
  """Mesh axes per factor (m, k, n, g) of one call: the operands' first, then the
  result's for factors still unsplit; an axis serves one factor."""
  lhs, rhs = arg_shapes[0], arg_shapes[1]
  sl, sr = sharding.spec_axes(lhs.sharding, 2), sharding.spec_axes(rhs.sharding, rhs.ndim)
  so = sharding.spec_axes(result_shape.sharding, len(result_shape.shape))
  m, k = lhs.shape
  if plan.form == "forward":
    n_dim, k_dim = (1, 2) if plan.transpose_rhs else (2, 1)
    n = rhs.shape[n_dim]
    sources = {"m": [sl[0], so[0]], "n": [sr[n_dim], so[1]], "k": [sl[1], sr[k_dim]],
               "g": [sr[0]]}
  else:
    n = rhs.shape[1]
    sources = {"m": [sl[0], sr[0]], "k": [sl[1], so[1]], "n": [sr[1], so[2]], "g": [so[0]]}
  extent = {"m": m, "k": k, "n": n, "g": plan.num_groups}
  used, chosen = set(), {}
  for factor, candidates in sources.items():
    chosen[factor] = ()
    for c in candidates:
      names = tuple(x for x in c if x not in used)
      if names and extent[factor] % sharding.size(mesh, names) == 0:
        chosen[factor] = names
        break
    used.update(chosen[factor])
  return chosen


def _partition(plan: Plan, mesh, arg_shapes, result_shape):
  f = _factors(plan, mesh, arg_shapes, result_shape)
  m, k, n, g = f["m"], f["k"], f["n"], f["g"]
  named = lambda *spec: NamedSharding(  # noqa: E731
      mesh, PartitionSpec(*map(sharding.entry, spec)))
  # reduce: the axes whose partial results are summed; partial: whether those partials
  # are sums over a split contraction (f32 until summed) rather than disjoint rows.
  if plan.form == "forward":
    rhs_spec = (g, n, k) if plan.transpose_rhs else (g, k, n)
    arg_specs = [named(m, k), named(*rhs_spec)]
    out_spec, reduce, partial = named(m, n), k + g, bool(k)
  else:
    arg_specs = [named(m, k), named(m, n)]
    out_spec, reduce, partial = named(g, k, n), m, bool(m)
  arg_specs += [named(())] * (len(arg_shapes) - 2)  # group_sizes, group_offset
  local_groups_count = plan.num_groups // sharding.size(mesh, g)
  local_rows = arg_shapes[0].shape[0] // sharding.size(mesh, m)
  local_plan = dataclasses.replace(plan, num_groups=local_groups_count,
                                   out_dtype=F32 if partial else plan.out_dtype)

  def local(lhs, rhs, group_sizes, *offset):
    if offset:
      sizes, row_start = local_groups(group_sizes, offset[0], plan.num_groups)
    else:
      sizes, row_start = group_sizes, None
    if g:  # this device's groups, after the rows of the groups before them
      first = jax.lax.axis_index(g) * local_groups_count
      before = jnp.sum(jnp.where(jnp.arange(plan.num_groups) < first,
                                 jnp.maximum(sizes.astype(jnp.int32), 0), 0))
      row_start = before if row_start is None else row_start + before
      sizes = jax.lax.dynamic_slice_in_dim(sizes, first, local_groups_count)
    if m:
      sizes, row_start = sharding.group_window(
          sizes, row_start, jax.lax.axis_index(m) * local_rows, local_rows)
    out = run(local_plan, lhs, rhs, sizes, row_start)
    if reduce:
      out = jax.lax.psum(out, reduce).astype(plan.out_dtype)
    return out

  return mesh, local, out_spec, tuple(arg_specs)


def _sharding_rule(plan: Plan, mesh, value_types, result_types):
  """Shardy's rule: m(rows), k, n, g(roups); s: group_sizes (replicated); a scalar
  group_offset."""
  del mesh, value_types, result_types
  if plan.form == "forward":
    rhs = "g n k" if plan.transpose_rhs else "g k n"
    rule, reduction = f"m k, {rhs}, s", ("k", "g")
    out = "m n"
  else:
    rule, reduction, out = "m k, m n, s", ("m",), "g k n"
  rule += "," if plan.offset else ""
  return f"{rule} -> {out}", {"reduction_factors": reduction,
                              "need_replication_factors": ("s",)}


def _flat_kernel(plan: Plan, *args):
  # Positional only: custom_partitioning binds a signature's defaults into its operands.
  return _kernel(plan, *args)


@functools.lru_cache(maxsize=None)
def _partitioned(plan: Plan):
  call = custom_partitioning(functools.partial(_flat_kernel, plan))
  call.def_partition(partition=functools.partial(_partition, plan),
                     sharding_rule=functools.partial(_sharding_rule, plan))
  return call


def _lowering(*args, plan):
  # Mosaic GPU's interpreter runs on ordered io_callbacks, which custom_partitioning
  # cannot lower: that CPU-only path runs on gathered operands.
  if plan.interpret:
    return _kernel(plan, *args)
  return _partitioned(plan)(*args)


def _lower(ctx, *args, plan):
  return primitive.lower_local(ctx, _lowering, *args, multiple_results=False, plan=plan)


mlir.register_lowering(ragged_dot_p, _lower)
