"""Launching a persistent, warp-specialized Mosaic GPU kernel: the grid's size, the
`plgpu.kernel` call (compute warpgroups + one producer, warpgroup lowering) and interpret
mode on the CPU. Shared by every Mosaic kernel in this package."""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

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


def call(kernel, *operands, interpret):
  """kernel(*operands); interpret: False, True, or the interpreter's parameters
  (plgpu.InterpretGPUParams, e.g. detect_races=True) to run it in on the CPU."""
  if not interpret:
    return kernel(*operands)
  params = (interpret if isinstance(interpret, plgpu.InterpretGPUParams)
            else plgpu.InterpretGPUParams())
  with plgpu.force_gpu_interpret_mode(params):
    return kernel(*operands)
