"""`gemm` as a JAX primitive: what it does under AD, vmap, jit and shardings.

The front door (`api.gemm`) validates, chooses a backend and a config, and binds `gemm_p`
on the normalised problem of `_contract.md` (3-D operands, one dtype, static alpha/beta).
Every rule JAX needs lives here, so "what happens under jit with shardings" is one file:

- abstract eval: the (batch, M, N) result of `Plan.out_dtype`.
- JVP: the op is linear in a, in b and in c separately, so the tangent is
  ``alpha*op(da)@op(b) + alpha*op(a)@op(db) + beta*dc``: two more `gemm_p`, the second
  taking the first as its C so the sum happens in the kernel's f32 epilogue.
- gates: a call whose a is an activation's output (``a_activation``, the layer after
  the activation) differentiates in a through ``act'(a) * da``. That product stays inside
  a `gemm_p` (``a_gate``), so its transpose is one GEMM whose epilogue multiplies by
  ``act'(a)`` (``c_gate``, a as its C): the backward pass of an MLP's hidden activation
  fused into the GEMM that computes the hidden gradient, where XLA spends a pass on it.
- transpose: the cotangent of a linear a, b or c as `gemm_p` calls of the same backend.
  Reverse mode is JVP + transpose, so `grad`, `jvp`, `linearize`, `jacfwd`, `jacrev` and
  `hessian` all work and every tangent/cotangent GEMM runs on the forward's backend.
- batching: a vmapped axis folds into the kernels' batch axis (no per-lowering rule).
- lowering: through `jax.experimental.custom_partitioning`, so XLA's SPMD partitioner
  (Shardy, jax's default) runs the local GEMM on each device's shard instead of gathering
  the operands onto every device (`_partition` states the plan: batch/M/N-sharded -> no
  collective; K-sharded -> f32 partial sums, one all-reduce (or a reduce-scatter, then
  beta*C and the cast on each device's rows, then a 16-bit all-gather); with K over two
  GPUs and a backend with pair kernels (`pair_gemm`: mosaic), no collective: they
  exchange the f32 rows themselves).

What a backend module offers beyond `gemm` (`Config`, `default_config`, `supports`, ...)
is read from optional attributes: FUSED_ACTIVATIONS / FUSED_GATES / KEEPS_PRE (what its
epilogue fuses), XLA_PARTITIONS (XLA partitions its call natively), INTERPRET_EFFECTS
(its interpret mode has effects), pair_gemm / pair_reason (K split over two GPUs).
  On one device, or inside `shard_map` (all axes manual), it is the plain kernel call.
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
# Private but stable since jax 0.4: core.ShapedArray / core.typeof have no public alias.
from jax._src import core

from pallas_gemm.core import epilogue, primitive, sharding

F32 = np.dtype(np.float32)
# Whether a K split over two GPUs runs a backend's pair kernels (`_pair_axis`). False: the
# NCCL collectives of `_partition` instead (the benchmark times both). Read when a call is
# partitioned, i.e. compiled.
PAIR_KERNELS = True


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one call: hashable, the primitive's only parameter."""
  backend: str
  config: Any
  alpha: float
  beta: float          # 0.0 exactly when the call has no C operand
  transpose_a: bool
  transpose_b: bool
  precision: jax.lax.Precision | None
  out_dtype: np.dtype
  interpret: bool
  bias: bool = False                # a (N,) bias operand follows c
  activation: str | None = None     # a name in epilogue.ACTIVATIONS
  # Elementwise prologues on a (names in epilogue.ACTIVATIONS), run by XLA before the
  # kernel: op(a) -> act(op(a)), or op(a) -> act'(aux) * op(a) with an operand aux of
  # a's shape after b. Only the JVP creates a_gate plans.
  a_activation: str | None = None
  a_gate: str | None = None
  # c is not added but multiplies: act'(c) * alpha * op(a) @ op(b) (beta is 1.0, there is
  # no bias and no activation). The transpose of an a_gate plan creates it.
  c_gate: str | None = None
  # With an activation: the call returns (act(z), z), z the pre-activation (cuBLASLt's
  # GELU_AUX): a hidden layer whose output the next layer reads and whose z that
  # layer's gate needs (layers.mlp).
  keep_pre: bool = False
  # With a_activation: operand aux holds act(a), the activation of a computed with a by
  # a keep_pre call, so the product reads it instead of recomputing act(a) (layers.mlp).
  a_given: bool = False

  def __post_init__(self):
    if self.keep_pre and self.activation is None:
      raise ValueError("Plan.keep_pre returns (act(z), z): it needs an activation")
    if self.a_given and (self.a_activation is None or self.a_gate is not None):
      raise ValueError("Plan.a_given is act(a) for a_activation: it needs one, and no a_gate")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["a", "b", "aux", "c", "bias"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Operands:
  """The primitive's traced operands, an absent one None: a pytree whose leaves are the
  primitive's arguments (a, b, then those present of aux, c, bias) and whose treedef is
  its static `tree` parameter, so the rules below read operands by name. c is present
  exactly when plan.beta != 0, bias when plan.bias, aux (a's gate, or act(a) given)
  when plan.a_gate or plan.a_given. A kernel family with more traced inputs (scales,
  group sizes) adds fields here, not presence flags."""
  a: Any
  b: Any
  c: Any = None
  bias: Any = None
  aux: Any = None


def _bind(plan: Plan, ops: Operands) -> list:
  leaves, tree = jax.tree.flatten(ops)
  return gemm_p.bind(*leaves, plan=plan, tree=tree)


def bind(plan: Plan, a, b, c=None, bias=None, aux=None):
  """act(alpha * op(a) @ op(b) [+ beta * c] [+ bias]) on normalised operands (see
  `_contract.md` and `Operands`). A keep_pre plan returns (act(z), z)."""
  outs = _bind(plan, Operands(a, b, c=c, bias=bias, aux=aux))
  return tuple(outs) if plan.keep_pre else outs[0]


def _per_operand(tree, **values) -> list:
  """values[name] for each operand present in `tree`, in the primitive's argument order."""
  present = tree.unflatten([True] * tree.num_leaves)
  return tree.flatten_up_to(Operands(**{
      f.name: values[f.name] if getattr(present, f.name) is not None else None
      for f in dataclasses.fields(Operands)}))


def _prologue(plan: Plan, a, aux):
  """a as the product reads it: act(a) (aux itself when a_given) or act'(aux) * a, in
  f32, rounded back to a's dtype (as XLA rounds an activation's output before the next
  dot)."""
  if plan.a_given:
    return aux.astype(a.dtype)
  a32 = a.astype(F32)
  if plan.a_activation is not None:
    a32 = epilogue.activate(a32, plan.a_activation)
  if plan.a_gate is not None:
    a32 = epilogue.derivative(aux.astype(F32), plan.a_gate) * a32
  return a32.astype(a.dtype)


def _mnk(plan: Plan, a_shape, b_shape) -> tuple[int, int, int]:
  m, k = (a_shape[-1], a_shape[-2]) if plan.transpose_a else (a_shape[-2], a_shape[-1])
  n = b_shape[-2] if plan.transpose_b else b_shape[-1]
  return m, n, k


def derive(plan: Plan, a_shape, b_shape, dtype, **changes) -> Plan:
  """`plan` with `changes`, and the config re-resolved for the new problem (the
  tangent/cotangent GEMMs have other shapes, layouts and output dtypes)."""
  from pallas_gemm.matmul import tuning  # noqa: PLC0415 - tuning imports the backends
  c_dtype = changes.pop("c_dtype", None)
  new = dataclasses.replace(plan, **changes)
  m, n, k = _mnk(new, a_shape, b_shape)
  config = tuning.resolve_config(new.backend, m, n, k, dtype, new.precision,
                                 out_dtype=new.out_dtype, c_dtype=c_dtype)
  return dataclasses.replace(new, config=config)


def _local_operands(plan: Plan, ops: Operands):
  """(a as the product reads it, b, c, bias) from the (local) operands."""
  a, b, c, bias, aux = ops.a, ops.b, ops.c, ops.bias, ops.aux
  if plan.a_activation is not None or plan.a_gate is not None:
    a = _prologue(plan, a, aux)  # elementwise: the same on a as on op(a)
  return a, b, c, bias


def _module(plan: Plan):
  """The backend module of the call (pallas_gemm.<backend>)."""
  return importlib.import_module(f"pallas_gemm.matmul.{plan.backend}")


def _kernel(plan: Plan, ops: Operands):
  """The backend call on (local) operands: its result, or (act(z), z) for keep_pre."""
  a, b, c, bias = _local_operands(plan, ops)
  module = _module(plan)
  gemm = module.gemm if plan.backend == "xla" else primitive.x64_off(module.gemm)
  call = functools.partial(
      gemm, a, b, alpha=plan.alpha, transpose_a=plan.transpose_a,
      transpose_b=plan.transpose_b, precision=plan.precision, config=plan.config,
      interpret=plan.interpret)
  if plan.c_gate is not None:
    if plan.c_gate in getattr(module, "FUSED_GATES", ()):
      return call(c, beta=1.0, out_dtype=plan.out_dtype, c_gate=plan.c_gate)
    return epilogue.apply(call(None, beta=0.0, out_dtype=F32), c, None, beta=0.0,
                          activation=None, out_dtype=plan.out_dtype, c_gate=plan.c_gate)
  if bias is None and plan.activation is None:
    return call(c, beta=plan.beta, out_dtype=plan.out_dtype)
  # What the kernel's epilogue fuses (FUSED_ACTIVATIONS; absent: neither bias nor an
  # activation) runs there; the rest in one XLA pass over its f32 result, before the cast.
  fused = getattr(module, "FUSED_ACTIVATIONS", None)
  kernel_act = plan.activation if fused is not None and plan.activation in fused else None
  kernel_bias = bias if fused is not None else None
  if kernel_act == plan.activation and kernel_bias is bias and (
      not plan.keep_pre or getattr(module, "KEEPS_PRE", False)):
    return call(c, beta=plan.beta, out_dtype=plan.out_dtype, bias=bias, activation=kernel_act,
                **({"keep_pre": True} if plan.keep_pre else {}))
  if plan.keep_pre:  # z from the kernel, act(z) in XLA (as the JVP of an activation does)
    z = _kernel(dataclasses.replace(plan, activation=None, keep_pre=False), ops)
    return epilogue.activated(z, plan.activation), z
  acc = call(c, beta=plan.beta, out_dtype=F32,
             **({} if fused is None else dict(bias=kernel_bias, activation=None)))
  return epilogue.apply(acc, None, None if kernel_bias is bias else bias, beta=0.0,
                        activation=plan.activation, out_dtype=plan.out_dtype)


# ----------------------------------------------------------------------------- primitive

# [out], or [act(z), z] for a keep_pre plan
gemm_p = primitive.new_primitive("pallas_gemm", multiple_results=True, requires_devices=True)


@gemm_p.def_effectful_abstract_eval
def _abstract_eval(a, b, *rest, plan, tree):
  m, n, _ = _mnk(plan, a.shape, b.shape)
  primitive.check_manual_axes(
      "gemm", "a, b (and c)", (a, b, *rest),
      ": apply jax.lax.pcast/pvary to the invariant operand, or pass check_vma=False to"
      " shard_map")
  # a's aval carries the mesh context (shard_map's manual axes) the result lives in.
  out = a.update(shape=(a.shape[0], m, n), dtype=np.dtype(plan.out_dtype), weak_type=False)
  return [out] * (1 + plan.keep_pre), _effects(plan, tree, *primitive.plain((a, b, *rest)))


@functools.lru_cache(maxsize=256)
def _effects(plan: Plan, tree, *avals):
  """The kernel's effects: none on a GPU; a backend whose interpret mode has some
  (INTERPRET_EFFECTS: Mosaic GPU's interpreter keeps its simulated GPU state through
  ordered io_callbacks) has them traced here, as the primitive must declare them."""
  if not (plan.interpret and getattr(_module(plan), "INTERPRET_EFFECTS", False)):
    return primitive.no_effects
  return primitive.interpret_effects(functools.partial(_flat_kernel, plan, tree), *avals)


# ----------------------------------------------------------------------------- JVP


def _jvp_rule(primals, tangents, *, plan, tree):
  out, tangent = _jvp(tree.unflatten(primals), tree.unflatten(tangents), plan=plan)
  return (list(out), list(tangent)) if plan.keep_pre else ([out], [tangent])


def _jvp(primals: Operands, tangents: Operands, *, plan, primal_out=None):
  """(out, tangent), both pairs for a keep_pre plan; primal_out: out already computed."""
  if plan.activation is not None:
    # act(z): z (bias included) from the kernel without the activation, rounded to the
    # output dtype as XLA rounds its GEMM output; act and act' in f32 around it. A
    # keep_pre plan computes act(z) and z in one kernel, and only the tangent here.
    linear = dataclasses.replace(plan, activation=None, keep_pre=False)
    if plan.keep_pre:
      out, z = _bind(plan, primals)
      _, dz = _jvp(primals, tangents, plan=linear, primal_out=z)
    else:
      z, dz = _jvp(primals, tangents, plan=linear)
      out = epilogue.activated(z, plan.activation)
    if type(dz) is ad.Zero:
      dout = primitive.zero_like(out)
    else:
      dout = (epilogue.derivative(z.astype(F32), plan.activation)
              * dz.astype(F32)).astype(plan.out_dtype)
    return ((out, z), (dout, dz)) if plan.keep_pre else (out, dout)
  if plan.c_gate is not None:
    return _jvp_c_gate(primals, tangents, plan)
  a, b, c, bias, aux = primals.a, primals.b, primals.c, primals.bias, primals.aux
  da, db, dc, dbias, daux = (tangents.a, tangents.b, tangents.c, tangents.bias,
                             tangents.aux)
  if plan.a_gate is not None:
    # A second-order path (the first-order JVP only creates a_gate plans): the prologue
    # act'(aux) * a and its tangent in XLA, then the product of a plain plan.
    prologue = functools.partial(_prologue, plan)
    if primitive.is_zero(da) and primitive.is_zero(daux):
      a = prologue(a, aux)
    else:
      a, da = jax.jvp(prologue, (a, aux), tuple(map(ad.instantiate_zeros, (da, daux))))
    plan = dataclasses.replace(plan, a_gate=None)
  # The terms of the tangent: (x, y, plan changes, aux) for each product alpha*op(x)@op(y).
  if plan.a_activation is not None:
    # a enters as h = act(a): d(h @ b) = (act'(a) * da) @ b + h @ db. The first term is an
    # a_gate plan with a as its aux, so reverse mode transposes it into one gated GEMM.
    # A given h (a_given) is act(a) by construction: its tangent is act'(a) * da, which
    # the first term carries, so the tangent of aux is not used.
    h, act = _prologue(plan, a, aux if plan.a_given else None), plan.a_activation
    plan = dataclasses.replace(plan, a_activation=None, a_given=False)
    out = bind(plan, h, b, c, bias) if primal_out is None else primal_out
    terms = [(da, b, {"a_gate": act}, a), (h, db, {}, None)]
  else:
    out = bind(plan, a, b, c, bias) if primal_out is None else primal_out
    terms = [(da, b, {}, None), (a, db, {}, None)]
  # The tangent through the kernels' C and bias inputs (summed in their f32 epilogue):
  # beta*dc + dbias, then + each product. Each partial is rounded to the output dtype, as
  # jnp.dot's own JVP rounds its two products (an f32 partial would make the transposed
  # GEMMs run in f32 for 16-bit inputs).
  acc, acc_beta = (None, 0.0) if primitive.is_zero(dc) else (dc, plan.beta)
  acc_bias = None if primitive.is_zero(dbias) else dbias
  terms = [(x, y, changes, x_aux) for x, y, changes, x_aux in terms
           if not primitive.is_zero(x) and not primitive.is_zero(y)]
  for x, y, changes, x_aux in terms:
    p = derive(plan, x.shape, y.shape, x.dtype, beta=acc_beta if acc is not None else 0.0,
               bias=acc_bias is not None, c_dtype=None if acc is None else np.dtype(acc.dtype),
               **changes)
    acc, acc_beta, acc_bias = bind(p, x, y, acc, acc_bias, x_aux), 1.0, None
  if acc is None and acc_bias is None:
    return out, primitive.zero_like(out)
  if not terms:  # only c and/or the bias moved
    t = jnp.zeros(out.shape, F32) if acc is None else plan.beta * acc.astype(F32)
    acc = (t if acc_bias is None else t + acc_bias.astype(F32)).astype(plan.out_dtype)
  return out, acc


def _jvp_c_gate(primals, tangents, plan):
  """act'(c) * p with p = alpha*op(a)@op(b): the primal fused, the tangent act'(c) * dp +
  act''(c) * dc * p in XLA (a second-order path: only a transpose creates these plans)."""
  a, b, c, aux = primals.a, primals.b, primals.c, primals.aux
  da, db, dc, daux = tangents.a, tangents.b, tangents.c, tangents.aux
  out = bind(plan, a, b, c, aux=aux)
  inner = dataclasses.replace(plan, c_gate=None, beta=0.0)
  p, dp = _jvp(Operands(a, b, aux=aux), Operands(da, db, aux=daux), plan=inner)
  gate = lambda p, c: epilogue.apply(p.astype(F32), c, None, beta=0.0,  # noqa: E731
                                     activation=None, out_dtype=plan.out_dtype,
                                     c_gate=plan.c_gate)
  if primitive.is_zero(dc) and primitive.is_zero(dp):
    return out, primitive.zero_like(out)
  _, tangent = jax.jvp(gate, (p, c), tuple(map(ad.instantiate_zeros, (dp, dc))))
  return out, tangent


ad.primitive_jvps[gemm_p] = _jvp_rule


# ----------------------------------------------------------------------------- transpose


def _transpose(cts, *args, plan, tree):
  """Cotangents of the linear operands (a or b, and c, bias) of
  alpha*op(a)@op(b) + beta*c + bias (the JVP never leaves an activation to transpose),
  with a's gate act'(aux) * a or the output's gate act'(c) * (...)."""
  assert plan.activation is None and plan.a_activation is None, "not linear"
  g, = cts
  ops = tree.unflatten(args)
  a, b, c, bias, aux = ops.a, ops.b, ops.c, ops.bias, ops.aux
  a_lin, b_lin = ad.is_undefined_primal(a), ad.is_undefined_primal(b)
  assert not (a_lin and b_lin), "gemm is bilinear: a and b cannot both be linear"
  assert not ad.is_undefined_primal(aux), "a gate is not linear in its aux"
  assert not (plan.c_gate and ad.is_undefined_primal(c)), "a gate is not linear in its c"
  if type(g) is ad.Zero:
    return [None] * len(args)
  a_aval = a.aval if a_lin else core.typeof(a)
  b_aval = b.aval if b_lin else core.typeof(b)
  if plan.c_gate is not None:  # act'(c) * p: p's cotangent is act'(c) * g (second order)
    g = epilogue.apply(g.astype(F32), c, None, beta=0.0, activation=None, out_dtype=g.dtype,
                       c_gate=plan.c_gate)
  if plan.a_gate is not None and b_lin:  # the gated a is a constant here
    a = _prologue(plan, a, aux)
  # Backends take one input dtype. A cotangent wider than the inputs (f16 in, f32 out)
  # keeps its width: narrowing it would overflow under f16 loss scaling.
  wide = np.dtype(jnp.promote_types(g.dtype, a_aval.dtype))
  g_in = g.astype(wide)
  ta, tb = plan.transpose_a, plan.transpose_b

  def mm(x, y, *, trans_x, trans_y, out_dtype, gate=None):
    # gate: da of an a_gate plan is act'(aux) * (its plain cotangent), stored as a is
    # stored, so aux is the cotangent GEMM's C and the product is gated in its epilogue.
    p = derive(plan, x.shape, y.shape, wide, beta=0.0 if gate is None else 1.0,
               transpose_a=trans_x, transpose_b=trans_y, out_dtype=np.dtype(out_dtype),
               bias=False, a_gate=None, c_gate=gate,
               c_dtype=None if gate is None else np.dtype(aux.dtype))
    return bind(p, x, y, None if gate is None else aux)

  da = db = None
  if a_lin:  # dA = alpha * g @ op(b)^T, stored as op(a) is stored
    b3 = b.astype(wide)
    if not ta:
      da = mm(g_in, b3, trans_x=False, trans_y=not tb, out_dtype=a_aval.dtype, gate=plan.a_gate)
    else:  # dA^T = alpha * op(b) @ g^T
      b_full = jnp.broadcast_to(b3, (a_aval.shape[0],) + b3.shape[1:])
      da = mm(b_full, g_in, trans_x=tb, trans_y=True, out_dtype=a_aval.dtype, gate=plan.a_gate)
  if b_lin:  # dB = alpha * op(a)^T @ g
    a3, g_c, ta_c = a.astype(wide), g_in, ta
    if b_aval.shape[0] == 1 and a3.shape[0] > 1:
      # A b shared by every batch entry sums over the batch: one GEMM with the batch
      # folded into the contraction.
      a_rows = jnp.swapaxes(a3, 1, 2) if ta else a3           # (B, M, K)
      a3, ta_c = a_rows.reshape(1, -1, a_rows.shape[-1]), False
      g_c = g_in.reshape(1, -1, g_in.shape[-1])               # (1, B*M, N)
    if not tb:
      db = mm(a3, g_c, trans_x=not ta_c, trans_y=False, out_dtype=b_aval.dtype)
    else:  # dB^T = alpha * g^T @ op(a)
      db = mm(g_c, a3, trans_x=True, trans_y=ta_c, out_dtype=b_aval.dtype)
  dc = dbias = None
  if c is not None and ad.is_undefined_primal(c):
    dc = (plan.beta * g.astype(F32)).astype(c.aval.dtype)
  if bias is not None and ad.is_undefined_primal(bias):
    dbias = jnp.sum(g.astype(F32), axis=(0, 1)).astype(bias.aval.dtype)
  return tree.flatten_up_to(Operands(da, db, c=dc, bias=dbias, aux=None))


ad.primitive_transposes[gemm_p] = _transpose


# ----------------------------------------------------------------------------- batching


def _batch(args, dims, *, plan, tree):
  """Folds the vmapped axis V into the batch axis: (V, B, r, c) -> (V*B, r, c)."""
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  moved = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
  mapped = [d is not None for d in dims]
  batch = max(x.shape[1] if bat else x.shape[0] for x, bat in zip(moved[:2], mapped[:2]))
  m, n, _ = _mnk(plan, moved[0].shape[int(mapped[0]):], moved[1].shape[int(mapped[1]):])

  def fold(x, is_mapped, keep_shared=False):
    # Unmapped operands repeat across V; a b shared by every batch entry (B == 1) stays
    # shared when it is not vmapped either.
    if not is_mapped:
      if keep_shared:
        return x
      x = jnp.broadcast_to(x, (size,) + x.shape)
    x = jnp.broadcast_to(x, (size, batch) + x.shape[2:])
    return x.reshape((size * batch,) + x.shape[2:])

  outs = 1 + plan.keep_pre
  if size * batch == 0:  # an empty vmapped axis: nothing for a kernel to do
    return [jnp.zeros((size, batch, m, n), plan.out_dtype)] * outs, [0] * outs
  ops, is_mapped = tree.unflatten(moved), tree.unflatten(mapped)
  a, b, c, bias, aux = ops.a, ops.b, ops.c, ops.bias, ops.aux
  c_mapped, bias_mapped, aux_mapped = is_mapped.c, is_mapped.bias, is_mapped.aux
  if bias is not None and bias_mapped:
    # One bias per vmapped entry is no longer one (N,) vector for the kernel: it joins C.
    rows = jnp.broadcast_to(bias[:, None, None, :].astype(F32), (size, batch, m, n))
    c = rows if c is None else rows + plan.beta * c.astype(F32)
    c_mapped, bias, plan = True, None, dataclasses.replace(plan, beta=1.0, bias=False)
  folded = Operands(fold(a, mapped[0]), fold(b, mapped[1], keep_shared=b.shape[0] == 1),
                    c=None if c is None else fold(c, c_mapped), bias=bias,
                    aux=None if aux is None else fold(aux, aux_mapped))
  out = _bind(plan, folded)
  return [x.reshape((size, batch, m, n)) for x in out], [0] * outs


batching.primitive_batchers[gemm_p] = _batch


# ----------------------------------------------------------------------------- sharding


def _shared_b(a_shape, b_shape) -> bool:
  """One b (batch 1) serves every batch entry of a."""
  return b_shape[0] == 1 and a_shape[0] > 1


def _plan_sharding(plan: Plan, mesh, arg_shapes, result_shape) -> dict:
  """Mesh axes per factor (batch, m, n, k) for one call, and how a split K is summed.

  The operands' shardings come first (batch, M, N, then K; a mesh axis serves one factor),
  then the result's fills the factors still unsharded: an output sharding requested over
  replicated operands makes each device slice its operands locally (no communication).
  K is split only when the devices divide it evenly (a padded K shard would add garbage
  into the sums). A split K is summed by one reduce-scatter over M rows when the result
  is wanted sharded on M over the K axes (and the rows divide); else, for a 16-bit result,
  by a reduce-scatter whose rows are finished and all-gathered in the output dtype
  (`gather`); else by one all-reduce.
  """
  a, b, *_ = arg_shapes
  sa, sb = sharding.spec_axes(a.sharding, 3), sharding.spec_axes(b.sharding, 3)
  so = sharding.spec_axes(result_shape.sharding, 3)
  ma, ka = (2, 1) if plan.transpose_a else (1, 2)
  kb, nb = (2, 1) if plan.transpose_b else (1, 2)
  shared_b = _shared_b(a.shape, b.shape)
  m, n, k = _mnk(plan, a.shape, b.shape)
  sources = {"batch": [sa[0]] + ([] if shared_b else [sb[0]]), "m": [sa[ma]], "n": [sb[nb]],
             "k": [sa[ka], sb[kb]]}
  used, chosen = set(), {}
  for factor, candidates in sources.items():
    chosen[factor] = next((axes for axes in (tuple(x for x in c if x not in used)
                                             for c in candidates) if axes), ())
    if factor == "k" and k % sharding.size(mesh, chosen["k"]):
      chosen["k"] = ()
    used.update(chosen[factor])
  for factor, dim in (("batch", 0), ("m", 1), ("n", 2)):
    if not chosen[factor]:
      chosen[factor] = tuple(x for x in so[dim] if x not in used)
      used.update(chosen[factor])
  m_devices = sharding.size(mesh, chosen["m"])
  rows = m // m_devices if m % m_devices == 0 else 0
  splits_rows = rows > 0 and rows % sharding.size(mesh, chosen["k"]) == 0
  chosen["scatter"] = bool(chosen["k"]) and set(chosen["k"]) <= set(so[1]) and splits_rows
  chosen["gather"] = (bool(chosen["k"]) and not chosen["scatter"] and splits_rows
                      and np.dtype(plan.out_dtype).itemsize < 4)
  return chosen


def _partition(plan: Plan, tree, mesh, arg_shapes, result_shape):
  if plan.keep_pre:  # (act(z), z): both laid out alike
    result_shape = result_shape[0]
  f = _plan_sharding(plan, mesh, arg_shapes, result_shape)
  bt, m, n, k = f["batch"], f["m"], f["n"], f["k"]
  shared_b = _shared_b(arg_shapes[0].shape, arg_shapes[1].shape)
  a_spec = (bt, k, m) if plan.transpose_a else (bt, m, k)
  b_batch = () if shared_b else bt
  b_spec = (b_batch, n, k) if plan.transpose_b else (b_batch, k, n)
  out_spec = (bt, m + k if f["scatter"] else m, n)
  named = lambda spec: NamedSharding(  # noqa: E731
      mesh, PartitionSpec(*map(sharding.entry, spec)))
  arg_shardings = _per_operand(tree, a=named(a_spec), b=named(b_spec), aux=named(a_spec),
                               c=named(out_spec), bias=named((n,)))

  pair = _pair_axis(plan, mesh, f, arg_shapes)

  def local(*args):
    ops = tree.unflatten(args)
    if not k:
      return _kernel(plan, ops)
    if pair is not None:
      return _pair_kernel(plan, pair, not f["scatter"], ops)
    # K split over devices: f32 partial sums, cast only after the sum (as one GEMM
    # would), then beta*C (or the gate), the bias and the activation once. a's
    # prologue is elementwise: each device applies it to its own K shard.
    c, bias = ops.c, ops.bias
    partial = _kernel(dataclasses.replace(plan, beta=0.0, out_dtype=F32, bias=False,
                                          activation=None, c_gate=None, keep_pre=False),
                      Operands(ops.a, ops.b, aux=ops.aux))
    finish = functools.partial(epilogue.apply, beta=plan.beta, activation=plan.activation,
                               out_dtype=plan.out_dtype, c_gate=plan.c_gate)
    if plan.keep_pre:
      finish = functools.partial(_finish_pair, plan)
    if f["scatter"]:
      acc = jax.lax.psum_scatter(partial, k, scatter_dimension=1, tiled=True)
    elif f["gather"]:
      # A replicated 16-bit result: reduce-scatter the f32 partials by rows, finish each
      # device's rows, all-gather them in the output dtype. 3/4 of an f32 all-reduce's
      # bytes (bf16 16384^3 on 2 H200s: 8.89 vs 9.30 ms).
      acc = jax.lax.psum_scatter(partial, k, scatter_dimension=1, tiled=True)
      if c is not None:
        rows = acc.shape[1]
        c = jax.lax.dynamic_slice_in_dim(c, jax.lax.axis_index(k) * rows, rows, axis=1)
      return jax.tree.map(lambda x: jax.lax.all_gather(x, k, axis=1, tiled=True),
                          finish(acc, c, bias))
    else:
      acc = jax.lax.psum(partial, k)
    return finish(acc, c, bias)

  out_sharding = named(out_spec)
  if plan.keep_pre:
    out_sharding = (out_sharding, out_sharding)
  return mesh, local, out_sharding, tuple(arg_shardings)


def _pair_axis(plan: Plan, mesh, f: dict, arg_shapes) -> str | None:
  """The mesh axis of a K split that the backend's `pair_gemm` sums with no collective
  (two devices exchange f32 partial rows over NVLink inside its kernels), or None for the
  collectives of `_partition`. It needs: a backend with pair kernels, on a GPU, K split
  over one axis of two devices, a result replicated over it or sharded by rows over it
  (which the pair kernels produce), no C (its C operand carries the received partial),
  an epilogue the kernel fuses, local shapes it accepts (`pair_reason`), and the
  kernels' own device numbering (mesh device ids 0..n-1 in order). The pair kernels
  pick their own configs, from plan.config only its num_sms."""
  k = f["k"]
  if (not PAIR_KERNELS or plan.interpret or len(k) != 1
      or mesh.shape[k[0]] != 2 or plan.beta != 0.0 or plan.c_gate is not None
      or not (f["scatter"] or f["gather"] or np.dtype(plan.out_dtype) == F32)
      or not np.array_equal(np.ravel(mesh.device_ids), np.arange(mesh.size))):
    return None
  module = _module(plan)
  if (getattr(module, "pair_gemm", None) is None
      or plan.activation not in getattr(module, "FUSED_ACTIVATIONS", ())):
    return None
  m, n, kk = _mnk(plan, arg_shapes[0].shape, arg_shapes[1].shape)
  sizes = [(m, f["m"]), (n, f["n"]), (kk, k)]
  if any(size % sharding.size(mesh, axes) for size, axes in sizes):
    return None  # an uneven shard: its local shape is not one size
  local = [size // sharding.size(mesh, axes) for size, axes in sizes]
  why = module.pair_reason(*local, arg_shapes[0].dtype, plan.out_dtype, plan.interpret,
                           plan.config.num_sms)
  return None if why else k[0]


def _pair_kernel(plan: Plan, axis: str, gather: bool, ops: Operands):
  """`_kernel` of a K split over the two devices of `axis`, by the backend's pair_gemm."""
  a, b, _, bias = _local_operands(plan, ops)
  return _module(plan).pair_gemm(
      a, b, axis=axis, gather=gather, alpha=plan.alpha, transpose_a=plan.transpose_a,
      transpose_b=plan.transpose_b, out_dtype=plan.out_dtype, num_sms=plan.config.num_sms,
      bias=bias, activation=plan.activation, keep_pre=plan.keep_pre)


def _finish_pair(plan: Plan, acc, c, bias):
  """(act(z), z) from a K-split's summed f32 product (keep_pre)."""
  z = epilogue.apply(acc, c, bias, beta=plan.beta, activation=None, out_dtype=plan.out_dtype)
  return epilogue.activated(z, plan.activation), z


def _sharding_rule(plan: Plan, tree, mesh, value_types, result_types):
  """Shardy's einsum-like rule: b(atch), m, n, k(contracting); s: a shared b's batch of 1;
  the bias runs along n; a gate's aux is laid out as a."""
  del mesh, result_types
  shapes = [mlir.ir.RankedTensorType(t).shape for t in value_types]
  shared_b = _shared_b(shapes[0], shapes[1])
  a = "b k m" if plan.transpose_a else "b m k"
  b = ("s" if shared_b else "b") + (" n k" if plan.transpose_b else " k n")
  operands = _per_operand(tree, a=a, b=b, aux=a, c="b m n", bias="n")
  results = ", ".join(["b m n"] * (1 + plan.keep_pre))
  return f"{', '.join(operands)} -> {results}", {"reduction_factors": ("k",)}


def _flat_kernel(plan: Plan, tree, *args):
  return _kernel(plan, tree.unflatten(args))


@functools.lru_cache(maxsize=None)
def _partitioned(plan: Plan, tree):
  call = custom_partitioning(functools.partial(_flat_kernel, plan, tree))
  call.def_partition(
      partition=functools.partial(_partition, plan, tree),
      sharding_rule=functools.partial(_sharding_rule, plan, tree))
  return call


def partitioned(plan: Plan) -> bool:
  """Whether the call lowers through custom_partitioning (see the module docstring).

  Not for a backend that XLA partitions natively (XLA_PARTITIONS: lax.dot_general), nor
  for an interpret mode with effects (INTERPRET_EFFECTS: Mosaic GPU's interpreter runs on
  ordered io_callbacks, which custom_partitioning cannot lower, so that CPU-only
  debugging path runs on gathered operands).
  """
  module = _module(plan)
  return not (getattr(module, "XLA_PARTITIONS", False)
              or (plan.interpret and getattr(module, "INTERPRET_EFFECTS", False)))


def _lowering(*args, plan, tree):
  out = (_partitioned(plan, tree)(*args) if partitioned(plan)
         else _kernel(plan, tree.unflatten(args)))
  return list(out) if plan.keep_pre else [out]


def _lower(ctx, *args, plan, tree):
  return primitive.lower_local(ctx, _lowering, *args, multiple_results=True, plan=plan,
                               tree=tree)


mlir.register_lowering(gemm_p, _lower)
