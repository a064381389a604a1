"""`moe_mlp`: a Mixture-of-Experts MLP layer (dropless, top-k routed) as one call.

    out = moe_mlp(x, topk_weights, topk_ids, w_gate_up, w_down)       # SwiGLU experts

out[t] = sum_j topk_weights[t, j] * FFN_e(x[t]), e = topk_ids[t, j], where for the gated
activations ("swiglu", "geglu") FFN_e(v) = (act(v Wg[e]) * (v Wu[e])) Wd[e] with
w_gate_up[e] = [Wg[e] | Wu[e]] (gate = [..., :F], up = [..., F:]), and for "silu" /
"gelu" FFN_e(v) = act(v W1[e]) Wd[e] with w_gate_up (E, D, F).

Semantics a user can rely on:
- Dropless: every (token, slot) pair is computed; an expert that receives no token costs
  no GEMM work.
- An id outside [0, E) (e.g. -1 for a padded token) routes its pair nowhere: it adds
  nothing to out and gets no gradient, whatever its weight, NaN and Inf included (no
  product reads it), on one device and expert-parallel alike.
- The same id twice in a token's row is allowed: both pairs are computed and summed, as
  the formula says.
- topk_ids is traced (any integer dtype); so are the weights.
- Differentiable in x, topk_weights, w_gate_up and w_down in reverse mode (jax.grad,
  jax.vjp); forward mode (jax.jvp) is not implemented.
- Leading dims: x (..., D) with topk_weights / topk_ids (..., k).
- Expert parallel (`parallel.py`): with `expert_axis` (or, when w_down's type is sharded
  on E over an Explicit mesh axis, under jit or eagerly, that axis), the experts split over the
  axis and the tokens travel to them by all-to-all; no expert weight is gathered. Inside
  `jax.shard_map` over that axis, x and topk_* are the device's tokens (ids global) and
  the weights its experts; outside, x's tokens and the weights' experts are split over
  it, and the result comes back sharded on its tokens over it.
- Data parallel: when x's type splits its tokens over Explicit mesh axes (and
  the experts are not split over them), or over the axes named by `data_axes` (an Auto
  mesh's, whose types carry no sharding), each device runs the layer on its own tokens
  with every expert: no communication but the weight gradients' sum. With an expert axis
  too, the tokens split over both and the experts over the expert axis.
- Tensor parallel over F: when w_gate_up's type splits F over an Explicit mesh axis
  (given as (E, D, 2, F), gate [..., 0, :], up [..., 1, :], so that a split of F keeps
  each device's gate and up columns together; or (E, D, F) for "silu" / "gelu"), or with
  `model_axis`, each device runs every token through its F/n of each expert and the
  partial sums are added (one all-reduce, in the result's dtype). Composes with the
  expert and data axes. A split of w_down alone or of (E, D, 2F) is a storage layout:
  the weights are resharded as the layer needs them.
- fp8 training: precision="fp8" quantizes x's rows, the activations, the cotangents and
  the (bf16 master) weights in every call and runs the forward and input-gradient GEMMs
  in fp8; quantization is the identity to its gradients (`fp8.py`). With gradient
  accumulation, `fp8_weights=quantize_experts_for_training(w_gate_up, w_down)` made once
  per optimizer step lets each microbatch's layer skip that pass over the weights (one
  device, data and expert parallel; not tensor parallel).
- fp8 inference: w_gate_up and w_down given as `quantize` pairs (`quantize_experts` makes
  them from the bf16 weights) run both grouped GEMMs in fp8 with block scales, activations
  quantized in the call (`fp8.py`); that form has no gradient. Expert and data parallel
  as above (values and scales split on E alike; not tensor parallel); expert-parallel,
  the rows travel quantized (fp8 values and their scales: about half bf16's bytes).
The dataflow and why it never scatters: `layer.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.core import checks, sharding
from pallas_gemm.grouped import BACKENDS
from pallas_gemm.moe import fp8, layer, parallel

ACTIVATIONS = tuple(layer.ACTIVATIONS)


def _pair(w, name: str):
  """(values, scales) of an fp8 weight pair, checked for what `quantize_experts` makes."""
  if not isinstance(w, (tuple, list)) or len(w) != 2:
    raise TypeError(f"{name}: with fp8 experts both weights are (values, scales) pairs from"
                    f" quantize_experts; got {type(w).__name__}")
  values, scales = w
  checks.require_array(values, f"{name} values")
  checks.require_array(scales, f"{name} scales")
  if np.dtype(values.dtype) not in (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)):
    raise TypeError(f"{name} values must be float8_e4m3fn or float8_e5m2; got"
                    f" {np.dtype(values.dtype)}")
  if values.ndim == 3:
    e, n, k = values.shape
    want = (e, -(-n // fp8.BLOCK), k // fp8.BLOCK)
    if k % fp8.BLOCK or tuple(scales.shape) != want:
      raise ValueError(f"{name} scales must be 128x128 blocks {want} of values"
                       f" {tuple(values.shape)} (K a multiple of 128; quantize_experts makes"
                       f" them); got {tuple(scales.shape)}")
  return values, scales


def _cached_pair(fp8_weights, e: int, d: int, w: int, f: int, dtype):
  """fp8_weights checked for what `quantize_experts_for_training` makes of weights
  (E, D, W) and (E, F, D)."""
  if (not isinstance(fp8_weights, (tuple, list)) or len(fp8_weights) != 2
      or not all(isinstance(q, fp8.Quantized) and q.values_t is not None
                 for q in fp8_weights)):
    got = type(fp8_weights).__name__
    if isinstance(fp8_weights, (tuple, list)):
      got += " of (" + ", ".join(
          "Quantized without transposed values" if isinstance(q, fp8.Quantized)
          else type(q).__name__ for q in fp8_weights) + ")"
    raise TypeError("fp8_weights must be the pair quantize_experts_for_training(w_gate_up,"
                    f" w_down) returns (quantize_experts' pairs are the inference form's"
                    f" weights); got {got}")
  for name, q, (k, n) in (("fp8_weights[0]", fp8_weights[0], (d, w)),
                          ("fp8_weights[1]", fp8_weights[1], (f, d))):
    want = ((e, k, n), (e, k // fp8.BLOCK, n // fp8.BLOCK), (e, n, k))
    got = tuple(tuple(a.shape) for a in (q.values, q.scales, q.values_t))
    if got != want:
      raise ValueError(f"{name} (values, scales, transposed values) must have shapes {want},"
                       f" made from the layer's weights; got {got}")
    if np.dtype(q.values.dtype) != np.dtype(jnp.float8_e4m3fn):
      raise TypeError(f"{name} values must be float8_e4m3fn; got {np.dtype(q.values.dtype)}")
    if np.dtype(q.dtype) != dtype:
      raise TypeError(f"{name} was made from {np.dtype(q.dtype)} weights; the layer's are"
                      f" {dtype}")
  return tuple(fp8_weights)


def moe_mlp(x, topk_weights, topk_ids, w_gate_up, w_down, *, activation: str = "swiglu",
            precision=None, preferred_element_type=None, backend: str = "auto",
            config=None, expert_axis: str | None = None, exchange: str = "auto",
            exchange_chunks: int = 1, data_axes=None, model_axis: str | None = None,
            fp8_weights=None):
  """The MoE layer of the module docstring.

  Args:
    x: (..., D) float32, bfloat16 or float16: the tokens.
    topk_weights: (..., k) float: each token's expert weights (a router's output).
    topk_ids: (..., k) integer: each token's experts, in [0, E) (others: see above).
    w_gate_up: (E, D, 2F) for "swiglu" / "geglu", (E, D, F) for "silu" / "gelu"; x's dtype.
      For the gated activations also (E, D, 2, F), gate = [..., 0, :], up = [..., 1, :]:
      the form to split F over a mesh axis (tensor parallelism), as each device's gate
      and up columns stay together. Or, for fp8 inference, the pair `quantize_experts`
      makes: fp8 values (E, 2F or F, D) and their 128x128 block scales.
    w_down: (E, F, D), x's dtype; or its fp8 pair, values (E, D, F) and block scales.
    activation: "swiglu" (silu gate), "geglu" (tanh-approximate GELU gate), "silu", "gelu".
    precision: as jax.lax.ragged_dot takes it, for every grouped GEMM; or "fp8": the
      forward and input-gradient GEMMs in fp8 (e4m3, 128-blocks, current scaling), weight
      gradients in the weights' dtype (`fp8.py`). D and F multiples of 128.
    preferred_element_type: the result's dtype (default x's). The GEMMs accumulate in f32
      and write their intermediates in x's dtype; the weighted sum over k is f32 (split
      over devices, expert or tensor parallel: each device's partial sum is rounded to
      this dtype before they are added).
    backend: "auto", "xla" or "mosaic": the grouped GEMMs' (`ragged_dot`'s).
    config: the Mosaic grouped kernels' Config (`pallas_gemm.grouped.config.Config`),
      for every grouped GEMM of the call (the first GEMM and the gate then run as two
      passes: the gated kernel picks its own tiles); None picks per shape.
    expert_axis: a mesh axis name to run expert-parallel over (module docstring): the
      axis of an enclosing `jax.shard_map`, or of the context mesh (`jax.set_mesh`) or
      the weights' sharding. None: the axis w_down's type shards E over, if any.
    exchange: how rows travel between devices when expert-parallel: "ragged"
      (`jax.lax.ragged_all_to_all`, GPU), "padded" (a dense all_to_all, n times the
      bytes, any backend) or "auto" ("ragged" on GPUs, "padded" elsewhere: `parallel.py`).
    exchange_chunks: when expert-parallel, each device's tokens run in this many chunks,
      each exchanged and computed on its own, so that XLA can overlap one chunk's
      exchanges with another's GEMMs (`parallel.local`). 1: one chunk.
    data_axes: mesh axis names (a str or a tuple) of the mesh in context to split the
      tokens over, each device running the layer on its own with every expert (module
      docstring): for Auto meshes (`jax.set_mesh`), where XLA would otherwise partition
      the one-device layer itself and move rows. None: the Explicit axes x's type splits
      its tokens over, if any. Not inside a `jax.shard_map` over them (x is already the
      device's tokens there).
    model_axis: a mesh axis name to split F over (tensor parallelism, module docstring):
      the axis of an enclosing `jax.shard_map` (the weights given as this device's F/n:
      w_gate_up (E, D, 2, F/n) for the gated activations), or of the context mesh. None:
      the axis w_gate_up's type splits F over, if any (module docstring).
    fp8_weights: with precision="fp8", the pair `quantize_experts_for_training(w_gate_up,
      w_down)` made from these very weights (e.g. once per optimizer step, for every
      microbatch of a gradient accumulation): the GEMMs read it instead of quantizing
      the weights in the call, with the same results; the gradients still go to w_gate_up
      and w_down, none to the pair. On one device, data and expert parallel (the pair
      split as the weights are, on E), not tensor parallel. None: quantize in the call.

  Returns:
    (..., D) in preferred_element_type.
  """
  quantized = isinstance(w_gate_up, (tuple, list)) or isinstance(w_down, (tuple, list))
  if exchange not in parallel.EXCHANGES:
    raise ValueError(f"exchange must be one of {parallel.EXCHANGES}; got {exchange!r}")
  if (isinstance(exchange_chunks, bool) or not isinstance(exchange_chunks, (int, np.integer))
      or exchange_chunks < 1):
    raise ValueError(f"exchange_chunks must be an int >= 1; got {exchange_chunks!r}")
  for name, value in (("expert_axis", expert_axis), ("model_axis", model_axis)):
    if value is not None and not isinstance(value, str):
      raise TypeError(f"{name} must be a mesh axis name (str) or None; got {value!r}")
  if data_axes is not None:
    data_axes = (data_axes,) if isinstance(data_axes, str) else data_axes
    if (not isinstance(data_axes, (tuple, list))
        or not all(isinstance(a, str) for a in data_axes)):
      raise TypeError(f"data_axes must be a mesh axis name, a tuple of them, or None; got"
                      f" {data_axes!r}")
    data_axes = tuple(data_axes)
    if not data_axes:
      raise ValueError("data_axes must name at least one mesh axis, or be None (the"
                       " Explicit axes x's type splits its tokens over); got ()")
  if quantized:
    w_gate_up, gate_up_scales = _pair(w_gate_up, "w_gate_up")
    w_down, down_scales = _pair(w_down, "w_down")
  for name, a in (("x", x), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                  ("w_gate_up", w_gate_up), ("w_down", w_down)):
    checks.require_array(a, name)
  dtype = checks.dtype_of(x, "x")
  if activation not in layer.ACTIVATIONS:
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
  gated = layer.ACTIVATIONS[activation][1]
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
  if x.ndim < 1:
    raise ValueError(f"x must be (..., D); got shape {tuple(x.shape)}")
  lead, d = tuple(x.shape[:-1]), x.shape[-1]
  if topk_weights.ndim != x.ndim or tuple(topk_weights.shape[:-1]) != lead:
    raise ValueError(f"topk_weights must be (..., k) with x's leading dims {lead}; got shape"
                     f" {tuple(topk_weights.shape)}")
  if tuple(topk_ids.shape) != tuple(topk_weights.shape):
    raise ValueError(f"topk_ids must have topk_weights' shape {tuple(topk_weights.shape)}; got"
                     f" {tuple(topk_ids.shape)}")
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise TypeError(f"topk_ids.dtype must be an integer dtype; got {np.dtype(topk_ids.dtype)}")
  if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
    raise TypeError(f"topk_weights.dtype must be a float dtype; got"
                    f" {np.dtype(topk_weights.dtype)}")
  # (E, D, 2, F): gate and up on an axis of their own (the tensor-parallel form)
  pair_axis = not quantized and gated and w_gate_up.ndim == 4
  for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
    if not quantized and np.dtype(w.dtype) != dtype:
      raise TypeError(f"{name}.dtype must be x's dtype {dtype}; got {np.dtype(w.dtype)}")
    if w.ndim != 3 and not (name == "w_gate_up" and pair_axis):
      what = ("(E, D, 2F) or (E, D, 2, F)" if name == "w_gate_up" and gated and not quantized
              else "3-D (E, ...)")
      raise ValueError(f"{name} must be {what}; got shape {tuple(w.shape)}")
  # The weights' shapes as the bf16 layer holds them; the fp8 pairs hold their values
  # K-major, w_gate_up (E, W, D) and w_down (E, D, F), and are checked as these views.
  def as_bf16(shape):
    return (shape[0], shape[2], shape[1]) if quantized else tuple(shape)

  gate_up_shape, down_shape = as_bf16(w_gate_up.shape), as_bf16(w_down.shape)
  e, f = down_shape[0], down_shape[1]
  if down_shape != (e, f, d):
    raise ValueError(f"w_down must be (E, F, D) with D = x.shape[-1] = {d}; got shape"
                     f" {down_shape}")
  want = (e, d, 2, f) if pair_axis else (e, d, 2 * f if gated else f)
  if gate_up_shape != want:
    what = ("(E, D, 2, F): gate and up on their own axis" if pair_axis else
            "(E, D, 2F): gate and up side by side" if gated else "(E, D, F)")
    raise ValueError(f"w_gate_up must be {what} for activation={activation!r}, with E, F"
                     f" from w_down {down_shape} and D = {d}: expected"
                     f" {want}; got {gate_up_shape}")
  out_dtype = dtype if preferred_element_type is None else np.dtype(preferred_element_type)
  if out_dtype not in checks.SUPPORTED_DTYPES:
    raise TypeError(f"preferred_element_type must be float32, bfloat16 or float16; got"
                    f" {out_dtype}")
  fp8_training = isinstance(precision, str) and precision == "fp8"
  if fp8_training:
    if quantized:
      raise ValueError('precision="fp8" trains from bf16 master weights; quantized expert'
                       " pairs (quantize_experts) already run in fp8: drop precision")
    if d % fp8.BLOCK or f % fp8.BLOCK:
      raise ValueError(f'precision="fp8" needs D and F multiples of {fp8.BLOCK} (the scale'
                       f" blocks along every contraction); got D = {d}, F = {f}")
  if fp8_weights is not None:
    if not fp8_training:
      raise ValueError(f"fp8_weights is for precision='fp8' (training from bf16 master"
                       f" weights); got precision={precision!r}")
    fp8_weights = _cached_pair(fp8_weights, e, d, gate_up_shape[-1] * (
        2 if pair_axis else 1), f, dtype)
  k = topk_weights.shape[-1]
  tokens = math.prod(lead)
  plan = layer.Plan(activation=activation, precision=None if fp8_training else precision,
                    out_dtype=out_dtype, backend=backend, config=config)
  form = (fp8.INFER if quantized else layer.LAYER if not fp8_training
          else fp8.TRAIN if fp8_weights is None else fp8.TRAIN_CACHED)
  x2 = jnp.reshape(x, (tokens, d))
  weights2 = jnp.reshape(topk_weights, (tokens, k))
  ids2 = jnp.reshape(topk_ids, (tokens, k))
  if tokens == 0 or k == 0:
    return jnp.zeros((*lead, d), out_dtype)  # no pair: every sum is empty
  axis = expert_axis if expert_axis is not None else parallel.sharded_expert_axis(w_down)
  model = model_axis
  if model is None and not quantized and (pair_axis or not gated):
    model = parallel.sharded_model_axis(w_gate_up)
  if model is not None and model == axis:
    raise ValueError(f"model_axis and expert_axis are both {model!r}: E and F split over"
                     " different mesh axes")
  if data_axes is not None:
    data = parallel.check_data_axes(data_axes, axis, model)
  else:
    data = parallel.token_axes(x2, axis, model)
  if axis is not None or data or model is not None:
    if fp8_weights is not None and model is not None:
      raise ValueError(f"fp8_weights split over experts and tokens, not F: tensor parallelism"
                       f" over {model!r} quantizes in the call; leave fp8_weights out")
    if quantized and model is not None:
      raise ValueError(f"fp8 expert pairs (quantize_experts) split over experts and tokens,"
                       f" not F: tensor parallelism over {model!r} is not available with"
                       " them")
    if quantized:  # the (values, scales) pairs travel whole: E splits them both
      w_gate_up, w_down = (w_gate_up, gate_up_scales), (w_down, down_scales)
    elif fp8_weights is not None:  # each weight with its copies, E split alike
      w_gate_up, w_down = (fp8.Master(jnp.reshape(w_gate_up, (e, d, -1)), fp8_weights[0]),
                           fp8.Master(w_down, fp8_weights[1]))
    elif not pair_axis:
      if model is not None and gated and (
          parallel.splits_last_dim(w_gate_up)
          or model in jax.sharding.get_abstract_mesh().manual_axes):
        raise ValueError(
            f"w_gate_up as (E, D, 2F) cannot be split over {model!r}: a split of [gate |"
            " up] puts gate and up columns on different devices (and inside a shard_map a"
            " local (E, D, 2F/n) cannot be told apart from one); give it as (E, D, 2, F),"
            " w_gate_up.reshape(E, D, 2, F), split on its last dim")
      w_gate_up = jnp.reshape(w_gate_up, (e, d, 2 if gated else 1, f))
    run = functools.partial(parallel.run, plan, axis=axis, data_axes=data,
                            model_axis=model, exchange=exchange,
                            chunks=int(exchange_chunks), form=form,
                            f_multiple=fp8.BLOCK if fp8_training else 1)
    if quantized:
      run = fp8.inference_only(run)
    out = run(x2, weights2, ids2, w_gate_up, w_down)
    return out.reshape((*lead, d))
  # No axis splits tokens or experts here: an operand split over Explicit axes some other
  # way (x over D, say) runs whole, and its gradient comes back split as it was.
  x2, weights2, ids2, w_gate_up, w_down = sharding.whole(x2, weights2, ids2, w_gate_up,
                                                         w_down)
  if pair_axis:
    w_gate_up = jnp.reshape(w_gate_up, (e, d, 2 * f))
  if quantized:
    gate_up_scales, down_scales = sharding.whole(gate_up_scales, down_scales)
    w_gate_up, w_down = (w_gate_up, gate_up_scales), (w_down, down_scales)
  if fp8_weights is not None:  # the GEMMs read the copies; the gradients go to the weights
    gate_up8, down8 = jax.tree.map(lambda a: sharding.whole(a)[0], fp8_weights)
    w_gate_up, w_down = fp8.Master(w_gate_up, gate_up8), fp8.Master(w_down, down8)
  weights2 = layer.routed(weights2, ids2, e)
  d_ = layer.dispatch(ids2, e)
  # Inside a user's jax.shard_map (tokens split over an axis the weights are whole on):
  # one set of manual axes for every operand, so a weight's gradient is summed over them.
  x2, weights2, w_gate_up, w_down, d_ = sharding.same_varying(x2, weights2, w_gate_up,
                                                              w_down, d_)
  out = form.call(plan, x2, weights2, w_gate_up, w_down, d_)
  return out.reshape((*lead, d))
