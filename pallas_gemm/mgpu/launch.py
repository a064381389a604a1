"""Launching a persistent, warp-specialized Mosaic GPU kernel: the grid's size, the
`plgpu.kernel` call (compute warpgroups + one producer, warpgroup lowering) and interpret
mode on the CPU. Shared by every Mosaic kernel in this package."""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.core import primitive, sharding
from pallas_gemm.mgpu import hw



def grid_sms(num_sms: int | None, interpret, *, need_gpu: bool = False) -> int:
  """CTAs of a persistent grid: num_sms, or else the device's SM count (hw.INTERPRET_NUM_SMS
  in interpret mode). need_gpu: a CPU without interpret is a ValueError (else the target
  GPU's count, `hw.num_sms`, lets the CPU lower for the GPU)."""
  if num_sms is not None:
    return num_sms
  if interpret:
    return hw.INTERPRET_NUM_SMS
  if need_gpu and jax.devices()[0].platform == "cpu":
    raise ValueError("interpret=False needs a GPU; on the CPU pass interpret=True")
  return hw.num_sms()


def warpgroup_kernel(body, *, out_type, num_ctas: int, num_compute_wgs: int,
                     cluster_size: int = 1, approx_math: bool = False, **kwargs):
  """plgpu.kernel over a (num_ctas,) grid named "sm" (clusters of cluster_size CTAs named
  "cluster") with num_compute_wgs + 1 warpgroups named "wg", warpgroup semantics."""
  if cluster_size > 1:
    kwargs.update(cluster=(cluster_size,), cluster_names=("cluster",))
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=(num_ctas,),
      grid_names=("sm",),
      num_threads=num_compute_wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          approx_math=approx_math),
      **kwargs,
  )


# A kernel called on values that vary over jax.shard_map's manual axes (a family that calls
# its kernels without a primitive of its own, inside a user's or moe_mlp's shard_map):
# Pallas traces kernels on unvarying Refs only, so the kernel becomes this primitive,
# whose result varies as its operands do and whose lowering traces the kernel on plain
# avals, as every family primitive's does (`primitive.lower_local`). In interpret mode it
# declares the interpreter's ordered effects, as the family primitives do.
_local_call_p = primitive.new_primitive("pallas_gemm_mosaic_call", multiple_results=True)


@_local_call_p.def_effectful_abstract_eval
def _local_call_abstract_eval(*avals, kernel, out_avals, kernel_effects):
  del kernel
  manual = avals[0].manual_axis_type  # one set: `call` casts the operands to it
  outs = [jax.core.ShapedArray(o.shape, o.dtype, sharding=avals[0].sharding.update(
      spec=jax.sharding.PartitionSpec(*([None] * len(o.shape)))), manual_axis_type=manual)
          for o in out_avals]
  return outs, kernel_effects


def _local_call_lowering(*operands, kernel, out_avals, kernel_effects):
  del out_avals, kernel_effects
  with jax.enable_x64(False):
    return jax.tree.leaves(kernel(*operands))


jax.interpreters.mlir.register_lowering(
    _local_call_p, lambda ctx, *args, **params: primitive.lower_local(
        ctx, _local_call_lowering, *args, multiple_results=True, **params))


def call(kernel, *operands, interpret):
  """kernel(*operands); interpret: False, True, or the interpreter's parameters
  (plgpu.InterpretGPUParams, e.g. detect_races=True) to run it in on the CPU."""
  if interpret:
    params = (interpret if isinstance(interpret, plgpu.InterpretGPUParams)
              else plgpu.InterpretGPUParams())
    kernel = _interpreted(kernel, params)
  operands = sharding.same_varying(*operands)
  if not sharding.varying_axes(operands[0]):  # outside shard_map: one set, empty
    return kernel(*operands)
  plain = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in operands]
  # One trace on plain avals gives the results' types and, in interpret mode, the
  # interpreter's effects (a GPU kernel has none to declare).
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    jaxpr, out = jax.make_jaxpr(kernel, return_shape=True)(*plain)
  leaves, tree = jax.tree.flatten(out)
  outs = _local_call_p.bind(
      *operands, kernel=kernel,
      kernel_effects=frozenset(jaxpr.effects) if interpret else primitive.no_effects,
      out_avals=tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in leaves))
  return jax.tree.unflatten(tree, outs)


def _interpreted(kernel, params):
  def run(*operands):
    with plgpu.force_gpu_interpret_mode(params):
      return kernel(*operands)
  return run
