"""PartitionSpecs as the partitioning rules read them: each dimension's mesh axes as a
tuple, and back. Shared by the dense and grouped primitives' rules; and `partitioned`, the
rule of a kernel call indexed like an einsum (the fp8 kernels', the gated grouped GEMM's)."""

from __future__ import annotations

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding


def axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry (None, an axis name, or a tuple of them) as a tuple."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_axes(sharding, ndim: int) -> list[tuple[str, ...]]:
  """Each of ndim dimensions' mesh axes (() where replicated) of a NamedSharding."""
  spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  return [axes(e) for e in spec + (None,) * (ndim - len(spec))]


def entry(names: tuple[str, ...]):
  """The PartitionSpec entry of a tuple of mesh axes."""
  return None if not names else names[0] if len(names) == 1 else names


def varying_axes(a) -> frozenset:
  """The jax.shard_map manual axes a's value varies over (its type's)."""
  aval = jax.typeof(a)
  manual = getattr(aval, "manual_axis_type", None)  # jax 0.11-0.12; `vma` before
  return manual.varying if manual is not None else getattr(aval, "vma", frozenset())


def cast_varying(a, axes):
  """a typed as varying over these manual axes (a name or a tuple of them) too."""
  missing = tuple(x for x in ((axes,) if isinstance(axes, str) else axes)
                  if x not in varying_axes(a))
  return jax.lax.pcast(a, missing, to="varying") if missing else a


def same_varying(*operands, also=()) -> list:
  """The operands (arrays or pytrees of them) with every array typed as varying over
  every manual axis any of them varies over (and the axes `also`), as lax's binary ops
  make theirs: one set for a kernel or a custom derivative. A value invariant over an
  axis is then used on each of its devices; the cast's transpose sums its gradient over
  them."""
  leaves, tree = jax.tree.flatten(list(operands))
  axes = tuple(sorted(frozenset(also).union(*map(varying_axes, leaves))))
  return jax.tree.unflatten(tree, [cast_varying(a, axes) for a in leaves])


def auto_axes() -> tuple[str, ...]:
  """The context mesh's Auto axes of more than one device (`jax.set_mesh`, outside
  `jax.shard_map` over them): where XLA partitions a computation itself, and a kernel
  called without a partitioning rule would have its operands gathered."""
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind == jax.sharding.AxisType.Auto and mesh.shape[name] > 1)


def unpartitioned(interpret) -> bool:
  """Whether a Mosaic kernel runs as called rather than through a partitioning rule: in
  interpret mode (the interpreter's ordered effects cannot be partitioned), or inside a
  shard_map's manual axes (the values are shards already: `mgpu/launch.call`)."""
  return bool(interpret) or bool(jax.sharding.get_abstract_mesh().manual_axes)


def group_window(sizes, row_start, first, rows: int):
  """(sizes, row_start) of groups whose rows start at row_start (None: row 0) cut to rows
  [first, first + rows), in that window's own row numbers: one device's part of a grouped
  call whose rows are split (the grouped partitioning rules'). A negative size counts as
  0."""
  start = jnp.zeros((), jnp.int32) if row_start is None else row_start.astype(jnp.int32)
  ends = start + jnp.cumsum(jnp.maximum(sizes.astype(jnp.int32), 0))
  local_start = jnp.clip(start - first, 0, rows)
  local_ends = jnp.clip(ends - first, 0, rows)
  return jnp.diff(local_ends, prepend=local_start[None]), local_start


def explicitly_sharded(x) -> bool:
  """Whether x's type is sharded over Explicit mesh axes (jax.sharding.AxisType.Explicit)."""
  return any(axes is not None for axes in jax.typeof(x).sharding.spec)


def typed_like(value, aval):
  """value resharded to aval's sharding where aval's mesh has Explicit axes (a cotangent
  must have its primal's type, sharding included); value otherwise."""
  target = aval.sharding
  mesh = getattr(target, "mesh", None)
  if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return value
  if tuple(jax.typeof(value).sharding.spec) == tuple(target.spec):
    return value
  return jax.sharding.reshard(value, target)


def whole(*arrays) -> list:
  """Each array resharded whole onto every device where it is sharded over Explicit mesh
  axes, for a computation that splits none of them: its gradient comes back split as
  the array was (reshard's transpose)."""
  return [jax.sharding.reshard(a, NamedSharding(jax.typeof(a).sharding.mesh,
                                                jax.sharding.PartitionSpec()))
          if explicitly_sharded(a) else a for a in arrays]


def explicit_mesh(*operands):
  """The mesh whose Explicit axes type these operands (theirs, else the one in context),
  or None: where lax infers no sharding for an op (ragged_dot's), its result must be
  named on it."""
  explicit = jax.sharding.AxisType.Explicit
  meshes = [jax.typeof(a).sharding.mesh for a in operands] + [jax.sharding.get_abstract_mesh()]
  return next((m for m in meshes if not m.empty and explicit in m.axis_types), None)


def explicit_reason(*operands) -> str | None:
  """Why a Pallas kernel cannot take these operands as they are typed, or None: under
  Explicit mesh axes sharding is part of the type, and a kernel traced on sharded Refs
  fails (Pallas slices only unsharded axes). The XLA paths type their results there."""
  if any(explicitly_sharded(x) for x in operands if x is not None):
    return ("an operand is sharded over Explicit mesh axes (jax.sharding.AxisType.Explicit),"
            " where the Pallas kernels do not run; under Auto axes they run partitioned")
  return None


def size(mesh, names) -> int:
  """The number of devices along these mesh axes."""
  return int(np.prod([mesh.shape[x] for x in names]))


# ----------------------------------------------------------------------------- einsum-like
# A kernel call whose operands and results are indexed by named factors (as an einsum's),
# run by XLA's partitioner (custom_partitioning, Shardy) on each device's shard. Each
# dimension is labelled (factor, per): it holds one entry per `per` units of the factor
# (a scale per 128 rows: ("m", 128)), or None: never split (a per-tensor scale's 1).
# A factor is split over the mesh axes that an operand (or the result) already splits its
# dimension over, when every dimension it labels divides evenly, in units of `align`;
# otherwise it is whole on every device (always, for the factors in `whole`). Factors in
# `reduce` (contractions) leave partial sums, computed by the local call in float32 and
# summed over their axes (one psum). Propagation ties a blocked dim to its factor only
# where the mesh's axes, in any order, divide its blocks in turn; elsewhere the blocked
# dim (a scale's, 1/128 of its factor's entries or less) is replicated, gathered if it
# came in split.


def _extents(labels, shapes) -> dict:
  """{factor: its extent}, read off the operand dims that hold one entry per unit of it."""
  return {d[0]: n for dims, shape in zip(labels, shapes) for d, n in zip(dims, shape)
          if d is not None and d[1] == 1}


def _choose_axes(mesh, labels, shapes, result_labels, result_shardings, arg_shardings, align,
                 whole=()):
  """{factor: the mesh axes it splits over} (the comment above); an axis serves one factor."""
  extent = _extents(labels, shapes)
  sources = {f: [] for f in extent}
  for dims_list, shardings in ((labels, arg_shardings), (result_labels, result_shardings)):
    for dims, s in zip(dims_list, shardings):
      for label, names in zip(dims, spec_axes(s, len(dims))):
        if label is not None and label[1] == 1 and names:
          sources[label[0]].append(names)
  every = [d for dims in (*labels, *result_labels) for d in dims if d is not None]
  used, chosen = set(), {}
  for factor, candidates in sources.items():
    chosen[factor] = ()
    if factor in whole:
      continue
    unit = math.lcm(align.get(factor, 1), *[p for f, p in every if f == factor])
    for names in candidates:
      names = tuple(x for x in names if x not in used)
      if names and extent[factor] % (size(mesh, names) * unit) == 0:
        chosen[factor] = names
        break
    used.update(chosen[factor])
  return chosen


def partitioned(fn, shapes, labels, result_labels, *, reduce=(), whole=(), align=None,
                out_dtypes=()):
  """fn(*operands) -> results (a tuple), run shard by shard under jit (module comment).

  shapes: the operands' shapes. labels / result_labels: per operand / result, a tuple of
  (factor, per) or None per dim. fn(*local operands, partial=bool, start=fn) computes
  one shard: partial is True where a factor of `reduce` is split, and then fn returns
  partial sums (float32, or any dtype whose sum is exact, as for disjoint rows), summed
  here and cast to out_dtypes; start(factor) is the shard's
  first index along that factor (traced; 0 where it is whole)."""
  align = dict(align or {})

  def named(mesh, dims, chosen):
    return NamedSharding(mesh, jax.sharding.PartitionSpec(
        *[None if d is None else entry(chosen[d[0]]) for d in dims]))

  def partition(mesh, arg_shapes, result_shape):
    results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
    chosen = _choose_axes(mesh, labels, [a.shape for a in arg_shapes], result_labels,
                          [r.sharding for r in results], [a.sharding for a in arg_shapes],
                          align, whole)
    summed = tuple(x for f in reduce for x in chosen.get(f, ()))
    extent = _extents(labels, [a.shape for a in arg_shapes])

    def start(factor):
      names = chosen.get(factor, ())
      if not names:
        return jax.numpy.zeros((), jax.numpy.int32)
      return jax.lax.axis_index(names) * (extent[factor] // size(mesh, names))

    def local(*args):
      outs = fn(*args, partial=bool(summed), start=start)
      if summed:
        outs = tuple(jax.lax.psum(o, summed).astype(t) for o, t in zip(outs, out_dtypes))
      return outs

    arg_specs = tuple(named(mesh, dims, chosen) for dims in labels)
    out_specs = tuple(named(mesh, dims, chosen) for dims in result_labels)
    return mesh, local, out_specs, arg_specs

  def whole_call(*args):
    return fn(*args, partial=False, start=lambda f: jax.numpy.zeros((), jax.numpy.int32))

  call = custom_partitioning(whole_call)
  call.def_partition(partition=partition, sharding_rule=lambda mesh, *types: _shardy_rule(
      shapes, labels, result_labels, reduce, whole, tuple(mesh.shape.values())))

  # custom_partitioning has no batching rule: under vmap (also of an inner jit, scan or
  # checkpoint) the call runs unpartitioned, batched as fn batches.
  @jax.custom_batching.custom_vmap
  def batchable(*args):
    return call(*args)

  @batchable.def_vmap
  def _batched(axis_size, in_batched, *args):
    del axis_size
    outs = jax.vmap(whole_call, in_axes=[0 if b else None for b in in_batched])(*args)
    return outs, tuple(True for _ in outs)

  return batchable


def _divides_in_turn(sizes, parts) -> bool:
  """Whether axes of these sizes, taken in order, split a compound factor (major part
  first) without cutting an axis: each divides the part it lands on, the next part once
  one is used up."""
  parts = list(parts)
  for n in sizes:
    while parts and parts[0] == 1:
      parts.pop(0)
    if not parts or parts[0] % n:
      return False
    parts[0] //= n
  return True


def _shardy_rule(shapes, labels, result_labels, reduce, whole, axis_sizes):
  """(the Shardy rule string, its factor kinds) for propagation over a mesh of these axis
  sizes. A factor that a scale's dimension holds in blocks of `per` (K = K/128 blocks x
  128) is the compound (F Fp) where it is whole, F where blocked, so both split together;
  other blocked or None dims are factors of their own that propagation leaves whole (the
  partition decides them)."""
  extent = _extents(labels, shapes)
  pers = {}
  for dims in (*labels, *result_labels):
    for d in dims:
      if d is not None and d[1] > 1:
        pers.setdefault(d[0], set()).add(d[1])

  def blocks_split(f, per):
    # Shardy refuses a compound factor with a part of size 1: one block of `per` is not.
    # And an axis that does not divide what is left of the blocks would be cut into
    # sub-axes between F and Fp, a sharding jax's partitioner callback cannot read (it
    # fails to compile): so every sequence of axes a dim may be split over must divide
    # the blocks axis by axis until they are used up, and then `per`. With no mesh known
    # (no axis sizes), nothing is tied.
    blocks, rest = divmod(extent[f], per)
    return (not rest and blocks > 1 and bool(axis_sizes)
            and all(_divides_in_turn(order, (blocks, per))
                    for n in range(1, len(axis_sizes) + 1)
                    for order in itertools.permutations(axis_sizes, n)))

  compound = {f: next(iter(p)) for f, p in pers.items()
              if len(p) == 1 and blocks_split(f, next(iter(p)))}
  letters = {f: f"f{i}" for i, f in enumerate(extent)}
  alone = []

  def token(d):
    if d is not None and d[1] == 1:
      f = letters[d[0]]
      return f"({f} {f}p)" if d[0] in compound else f
    if d is not None and compound.get(d[0]) == d[1]:
      return letters[d[0]]
    alone.append(f"r{len(alone)}")
    return alone[-1]

  rule = " -> ".join(", ".join(" ".join(token(d) for d in dims) for dims in group)
                     for group in (labels, result_labels))
  reduced = [letters[f] for f in reduce if f in letters]
  reduced += [letters[f] + "p" for f in reduce if f in compound]
  alone += [letters[f] for f in whole if f in letters]
  # Shardy numbers factors as they first appear and wants each kind's list in that order.
  order = {}
  for name in re.findall(r"[a-z]\d+p?", rule):
    order.setdefault(name, len(order))
  reduced, alone = sorted(reduced, key=order.get), sorted(alone, key=order.get)
  kinds = dict(reduction_factors=tuple(reduced), need_replication_factors=tuple(alone),
               **{letters[f] + "p": p for f, p in compound.items()})
  return rule, kinds
