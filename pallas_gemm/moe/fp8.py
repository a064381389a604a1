"""`moe_mlp`'s fp8 inference form: expert weights quantized once (`quantize_experts`),
activations quantized in the call, both grouped GEMMs on `scaled_ragged_dot`.

    gate_up8, down8 = quantize_experts(w_gate_up, w_down)   # once, e.g. after loading
    out = moe_mlp(x, weights, ids, gate_up8, down8)         # fp8 GEMMs, x's dtype out

DeepSeek-V3's recipe for the blocks: weights in 128x128 blocks per expert, K-major; the
activations that enter each GEMM (the gathered rows of x, and act(gate) * up) in 1x128
blocks along the contraction, with power-of-two scales (`pallas_gemm.quantize`). The
dispatch, the activation and the combine are the bf16 layer's (`layer.py`). Forward only:
the values of a quantized weight have no gradient, and asking for one is an error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_gemm import fp8 as fp8_ops
from pallas_gemm.moe import layer

BLOCK = 128  # the scale block along a contraction, and a weight block's rows


def quantize_experts(w_gate_up, w_down, dtype=jnp.float8_e4m3fn):
  """((values, scales), (values, scales)): the bf16 layer's weights w_gate_up (E, D, W)
  and w_down (E, F, D) as `moe_mlp`'s fp8 form takes them, each a `quantize` pair: values
  K-major, (E, W, D) and (E, D, F), with 128x128 block scales (E, ceil(W/128), D/128) and
  (E, ceil(D/128), F/128). D and F must be multiples of 128 (the scale blocks along the
  contractions); pad the weights with zeros otherwise."""
  for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
    if not hasattr(w, "ndim") or w.ndim != 3:
      raise ValueError(f"{name} must be a 3-D (E, ...) array; got {getattr(w, 'shape', w)!r}")
    if w.shape[1] % BLOCK:
      raise ValueError(f"{name}.shape={tuple(w.shape)}: its contraction (dim 1) must be a"
                       f" multiple of {BLOCK}, the fp8 scale block; pad it with zeros")
  blocks = (BLOCK, BLOCK)
  gu8, gu_s = fp8_ops.quantize(jnp.swapaxes(w_gate_up, 1, 2), dtype, block_shape=blocks)
  dn8, dn_s = fp8_ops.quantize(jnp.swapaxes(w_down, 1, 2), dtype, block_shape=blocks)
  return (gu8, gu_s), (dn8, dn_s)


def _gemm(plan: layer.Plan, rows, w8, w_scales, group_sizes, dtype):
  rows8, row_scales = fp8_ops.quantize(rows, w8.dtype)  # 1x128 blocks along the contraction
  return fp8_ops.scaled_ragged_dot(rows8, w8, group_sizes, row_scales, w_scales,
                           preferred_element_type=dtype, backend=plan.backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def layer_fp8(plan: layer.Plan, x, topk_weights, gu8, gu_scales, dn8, dn_scales,
              d: layer.Dispatch):
  """out (T, D) of x (T, D) with quantized experts (module docstring)."""
  h = _gemm(plan, x[d.token], gu8, gu_scales, d.group_sizes, x.dtype)
  y = _gemm(plan, layer.act(plan, h), dn8, dn_scales, d.group_sizes, x.dtype)
  return layer.combine(y, d.inverse, topk_weights, plan.out_dtype)


def _fwd(plan, *args):
  return layer_fp8(plan, *args), None


def _bwd(plan, residuals, g):
  raise TypeError("moe_mlp with quantized expert weights (quantize_experts) is inference"
                  " only: it has no gradient; differentiate the bf16 form instead")


layer_fp8.defvjp(_fwd, _bwd)
