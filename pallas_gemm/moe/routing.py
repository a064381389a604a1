"""Routers: a token's k experts and their weights from router logits, as the models that
use `moe_mlp` compute them, and the auxiliary load-balancing loss.

    weights, ids = softmax_topk(logits, k)                      # Mixtral, Qwen3-MoE
    weights, ids = sigmoid_topk(logits, k, bias=b, scale=2.5)   # DeepSeek-V3
    aux = load_balancing_loss(logits, ids)                      # Switch / Mixtral's loss

All take logits (..., E) and return float32 weights (..., k) and int32 ids (..., k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _check(logits, k: int):
  if not hasattr(logits, "shape") or logits.ndim < 1:
    raise ValueError(f"logits must be an array (..., E); got {getattr(logits, 'shape', logits)!r}")
  if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= logits.shape[-1]:
    raise ValueError(f"k must be an int in [1, E = {logits.shape[-1]}]; got {k!r}")


def softmax_topk(logits, k: int, *, renormalize: bool = True):
  """The k largest softmax(logits) probabilities per token and their experts.

  renormalize=True (Mixtral; Qwen3-MoE's norm_topk_prob): the k weights sum to 1, the
  same as a softmax over the k largest logits. False: the probabilities as they are
  (Qwen2-MoE, Switch)."""
  _check(logits, k)
  probs = jax.nn.softmax(logits.astype(F32), axis=-1)
  weights, ids = jax.lax.top_k(probs, k)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, ids.astype(jnp.int32)


def sigmoid_topk(logits, k: int, *, bias=None, scale: float = 1.0, num_groups: int = 1,
                 topk_groups: int = 1):
  """DeepSeek-V3's router: scores s = sigmoid(logits); experts chosen by the k largest
  s + bias (bias (E,): the auxiliary-loss-free balancing term, which steers the choice
  but never a weight); weights = the chosen s, normalised to sum to 1, times scale
  (routed_scaling_factor, 2.5 in DeepSeek-V3).

  num_groups > 1 limits each token to the experts of its topk_groups best groups (E split
  into num_groups consecutive groups, a group scored by the sum of its two best s + bias),
  as DeepSeek-V3 does with 8 groups and 4 of them per token."""
  _check(logits, k)
  e = logits.shape[-1]
  scores = jax.nn.sigmoid(logits.astype(F32))
  choice = scores if bias is None else scores + jnp.asarray(bias, F32)
  if num_groups > 1:
    if e % num_groups or not 1 <= topk_groups <= num_groups:
      raise ValueError(f"num_groups={num_groups} must divide E={e} and topk_groups="
                       f"{topk_groups} be in [1, num_groups]")
    grouped = choice.reshape(*choice.shape[:-1], num_groups, e // num_groups)
    group_score = jnp.sum(jax.lax.top_k(grouped, min(2, e // num_groups))[0], axis=-1)
    _, best = jax.lax.top_k(group_score, topk_groups)
    keep = jnp.any(best[..., :, None] == jnp.arange(num_groups), axis=-2)
    choice = jnp.where(jnp.repeat(keep, e // num_groups, axis=-1), choice, -jnp.inf)
  _, ids = jax.lax.top_k(choice, k)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  weights = weights / jnp.sum(weights, axis=-1, keepdims=True) * scale
  return weights, ids.astype(jnp.int32)


def load_balancing_loss(logits, topk_ids):
  """Switch Transformer's auxiliary loss, as Mixtral trains with it: E * sum_e f_e * P_e,
  f_e the fraction of (token, slot) pairs routed to expert e, P_e the mean router
  probability of e over the tokens. 1 when the routing is uniform; differentiable in
  logits (through P; f counts)."""
  e = logits.shape[-1]
  probs = jax.nn.softmax(logits.astype(F32), axis=-1).reshape(-1, e)
  ids = jnp.reshape(topk_ids, (-1,))
  counts = jnp.zeros((e,), F32).at[ids].add(1.0, mode="drop")
  fraction = counts / jnp.maximum(ids.shape[0], 1)
  return e * jnp.sum(fraction * jnp.mean(probs, axis=0))
