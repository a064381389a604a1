"""The dataflow of `moe_mlp` and its gradients, written so that no step scatters.

Forward, for T tokens with k experts each (R = T * k rows, one per (token, slot) pair):
  1. dispatch: the pairs sorted by expert (stable), so each expert's rows are consecutive:
     `order` (R,) pair of each sorted row, `token` = order // k, `inverse` (R,) the
     sorted row of each pair, `group_sizes` (E,). Ids outside [0, E) sort last, past
     sum(group_sizes): the grouped GEMMs write zeros there and read nothing there.
  2. xs = x[token] (R, D): a gather.
  3. h = ragged_dot(xs, w_gate_up) (R, 2F), a = act(gate) * up (R, F): for the gated
     activations on the Mosaic backend one kernel (`grouped.gated`), whose epilogue
     computes a from the f32 products and writes h only for a backward pass; elsewhere
     the grouped GEMM and one elementwise fusion.
  4. y = ragged_dot(a, w_down) (R, D).
  5. out[t] = sum_j topk_weights[t, j] * y[inverse[t, j]]: a gather and a k-term sum in
     f32 (one fusion), never a scatter-add into out.
Backward, from g = d out (T, D), as gathers too:
  d topk_weights[t, j] = <y[inverse[t, j]], g[t]>;
  dy[r] = topk_weights[order[r]] * g[token[r]] (a gather);
  da = dy @ w_down[e]^T and dh = act'(gate) etc. (one fusion); dxs = dh @ w_gate_up[e]^T;
  the weight gradients on the ragged-contraction kernel: a^T dy and xs^T dh per expert;
  dx[t] = sum_j dxs[inverse[t, j]] (a gather and a k-term sum; autodiff of step 2 would
  scatter-add R rows into T).
The residuals are h and y (bf16, R x 2F and R x D), a (R x F) where the gated kernel made
it, and the dispatch's int32 vectors; xs is recomputed (a gather), and a elsewhere (an
elementwise pass), never stored.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_gemm.core import epilogue, sharding
from pallas_gemm.grouped import gated_mosaic_reason, gated_ragged_dot, ragged_dot_general
from pallas_gemm.mgpu import hw

F32 = jnp.float32

# (the elementwise function, whether w_gate_up holds [gate | up] of width 2F)
ACTIVATIONS = {"swiglu": ("silu", True), "geglu": ("gelu", True), "silu": ("silu", False),
               "gelu": ("gelu", False)}

# The three grouped-GEMM forms (lhs (R, K) ragged along R), as jax.lax.ragged_dot_general
# and pallas_gemm.ragged_dot_general take them.
_FORWARD = jax.lax.RaggedDotDimensionNumbers(  # rhs (E, K, N) -> (R, N)
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
_BACKWARD = jax.lax.RaggedDotDimensionNumbers(  # rhs (E, N, K), contracted on K -> (R, N)
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
_WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(  # lhs (R, K), rhs (R, N) -> (E, K, N)
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one call computes, static under jit."""
  activation: str
  precision: Any
  out_dtype: Any
  backend: str
  config: Any = None
  # False: step 3 as the grouped GEMM and an elementwise pass even where the gated
  # kernel could run (the two-pass form, to measure one against the other).
  fuse_gate: bool = True


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """The pairs sorted by expert (module docstring, step 1); int32 arrays."""
  order: jax.Array        # (R,) the pair of each sorted row (pair p = token * k + slot)
  token: jax.Array        # (R,) the token of each sorted row
  inverse: jax.Array      # (R,) the sorted row of each pair
  group_sizes: jax.Array  # (E,) rows per expert


jax.tree_util.register_dataclass(Dispatch, data_fields=["order", "token", "inverse",
                                                        "group_sizes"], meta_fields=[])


# Up to this many pairs the dispatch counts instead of sorting (`dispatch`). On the H200,
# the dispatch alone over 128 experts: 6-14 us of kernels counting 512-4096 pairs, against
# 10-37 us sorting them.
RANKED_MAX_PAIRS = 4096


def dispatch(topk_ids, num_experts: int) -> Dispatch:
  """The stable sort of step 1. An id outside [0, E) gets key E: it sorts after every
  expert's rows and is in no group (the pair contributes nothing and gets no gradient).
  Up to RANKED_MAX_PAIRS pairs (a decode step's), each pair's sorted row is counted
  rather than sorted: R x R comparisons in a few fused reductions, where a sort and the
  scatters that invert it and count the groups are several kernels of their own (the
  same Dispatch either way)."""
  t, k = topk_ids.shape
  flat = topk_ids.reshape(t * k).astype(jnp.int32)
  key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
  if t * k <= RANKED_MAX_PAIRS:
    return _ranked(key, k, num_experts)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  # The permutation's inverse: a scatter of R int32s (not of R rows of activations).
  inverse = jnp.zeros((t * k,), jnp.int32).at[order].set(
      jnp.arange(t * k, dtype=jnp.int32), unique_indices=True)
  group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return Dispatch(order=order, token=order // k, inverse=inverse, group_sizes=group_sizes)


def _ranked(key, k: int, num_experts: int) -> Dispatch:
  """`dispatch` by counting: pair p's sorted row is the number of pairs with a smaller
  key, or the same key and a smaller index (the stable sort's position)."""
  pairs = jnp.arange(key.shape[0], dtype=jnp.int32)
  ahead = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None])
                                           & (pairs[None, :] < pairs[:, None]))
  inverse = jnp.sum(ahead, axis=1, dtype=jnp.int32)
  order = jnp.sum(jnp.where(inverse[None, :] == pairs[:, None], pairs[None, :], 0), axis=1,
                  dtype=jnp.int32)
  experts = jnp.arange(num_experts, dtype=jnp.int32)
  group_sizes = jnp.sum(key[None, :] == experts[:, None], axis=1, dtype=jnp.int32)
  return Dispatch(order=order, token=order // k, inverse=inverse, group_sizes=group_sizes)


def routed(topk_weights, topk_ids, num_experts: int):
  """topk_weights, 0 where the id is outside [0, E): such a pair routes nowhere and
  contributes nothing whatever its weight (an Inf or NaN weight times the zero row it
  reads would be NaN). Its gradient is 0 there too."""
  valid = (topk_ids >= 0) & (topk_ids < num_experts)
  return jnp.where(valid, topk_weights, jnp.zeros((), topk_weights.dtype))


def _pick(rows, inverse):
  """rows[inverse], a zero row where inverse >= len(rows): a dispatch may keep only its
  first sorted rows (order and token cut short) where every pair in a group is among
  them; the pairs past them are in no group. The plain gather where every pair has its
  row."""
  if inverse.shape[0] <= rows.shape[0]:
    return rows[inverse]
  return jnp.take(rows, inverse, axis=0, mode="fill", fill_value=0)


def _gemm(plan: Plan, lhs, rhs, group_sizes, dims, out_dtype):
  return ragged_dot_general(lhs, rhs, group_sizes, dims, plan.precision, out_dtype,
                            backend=plan.backend, config=plan.config)


def act(plan: Plan, h):
  """a = act(gate) * up (gated) or act(h), computed in f32, rounded to h's dtype."""
  name, gated = ACTIVATIONS[plan.activation]
  return epilogue.gated(h, name) if gated else epilogue.activated(h, name)


def _act_grad(plan: Plan, h, da):
  """dh from da = d a, through `_act` (f32, rounded to h's dtype)."""
  name, gated = ACTIVATIONS[plan.activation]
  hf, daf = h.astype(F32), da.astype(F32)
  if not gated:
    return (daf * epilogue.derivative(hf, name)).astype(h.dtype)
  f = h.shape[-1] // 2
  gate, up = hf[:, :f], hf[:, f:]
  dgate = daf * up * epilogue.derivative(gate, name)
  dup = daf * epilogue.activate(gate, name)
  return jnp.concatenate([dgate, dup], axis=1).astype(h.dtype)


def combine(rows, inverse, weights, out_dtype):
  """out[t] = sum_j weights[t, j] * rows[inverse[t, j]] in f32 (step 5)."""
  t, k = weights.shape
  picked = _pick(rows, inverse).reshape(t, k, rows.shape[-1]).astype(F32)
  return jnp.einsum("tk,tkd->td", weights.astype(F32), picked).astype(out_dtype)


def fused_gate(plan: Plan, xs, w_gate_up) -> bool:
  """Whether step 3 runs as one gated kernel: a gated activation, and the Mosaic backend
  (asked for, or "auto" on a GPU) able to run it on these operands, and no config given
  (a Config is the plain grouped kernels'; the gated kernel holds two accumulators and
  picks its own). Not under Auto mesh axes (XLA partitions the one-device layer there:
  the grouped GEMM's rule splits more ways than the gated kernel's) nor on Explicitly
  sharded operands (a Pallas kernel takes none): there the two passes run."""
  _, is_gated = ACTIVATIONS[plan.activation]
  if not (is_gated and plan.fuse_gate) or plan.backend == "xla" or plan.config is not None:
    return False
  if gated_mosaic_reason(jnp.dtype(xs.dtype), w_gate_up.shape, plan.precision) is not None:
    return False
  if sharding.auto_axes() or sharding.explicit_reason(xs, w_gate_up) is not None:
    return False
  return plan.backend == "mosaic" or hw.on_gpu()


def experts_forward(plan: Plan, xs, w_gate_up, w_down, group_sizes, product=None,
                    write_h: bool = True):
  """(y, h, a): y = FFN(xs) row by row, each row through its group's expert (steps 3 and
  4), h and a its intermediates: on the gated kernel's path h is None unless write_h, and
  a is kept (from f32 products: a recomputation from h would differ); on the two passes'
  a is None (the backward recomputes it, the same function of h).
  product(rows, w) is rows @ w[e] per group (default: the grouped GEMM in xs's dtype;
  the fp8 training form passes its own, and xs as its quantized (values, scales))."""
  if product is None and fused_gate(plan, xs, w_gate_up):
    a, h = gated_ragged_dot(xs, w_gate_up, group_sizes,
                            activation=ACTIVATIONS[plan.activation][0], write_h=write_h,
                            precision=plan.precision, backend="mosaic")
    return _gemm(plan, a, w_down, group_sizes, _FORWARD, xs.dtype), h, a
  product = product or (lambda rows, w: _gemm(plan, rows, w, group_sizes, _FORWARD,
                                              xs.dtype))
  h = product(xs, w_gate_up)
  return product(act(plan, h), w_down), h, None


def experts_backward(plan: Plan, xs, h, w_gate_up, w_down, group_sizes, dy,
                     product_t=None, w_dtypes=None, a=None):
  """(dxs, dw_gate_up, dw_down) from dy; a, the forward's, or else recomputed from h.
  product_t(rows, w) is rows @ w[e]^T per group (default: the grouped GEMM, w read
  transposed), w being w_gate_up or w_down as given (the fp8 training form passes its
  quantized copies); the weight gradients run on the ragged-contraction kernel in
  w_dtypes (default: the weights' dtypes)."""
  product_t = product_t or (lambda rows, w: _gemm(plan, rows, w, group_sizes, _BACKWARD,
                                                  xs.dtype))
  gate_up_dtype, down_dtype = w_dtypes or (w_gate_up.dtype, w_down.dtype)
  da = product_t(dy, w_down)
  a = act(plan, h) if a is None else a
  dw_down = _gemm(plan, a, dy, group_sizes, _WEIGHT_GRAD, down_dtype)
  dh = _act_grad(plan, h, da)
  dxs = product_t(dh, w_gate_up)
  dw_gate_up = _gemm(plan, xs, dh, group_sizes, _WEIGHT_GRAD, gate_up_dtype)
  return dxs, dw_gate_up, dw_down


def sum_pairs(rows, d: Dispatch, k: int, dtype):
  """dx[t] = sum_j rows[inverse[t, j]]: the gradient of x[d.token] (a gather and a k-term
  sum, never a scatter-add of R rows into T)."""
  return combine(rows, d.inverse, jnp.ones((d.inverse.shape[0] // k, k), F32), dtype)


def combine_backward(rows, topk_weights, d: Dispatch, g, rows_dtype):
  """(d rows, d topk_weights) of `combine`, as gathers:
  d topk_weights[t, j] = <rows[inverse[t, j]], g[t]>;
  d rows[r] = topk_weights[order[r]] * g[token[r]] (rows of no group are never read)."""
  t, k = topk_weights.shape
  gf = g.astype(F32)
  picked = _pick(rows, d.inverse).reshape(t, k, rows.shape[-1]).astype(F32)
  dweights = jnp.einsum("tkd,td->tk", picked, gf).astype(topk_weights.dtype)
  drows = topk_weights.reshape(t * k)[d.order].astype(F32)[:, None] * gf[d.token]
  return drows.astype(rows_dtype), dweights


def _forward(plan: Plan, x, topk_weights, w_gate_up, w_down, d: Dispatch, write_h=True):
  y, h, a = experts_forward(plan, x[d.token], w_gate_up, w_down, d.group_sizes,
                            write_h=write_h)
  return combine(y, d.inverse, topk_weights, plan.out_dtype), (h, a, y)


def _backward(plan: Plan, x, topk_weights, w_gate_up, w_down, d: Dispatch, saved, g):
  h, a, y = saved
  dy, dweights = combine_backward(y, topk_weights, d, g, x.dtype)
  dxs, dw_gate_up, dw_down = experts_backward(plan, x[d.token], h, w_gate_up, w_down,
                                               d.group_sizes, dy, a=a)
  dx = sum_pairs(dxs, d, topk_weights.shape[1], x.dtype)
  return dx, dweights, dw_gate_up, dw_down


@dataclasses.dataclass(frozen=True)
class Form:
  """A one-device layer and its two halves, for dataflows that pick between dispatches
  at run time and keep the residuals themselves (`parallel.py`):
    call(plan, x, topk_weights, w_gate_up, w_down, d) -> out, differentiable;
    prepare(w_gate_up, w_down) -> what the halves read in the weights' place, made once
      per call (the fp8 form's quantized copies, with the weights' dtypes; None: the
      weights), and kept for the backward instead of the weights;
    forward(plan, x, topk_weights, gate_up, down, d) -> (out, saved), gate_up and down
      as prepared: saved, what the backward reads besides its arguments;
    backward(plan, x, topk_weights, gate_up, down, d, saved, g)
      -> (dx, d topk_weights, d w_gate_up, d w_down);
    send(x, w_gate_up) -> the (T, W) array whose rows travel to other devices in x's
    place, and receive(rows, x, w_gate_up) -> what call takes as x again (None: x's rows
    travel as they are).
  A form with no gradient (the fp8 inference form) has forward and backward None."""
  call: Any
  forward: Any
  backward: Any
  prepare: Any = None
  send: Any = None
  receive: Any = None

  def prepared(self, w_gate_up, w_down):
    """(gate_up, down): the weights as forward and backward read them."""
    return (w_gate_up, w_down) if self.prepare is None else self.prepare(w_gate_up, w_down)

  def defvjp(self):
    """Makes `call` (a custom_vjp) differentiate through forward and backward."""
    def fwd(plan, x, topk_weights, w_gate_up, w_down, d):
      gate_up, down = self.prepared(w_gate_up, w_down)
      out, saved = self.forward(plan, x, topk_weights, gate_up, down, d)
      return out, (x, topk_weights, gate_up, down, d, saved)

    def bwd(plan, residuals, g):  # the dispatch is integer: no cotangent
      return (*self.backward(plan, *residuals, g), None)

    self.call.defvjp(fwd, bwd)
    return self


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def layer(plan: Plan, x, topk_weights, w_gate_up, w_down, d: Dispatch):
  """out (T, D) of x (T, D): module docstring. Differentiable in x, topk_weights,
  w_gate_up and w_down (reverse mode)."""
  return _forward(plan, x, topk_weights, w_gate_up, w_down, d, write_h=False)[0]


LAYER = Form(layer, _forward, _backward).defvjp()


# ----------------------------------------------------------------------------- in pieces
# The layer's steps as separately differentiable pieces, for dataflows that run something
# between them (expert parallelism exchanges the rows between devices: `parallel.py`).
# Each backward is the layer's own, so no piece scatters either.

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def pair_rows(x, d: Dispatch, k: int):
  """xs = x[d.token] (step 2) for k slots per token; its gradient sums each token's k
  rows (a gather)."""
  return x[d.token]


def _pair_rows_fwd(x, d: Dispatch, k: int):
  return x[d.token], d


def _pair_rows_bwd(k: int, d: Dispatch, g):
  return sum_pairs(g, d, k, g.dtype), None


pair_rows.defvjp(_pair_rows_fwd, _pair_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def combine_pairs(rows, topk_weights, d: Dispatch, out_dtype):
  """`combine` of the sorted rows (step 5), with the layer's gather-only backward."""
  return combine(rows, d.inverse, topk_weights, out_dtype)


def _combine_pairs_fwd(rows, topk_weights, d: Dispatch, out_dtype):
  return combine(rows, d.inverse, topk_weights, out_dtype), (rows, topk_weights, d)


def _combine_pairs_bwd(out_dtype, residuals, g):
  rows, topk_weights, d = residuals
  return (*combine_backward(rows, topk_weights, d, g, rows.dtype), None)


combine_pairs.defvjp(_combine_pairs_fwd, _combine_pairs_bwd)
