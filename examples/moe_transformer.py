"""A small Mixture-of-Experts transformer trained with `pallas_gemm.moe_mlp` and with the
same MoE block written on `pallas_gemm.ragged_dot` (MaxText-style), side by side.

    python examples/moe_transformer.py          # small config: a CPU runs it in seconds
    python examples/moe_transformer.py --full   # GPU: Qwen3-MoE-like experts (D 2048, F 768,
                                                # 128 experts, top-8), 8192 tokens a step

The model: an input projection, then `layers` blocks of pre-norm causal self-attention and
a pre-norm `MoEBlock` (router + experts, softmax top-k), each with a residual; the task is
to regress a fixed random target sequence (mean squared error) plus 0.01 x the routers'
load-balancing loss, AdamW. Both models start from the same parameters and see the same
data; they step in turns. Prints each model's step time (median wall clock of the whole
jitted step, optimizer update included) and checks that the loss curves agree within
LOSS_RTOL (bf16 rounds every activation, and a rounding can move a token whose two best
experts tie).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import pallas_gemm

try:  # the `flax` extra: pip install '.[flax]' (Flax brings optax)
  import flax.linen as nn
  import optax
  from pallas_gemm.moe.flax_block import MoEBlock
except ModuleNotFoundError as e:
  sys.exit(f"{e}: this example needs Flax and optax: pip install '.[flax]'")

SMALL = dict(batch=4, seq=32, d_model=64, d_ff=32, experts=8, top_k=2, heads=4, layers=2,
             steps=12, dtype="float32")
FULL = dict(batch=4, seq=2048, d_model=2048, d_ff=768, experts=128, top_k=8, heads=16,
            layers=2, steps=12, dtype="bfloat16")
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}
IMPLS = ("moe_mlp", "ragged_dot")


def unfused_experts(x, weights, ids, w_gate_up, w_down, *, activation, backend):
  """The experts as a MaxText-style block writes them on a grouped GEMM: argsort by
  expert, gather, ragged_dot, SwiGLU, ragged_dot, an unsorting scatter, a weighted sum."""
  assert activation == "swiglu"
  ragged = functools.partial(pallas_gemm.ragged_dot, backend=backend)
  lead, d = x.shape[:-1], x.shape[-1]
  x = x.reshape(-1, d)
  t, k = x.shape[0], ids.shape[-1]
  ids, weights = ids.reshape(t, k), weights.reshape(t, k)
  e, f = w_down.shape[0], w_down.shape[1]
  order = jnp.argsort(ids.reshape(-1))
  sizes = jnp.bincount(ids.reshape(-1), length=e).astype(jnp.int32)
  h = ragged(x[order // k], w_gate_up, sizes)
  y = ragged(jax.nn.silu(h[:, :f]) * h[:, f:], w_down, sizes)
  y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, d)
  out = jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights).astype(x.dtype)
  return out.reshape(*lead, d)


class Block(nn.Module):
  cfg: dict
  experts: object = None

  @nn.compact
  def __call__(self, x):
    cfg, dtype = self.cfg, jnp.dtype(self.cfg["dtype"])
    h = nn.RMSNorm(dtype=dtype)(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(num_heads=cfg["heads"], dtype=dtype)(h, mask=mask)
    h = nn.RMSNorm(dtype=dtype)(x)
    return x + MoEBlock(num_experts=cfg["experts"], top_k=cfg["top_k"], d_ff=cfg["d_ff"],
                        dtype=dtype, experts=self.experts)(h)


class Model(nn.Module):
  cfg: dict
  experts: object = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.cfg["d_model"], dtype=jnp.dtype(self.cfg["dtype"]))(x)
    for _ in range(self.cfg["layers"]):
      x = Block(self.cfg, self.experts)(x)
    return x


def trainer(impl: str, cfg: dict, seed: int = 0):
  """(next_step() -> loss, sync) for one implementation; same init and data for all."""
  model = Model(cfg, None if impl == "moe_mlp" else unfused_experts)
  kx, kt, kp = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (cfg["batch"], cfg["seq"], cfg["d_model"]), jnp.float32)
  target = jax.random.normal(kt, x.shape, jnp.float32)
  params = model.init(kp, x)["params"]
  opt = optax.adamw(1e-3)
  state = (params, opt.init(params))

  @jax.jit
  def step(state):
    params, opt_state = state

    def loss_fn(p):
      out, aux = model.apply({"params": p}, x, mutable=["intermediates"])
      lb = sum(jax.tree.leaves(aux["intermediates"]))
      return jnp.mean((out.astype(jnp.float32) - target) ** 2) + 0.01 * lb

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  holder = {"state": state}

  def next_step():
    holder["state"], loss = step(holder["state"])
    return loss

  return next_step


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--full", action="store_true", help="the GPU config (Qwen3-MoE-like, bf16)")
  p.add_argument("--steps", type=int)
  p.add_argument("--out", type=pathlib.Path)
  args = p.parse_args(argv)
  cfg = dict(FULL if args.full else SMALL)
  if args.steps:
    cfg["steps"] = args.steps
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, config {cfg}",
        flush=True)
  steps = {impl: trainer(impl, cfg) for impl in IMPLS}
  losses = {impl: [] for impl in IMPLS}
  times = {impl: [] for impl in IMPLS}
  for i in range(cfg["steps"]):
    for impl in (IMPLS if i % 2 == 0 else IMPLS[::-1]):  # in turns, alternating order
      start = time.perf_counter()
      loss = float(steps[impl]())  # float() waits for the step
      times[impl].append((time.perf_counter() - start) * 1e3)
      losses[impl].append(loss)
  timed = {impl: statistics.median(t[2:]) for impl, t in times.items()}  # after compiles
  base = IMPLS[1]
  for impl in IMPLS:
    # the ratio of each step pair, then its median and half its interquartile range
    ratios = [b / a for a, b in zip(times[impl][2:], times[base][2:])]
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    print(f"{impl:>10}: {timed[impl]:9.2f} ms/step ({statistics.median(ratios):.2f}x"
          f" ±{(q[2] - q[0]) / 2:.2f} {base}), loss {losses[impl][0]:.5f} ->"
          f" {losses[impl][-1]:.5f}", flush=True)
  rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses[IMPLS[0]], losses[base]))
  tol = LOSS_RTOL[cfg["dtype"]]
  ok = rel <= tol
  print(f"loss curves: max relative difference {rel:.2e} ({'within' if ok else 'OUTSIDE'}"
        f" {tol})", flush=True)
  if args.out:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_transformer.json").write_text(json.dumps(dict(
        config=cfg, device=jax.devices()[0].device_kind, jax=jax.__version__,
        ms_per_step=timed, step_ms=times, losses=losses, max_rel_loss_diff=rel), indent=1))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
