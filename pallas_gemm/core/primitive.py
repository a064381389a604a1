"""The machinery every family's JAX primitive shares: its creation, the x64 guard its
kernels trace under, the shard_map check of its abstract evaluation, its effects in
interpret mode, its lowering as a shard's local computation, and symbolic zero tangents.
A family supplies its plan, kernel and rules (jvp, transpose, batching, partitioning);
this module supplies what is the same for all of them."""

from __future__ import annotations

import contextlib
import functools

import jax
from jax.interpreters import ad, mlir
# Private but stable since jax 0.4: the primitive/impl plumbing has no public alias, and
# `prim_requires_devices_during_lowering` is how custom_partitioning itself asks for the
# device assignment at lowering time (a primitive that wraps it must ask too).
from jax._src import config as jax_config, core, dispatch

no_effects = core.no_effects


def new_primitive(name: str, *, multiple_results: bool = False,
                  requires_devices: bool = False) -> core.Primitive:
  """A primitive whose impl is its own jit-compiled lowering (as lax's primitives)."""
  prim = core.Primitive(name)
  prim.multiple_results = multiple_results
  prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
  if requires_devices:
    dispatch.prim_requires_devices_during_lowering.add(prim)
  return prim


def kernel_x64(backend: str):
  """The context a backend's kernel is traced in. The Pallas and FFI kernels' index
  arithmetic is int32: with jax_enable_x64 on, their Python-int constants would become
  int64 and mix with it (lax.div of int32 by int64). Their operands and results are the
  same either way. XLA's own ops take x64 as the user set it."""
  return contextlib.nullcontext() if backend == "xla" else jax.enable_x64(False)


def x64_off(kernel):
  """`kernel` traced with jax_enable_x64 off (`kernel_x64`)."""

  def traced(*args, **kwargs):
    with jax.enable_x64(False):
      return kernel(*args, **kwargs)

  return traced


def check_manual_axes(op: str, names: str, avals, hint: str = "") -> None:
  """Inside jax.shard_map the result varies over the manual axes its operands vary over,
  which must be one set: the ValueError naming the operands otherwise."""
  if len({x.manual_axis_type for x in avals}) != 1:
    raise ValueError(f"{op} inside jax.shard_map needs {names} to vary over the same manual"
                     f" mesh axes; got {[x.manual_axis_type for x in avals]}{hint}")


def plain(avals):
  """The avals without shardings or manual axes (what a kernel traces on)."""
  return tuple(core.ShapedArray(x.shape, x.dtype) for x in avals)


def interpret_effects(kernel, *avals):
  """The effects `kernel` has when traced on avals: Mosaic GPU's interpreter (on the CPU)
  keeps its simulated GPU state through ordered io_callbacks, which the primitive must
  declare. Only called for interpret mode; a GPU kernel has none."""
  return jax.make_jaxpr(kernel)(*avals).effects


def lower_local(ctx, lowering, *args, multiple_results: bool, **params):
  """Lowers `lowering(*args, **params)` as the local computation of one shard. The
  partitioner, not the avals, carries the shardings from here on (traced with the avals'
  shardings, a K-sharded lax.dot_general refuses to guess an output sharding, and
  custom_partitioning sees global shapes anyway); inside jax.shard_map the varying-axes
  check, applied to the result by the abstract evaluation, has nothing to check inside."""
  unsharded = lambda aval: core.ShapedArray(aval.shape, aval.dtype)  # noqa: E731
  inner = ctx.replace(avals_in=[unsharded(x) for x in ctx.avals_in],
                      avals_out=[unsharded(x) for x in ctx.avals_out])
  with jax_config._check_vma(False):
    out = mlir.lower_fun(functools.partial(lowering, **params),
                         multiple_results=multiple_results)(inner, *args)
  if inner.tokens_out is not None:  # Mosaic GPU's interpreter: ordered effects
    ctx.set_tokens_out(inner.tokens_out)
  return out


def is_zero(t) -> bool:
  """Whether a tangent or cotangent is absent or symbolically zero."""
  return t is None or type(t) is ad.Zero


def zero_like(out):
  """The symbolic zero tangent of out (jax 0.11 has no ad.Zero.from_primal_value)."""
  return ad.Zero(core.typeof(out).to_tangent_aval())
