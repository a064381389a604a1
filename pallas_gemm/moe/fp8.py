"""`moe_mlp` in fp8: the inference form with expert weights quantized once
(`quantize_experts`), and the training form (`precision="fp8"`) with bf16 master weights.

    gate_up8, down8 = quantize_experts(w_gate_up, w_down)   # once, e.g. after loading
    out = moe_mlp(x, weights, ids, gate_up8, down8)         # fp8 GEMMs, x's dtype out
    out = moe_mlp(x, weights, ids, w_gate_up, w_down, precision="fp8")   # differentiable
    cached = quantize_experts_for_training(w_gate_up, w_down)   # once per optimizer step
    out = moe_mlp(x, weights, ids, w_gate_up, w_down, precision="fp8", fp8_weights=cached)

DeepSeek-V3's recipe for the blocks: weights in 128x128 blocks per expert, K-major; the
activations that enter each GEMM (the gathered rows of x, and act(gate) * up) in 1x128
blocks along the contraction, with power-of-two scales (`pallas_gemm.quantize`). The
dispatch and the combine are the bf16 layer's (`layer.py`). The inference form runs its
first GEMM, the activation and the quantize of a as one Hopper kernel where it can and F
is at most FUSED_GATE_MAX_F (`fp8.gated`; `Plan.fuse_gate=False` keeps the three
passes); it is forward only: the values of a quantized weight have no gradient, and
asking for one is an error.

The training form (`layer_fp8_train`) quantizes with current scaling in every call, and
treats quantization as the identity in its gradients (straight through):
- forward: both grouped GEMMs in fp8, e4m3, the weights quantized K-major as
  `quantize_experts` makes them;
- input gradients: both in fp8, the cotangents quantized to e4m3 in 1x128 blocks, on
  the same fp8 weights. Each weight is quantized once per call of the layer (as
  `fp8_dot_general` does; expert-parallel with exchange_chunks, once per chunk) as it is
  stored, (E, D, 2F) and (E, F, D): K-major for the input gradients, whose contractions
  are 2F and D; the forward reads the same fp8 numbers transposed (a 128x128 block's
  amax, so its scale, does not depend on the direction it is read in), so no bf16 weight
  is copied, and the stored-layout fp8 copy is kept for the backward (half the weight's
  bf16 bytes);
- weight gradients: in the weights' dtype on the bf16 weight-gradient kernel, as
  `fp8_dot_general(wgrad="input")` (there is no grouped fp8 weight-gradient kernel; the
  dense layer's fastest step, `wgrad="fp8-block"`, runs them in fp8).
D and F must be multiples of 128, the scale blocks along every contraction. With
`fp8_weights` (`layer_fp8_cached`) the weights come quantized before the call, the same
numbers as above plus the forward's transposed values: nothing is quantized or transposed
per call, and the gradients still go to the bf16 weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import fp8 as fp8_ops
from pallas_gemm.core import sharding
from pallas_gemm.mgpu import hw
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
  return _quantize_transposed(w_gate_up, dtype), _quantize_transposed(w_down, dtype)


def _quantize_transposed(w, dtype):
  """quantize(w^T) in 128x128 blocks for w (E, K, N): computed as w quantized as stored,
  then transposed, where N fills whole blocks (a block's amax, so its scale and values,
  do not depend on the direction it is read in): the transpose then moves fp8 bytes, not
  w's, and no transposed copy of w is made."""
  if w.shape[2] % BLOCK or not w.shape[2]:
    return _quantize_weight(jnp.swapaxes(w, 1, 2), dtype)
  values, scales = _quantize_weight(w, dtype)
  return jnp.swapaxes(values, 1, 2), jnp.swapaxes(scales, 1, 2)


def _quantize_weight(w, dtype):
  """(values, 128x128 block scales) of (E, rows, columns) weights, the columns K-major."""
  return fp8_ops.quantize(w, dtype, block_shape=(BLOCK, BLOCK))


def _gemm(plan: layer.Plan, rows, w8, w_scales, group_sizes, dtype):
  """rows @ w[e] per group in fp8: rows (R, K) quantized here in 1x128 blocks along the
  contraction, or given as such a (values, scales) pair."""
  rows8, row_scales = rows if isinstance(rows, tuple) else fp8_ops.quantize(rows, w8.dtype)
  return fp8_ops.scaled_ragged_dot(rows8, w8, group_sizes, row_scales, w_scales,
                           preferred_element_type=dtype, backend=plan.backend)


@dataclasses.dataclass(frozen=True)
class Quantized:
  """An array quantized before the layer's GEMMs read it, and the dtype it had:
  - rows (`receive8`: quantized on the device that sent them): fp8 values (T, D) and
    1x128 block scales (T, D/128); dtype, which the layer's intermediates take (x's);
  - a weight w (E, K, N) of the training form (`_prepare8`), K the forward's
    contraction: e4m3 values as stored, (E, K, N), with 128x128 block scales (E, K/128,
    N/128), quantized once per layer call (or once per optimizer step:
    `quantize_experts_for_training`): K-major for the input gradient, which contracts N;
    dtype, its gradient's. The backward reads these instead of the weight: half its
    bytes kept. values_t: the values transposed, (E, N, K), K-major for the forward,
    where they were made once with the values (`quantize_experts_for_training`); None:
    `pair(transposed=True)` transposes them in the call."""
  values: jax.Array
  scales: jax.Array
  dtype: Any
  values_t: jax.Array | None = None

  def pair(self, transposed: bool = False):
    """(values, scales); transposed (a weight), the same fp8 numbers and block scales
    read along the other axis: (E, N, K), K-major for the forward's rows @ w[e] (a
    128x128 block's amax does not depend on the direction it is read in). The values
    are transposed here unless values_t holds them already."""
    if not transposed:
      return self.values, self.scales
    values_t = jnp.swapaxes(self.values, 1, 2) if self.values_t is None else self.values_t
    return values_t, jnp.swapaxes(self.scales, 1, 2)


jax.tree_util.register_dataclass(Quantized, data_fields=["values", "scales", "values_t"],
                                 meta_fields=["dtype"])


def _pair_rows8(x, d: layer.Dispatch, dtype):
  """quantize(x[d.token]) as x's T rows quantized, then gathered: a 1x128 block lies in one
  row, so the values and scales are the same, for a quantize of T rows instead of T * k
  and a gather of fp8 bytes instead of x's. x: the rows, or their `Quantized`."""
  values, scales = x.pair() if isinstance(x, Quantized) else fp8_ops.quantize(x, dtype)
  return values[d.token], scales[d.token]


def send8(x, w_gate_up):
  """x's rows quantized as the fp8 weights' dtype in 1x128 blocks and packed for the
  wire as bytes: (T, D) values, then (T, D/128) float32 scales, D + D/32 bytes a row
  (bf16 rows take 2D). A block lies in one row, so quantizing on the sender gives the
  receiver the very values and scales it would compute."""
  values, scales = fp8_ops.quantize(x, w_gate_up[0].dtype)
  as_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(x.shape[0], -1)
  return jnp.concatenate([jax.lax.bitcast_convert_type(values, jnp.uint8), as_bytes], axis=1)


def receive8(rows, x, w_gate_up) -> Quantized:
  """The rows that `send8` packed from x's, as `Quantized`."""
  d_model = x.shape[1]
  values = jax.lax.bitcast_convert_type(rows[:, :d_model], w_gate_up[0].dtype)
  scales = rows[:, d_model:].reshape(rows.shape[0], d_model // BLOCK, 4)
  return Quantized(values, jax.lax.bitcast_convert_type(scales, jnp.float32),
                   np.dtype(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def layer_fp8(plan: layer.Plan, x, topk_weights, gu8, gu_scales, dn8, dn_scales,
              d: layer.Dispatch):
  """out (T, D) of x (T, D) with quantized experts (module docstring)."""
  rows = _pair_rows8(x, d, gu8.dtype)
  if _fused_gate(plan, rows[0], gu8, dn8.dtype):
    a = fp8_ops.gated_quantized(rows[0], gu8, d.group_sizes, rows[1], gu_scales,
                                layer.ACTIVATIONS[plan.activation][0], dtype=dn8.dtype,
                                backend="mosaic")
  else:
    a = layer.act(plan, _gemm(plan, rows, gu8, gu_scales, d.group_sizes, x.dtype))
  y = _gemm(plan, a, dn8, dn_scales, d.group_sizes, x.dtype)
  return layer.combine(y, d.inverse, topk_weights, plan.out_dtype)


# The widest F (d_ff) whose first GEMM runs fused with the activation and quantize. The
# fused kernel computes a's 128-column blocks with 128 x 128 tiles; the three passes run
# the first GEMM on `scaled_ragged_dot`'s 128 x 192 tiles, which gain more than the
# passes cost once the GEMM is large. On the H200 (`python -m benchmarks --moe`, layer
# forward), three passes over fused: 1.065x at F = 14336 (Mixtral-like), 1.02x +-0.05 at
# 2048 (DeepSeek-V3-like), 0.97x at 768 (Qwen3-like).
FUSED_GATE_MAX_F = 4096


def _fused_gate(plan: layer.Plan, rows8, gu8, dtype) -> bool:
  """Whether the first GEMM, the activation and the quantize of its output run as one
  kernel (`fp8.gated_quantized`): a gated activation, F at most FUSED_GATE_MAX_F, a
  Hopper GPU (the kernel's interpreter on a CPU takes seconds a call) and a backend
  other than "xla", the kernel able to run on these operands, not under Auto mesh axes
  (XLA partitions the layer there), and the fused form not turned off (Plan.fuse_gate)."""
  _, is_gated = layer.ACTIVATIONS[plan.activation]
  if (not (is_gated and plan.fuse_gate) or plan.backend == "xla" or not hw.on_gpu()
      or sharding.auto_axes() or gu8.shape[1] // 2 > FUSED_GATE_MAX_F):
    return False
  return fp8_ops.gated_kernel_reason(rows8, gu8, dtype) is None


def _fwd(plan, *args):
  return layer_fp8(plan, *args), None


def _no_gradient(*_):
  raise TypeError("moe_mlp with quantized expert weights (quantize_experts) is inference"
                  " only: it has no gradient; differentiate the bf16 form instead")


layer_fp8.defvjp(_fwd, _no_gradient)


def inference_only(fn):
  """fn, whose gradient is the TypeError of `layer_fp8`'s: for dataflows around the fp8
  inference form that would otherwise differentiate its other steps (the rows travel as
  bytes, which carry no gradient: d x would be zeros)."""
  f = jax.custom_vjp(fn)
  f.defvjp(lambda *args: (fn(*args), None), _no_gradient)
  return f


def _infer(plan: layer.Plan, x, topk_weights, w_gate_up, w_down, d: layer.Dispatch):
  """`layer_fp8` as a `layer.Form` calls it: the weights as (values, scales) pairs; x the
  rows, or their `Quantized`."""
  return layer_fp8(plan, x, topk_weights, *w_gate_up, *w_down, d)


# The inference form: rows travel between devices in fp8 (about half bf16's bytes).
INFER = layer.Form(_infer, None, None, send=send8, receive=receive8)


def _quantized_master(w, with_transposed: bool = False) -> Quantized:
  """A training-form weight quantized as stored (e4m3, 128x128 blocks), with its values
  transposed for the forward too where asked."""
  values, scales = _quantize_weight(w, jnp.float8_e4m3fn)
  return Quantized(values, scales, np.dtype(w.dtype),
                   jnp.swapaxes(values, 1, 2) if with_transposed else None)


def _prepare8(w_gate_up, w_down):
  """The training form's weights, each quantized once as stored (`Quantized`)."""
  return _quantized_master(w_gate_up), _quantized_master(w_down)


def _product(plan: layer.Plan, group_sizes, dtype):
  """rows @ w[e] per group in fp8, w a K-major quantized pair (values, scales)."""
  return lambda rows, q: _gemm(plan, rows, *q, group_sizes, dtype)


def _train_forward(plan: layer.Plan, x, topk_weights, gate_up: Quantized, down: Quantized,
                   d: layer.Dispatch):
  """(out, (h, y)): the experts' forward on x's rows quantized with the fp8 products, h
  and y in x's dtype."""
  y, h, _ = layer.experts_forward(plan, _pair_rows8(x, d, jnp.float8_e4m3fn),
                                  gate_up.pair(transposed=True), down.pair(transposed=True),
                                  d.group_sizes, _product(plan, d.group_sizes, x.dtype))
  return layer.combine(y, d.inverse, topk_weights, plan.out_dtype), (h, y)


def _train_backward(plan, x, topk_weights, gate_up: Quantized, down: Quantized, d, saved, g):
  """The gradients, the input gradients in fp8 on the forward's quantized weights; the
  weight gradients in the weights' dtypes."""
  h, y = saved
  dy, dweights = layer.combine_backward(y, topk_weights, d, g, x.dtype)
  dxs, dw_gate_up, dw_down = layer.experts_backward(
      plan, x[d.token], h, gate_up.pair(), down.pair(), d.group_sizes, dy,
      _product(plan, d.group_sizes, x.dtype),
      w_dtypes=(gate_up.dtype, down.dtype))
  dx = layer.sum_pairs(dxs, d, topk_weights.shape[1], x.dtype)
  return dx, dweights, dw_gate_up, dw_down


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def layer_fp8_train(plan: layer.Plan, x, topk_weights, w_gate_up, w_down,
                    d: layer.Dispatch):
  """out (T, D) of x (T, D) and bf16 experts, GEMMs in fp8 (module docstring)."""
  return _train_forward(plan, x, topk_weights, *_prepare8(w_gate_up, w_down), d)[0]


TRAIN = layer.Form(layer_fp8_train, _train_forward, _train_backward,
                   prepare=_prepare8).defvjp()


# ------------------------------------------------------- the training form, weights cached
# Quantizing the weights is a pass over all of them: at DeepSeek-V3-like sizes (22.5 GB of
# bf16 experts, ~256 rows each) it and the forward's transposes took 15 of the fp8 step's
# 50 ms. With gradient accumulation the weights do not change between microbatches, so
# they are quantized once per optimizer step (`quantize_experts_for_training`) and every
# microbatch's layer reads the copies; the gradients still go to the bf16 weights.

def quantize_experts_for_training(w_gate_up, w_down):
  """(gate_up, down): the bf16 master weights w_gate_up (E, D, 2F) (or (E, D, 2, F)) and
  w_down (E, F, D) quantized as `moe_mlp(precision="fp8")` quantizes them in each call
  (e4m3, 128x128 blocks, as stored), with the forward's transposed copies made here too,
  for `moe_mlp(..., precision="fp8", fp8_weights=(gate_up, down))`. Not differentiable:
  make them from the weights of the current optimizer step, outside the gradient."""
  for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
    if not hasattr(w, "ndim") or not hasattr(w, "dtype"):
      raise TypeError(f"{name} must be an array; got {type(w).__name__}")
    if np.dtype(w.dtype) not in fp8_ops.INPUT_DTYPES:
      raise TypeError(f"{name}.dtype must be float32, bfloat16 or float16; got"
                      f" {np.dtype(w.dtype)}")
    if w.ndim not in (3, 4 if name == "w_gate_up" else 3):
      raise ValueError(f"{name} must be 3-D, (E, D, 2F) / (E, F, D) (w_gate_up also"
                       f" (E, D, 2, F)); got shape {tuple(w.shape)}")
    if w.shape[1] % BLOCK or w.shape[-1] % BLOCK:
      raise ValueError(f"{name}.shape={tuple(w.shape)}: D and F must be multiples of"
                       f" {BLOCK}, the fp8 scale block")
  e, f, d = w_down.shape
  if tuple(w_gate_up.shape[:2]) != (e, d):
    raise ValueError(f"w_gate_up must be (E, D, ...) with E, D = {(e, d)} from w_down"
                     f" (E, F, D) = {tuple(w_down.shape)}; got shape {tuple(w_gate_up.shape)}")
  if w_gate_up.ndim == 4:
    w_gate_up = jnp.reshape(w_gate_up, (*w_gate_up.shape[:2], -1))

  return tuple(_quantized_master(jax.lax.stop_gradient(w), with_transposed=True)
               for w in (w_gate_up, w_down))


@dataclasses.dataclass(frozen=True)
class Master:
  """A bf16 weight and its fp8 copy made from it: the layer's GEMMs read the copy (so
  the weight's own values are not read), its gradient goes to the weight."""
  weight: jax.Array
  fp8: Quantized


jax.tree_util.register_dataclass(Master, data_fields=["weight", "fp8"], meta_fields=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def layer_fp8_cached(plan: layer.Plan, x, topk_weights, w_gate_up: Master, w_down: Master,
                     d: layer.Dispatch):
  """`layer_fp8_train` on weights quantized before the call (`Master`)."""
  return _train_forward(plan, x, topk_weights, w_gate_up.fp8, w_down.fp8, d)[0]


def _cached_backward(plan, x, topk_weights, gate_up, down, d, saved, g):
  """`_train_backward`'s gradients, each weight's on the `Master` it came in (None: the
  fp8 copies get none)."""
  dx, dweights, dw_gate_up, dw_down = _train_backward(plan, x, topk_weights, gate_up, down,
                                                      d, saved, g)
  return dx, dweights, Master(dw_gate_up, None), Master(dw_down, None)


TRAIN_CACHED = layer.Form(layer_fp8_cached, _train_forward, _cached_backward,
                          prepare=lambda gate_up, down: (gate_up.fp8, down.fp8)).defvjp()
