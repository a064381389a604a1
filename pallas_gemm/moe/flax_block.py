"""`MoEBlock`: a Flax (linen) Mixture-of-Experts feed-forward block over `moe_mlp`.

    block = MoEBlock(num_experts=8, top_k=2, d_ff=1024)
    variables = block.init(key, x)                                  # x (..., D)
    out, state = block.apply(variables, x, mutable=["intermediates"])
    aux, = state["intermediates"]["load_balancing_loss"]            # add to the loss

A drop-in for a transformer's dense MLP: a router (a bias-free Dense with float32 logits)
picks each token's top_k experts, and `moe_mlp` runs them. The module holds the parameters
and the routing only; what the experts compute, and its gradients, is `moe_mlp`'s.

This module imports flax (the optional `flax` extra), so `pallas_gemm.moe` does not
import it: `from pallas_gemm.moe.flax_block import MoEBlock`.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from pallas_gemm.moe import api, layer
from pallas_gemm.moe.routing import load_balancing_loss, sigmoid_topk, softmax_topk

ROUTERS = ("softmax", "sigmoid")


class MoEBlock(nn.Module):
  """x (..., D) -> (..., D): each token through its top_k of num_experts experts.

  Attributes:
    num_experts: E, the number of experts.
    top_k: k, the experts per token.
    d_ff: F, each expert's hidden width.
    activation: `moe_mlp`'s ("swiglu", "geglu": gated, w_gate_up (E, D, 2F) holding the
      gate then the up projection; "silu", "gelu": w_gate_up (E, D, F)).
    router: "softmax" (`softmax_topk`: Mixtral, Qwen3-MoE) or "sigmoid" (`sigmoid_topk`:
      DeepSeek-V3's choice by sigmoid score plus a per-expert bias, below).
    dtype: the experts' computation dtype: parameters and x are cast to it, as Flax's
      layers do, and the output is in it. The router always computes in float32.
    param_dtype: the parameters' dtype.
    backend: `moe_mlp`'s grouped-GEMM backend ("auto", "xla", "mosaic").
    experts: the function that runs the experts, called as `moe_mlp` is (x, weights,
      ids, w_gate_up, w_down, activation=, backend=); None: `moe_mlp`. Another
      implementation of the same layer can be swapped in, e.g. to compare it.
    kernel_init: the initializer of every weight, called with the expert axis first
      (E, D, 2F), (E, F, D), and (1, D, E) for the router, so that a variance-scaling
      initializer with batch_axis=(0,) scales each by its own fan-in.

  Variables: params "router" {"kernel" (D, E)}, "w_gate_up", "w_down". With
  router="sigmoid", also "bias" (E,) float32 in the "router_bias" collection, zeros at
  init. It steers which experts are chosen and never a weight; DeepSeek-V3 trains it by a
  rule instead of by gradient (after each step b_e += gamma * sign(mean load - load_e)),
  so it lives outside "params": an optimizer never sees it, and AdamW's weight decay
  cannot pull it toward zero as it would a param with a stopped gradient. A training
  loop passes the collection to `apply` and updates it itself; the per-expert load it
  needs is sown beside the auxiliary loss.

  Sown into "intermediates" (kept when `apply` gets mutable=["intermediates"]):
  "load_balancing_loss", the scalar `load_balancing_loss(logits, ids)` (1 for uniform
  routing; a training loop adds it, times a small coefficient, to its loss), and for the
  sigmoid router "expert_load" (E,), the fraction of (token, slot) pairs each expert got.
  """

  num_experts: int
  top_k: int
  d_ff: int
  activation: str = "swiglu"
  router: str = "softmax"
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  backend: str = "auto"
  kernel_init: Callable = nn.initializers.lecun_normal(batch_axis=(0,))
  experts: Callable | None = None

  @nn.compact
  def __call__(self, x):
    if self.router not in ROUTERS:
      raise ValueError(f"router must be one of {ROUTERS}; got {self.router!r}")
    if self.activation not in api.ACTIVATIONS:
      raise ValueError(f"activation must be one of {api.ACTIVATIONS}; got {self.activation!r}")
    d, e, f = x.shape[-1], self.num_experts, self.d_ff
    width = 2 * f if layer.ACTIVATIONS[self.activation][1] else f

    def router_init(key, shape, dtype):
      # Drawn as one expert-batched (1, D, E) weight: one kernel_init serves the router
      # and the experts alike.
      return self.kernel_init(key, (1, *shape), dtype)[0]

    # float32 logits: a rounding of a logit can flip which experts a token gets.
    logits = nn.Dense(e, use_bias=False, dtype=jnp.float32, param_dtype=self.param_dtype,
                      kernel_init=router_init, name="router")(x)
    if self.router == "softmax":
      weights, ids = softmax_topk(logits, self.top_k)
    else:
      bias = self.variable("router_bias", "bias", jnp.zeros, (e,), jnp.float32)
      weights, ids = sigmoid_topk(logits, self.top_k, bias=bias.value)
      load = jnp.bincount(ids.reshape(-1), length=e).astype(jnp.float32) / max(ids.size, 1)
      self.sow("intermediates", "expert_load", load)
    self.sow("intermediates", "load_balancing_loss", load_balancing_loss(logits, ids))

    w_gate_up = self.param("w_gate_up", self.kernel_init, (e, d, width), self.param_dtype)
    w_down = self.param("w_down", self.kernel_init, (e, f, d), self.param_dtype)
    x, w_gate_up, w_down = nn.dtypes.promote_dtype(x, w_gate_up, w_down, dtype=self.dtype)
    experts = api.moe_mlp if self.experts is None else self.experts
    return experts(x, weights, ids, w_gate_up, w_down, activation=self.activation,
                   backend=self.backend)

