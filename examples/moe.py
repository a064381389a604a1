"""A Flax (linen) Mixture-of-Experts block trained four ways side by side: its grouped
GEMMs on jax.lax.ragged_dot, on pallas_gemm.ragged_dot, and the whole block as one
pallas_gemm.moe_mlp call, in bf16 and in fp8; and the same block expert-parallel in
jax.shard_map.

    python examples/moe.py                      # small config: runs on a CPU in seconds
    python examples/moe.py --full               # GPU: 8192 tokens, d 4096, 8 experts of 6144
    python examples/moe.py --out DIR            # + losses.json and loss curves (losses.png)
    python examples/moe.py --expert-parallel    # + the shard_map variant over every device

The block (top-k routing as Mixtral's): a router picks k experts per token and weights
them by a softmax over its k logits; the (token, expert) pairs are sorted by expert so
each expert's rows are consecutive, the experts' SwiGLU
``(silu(x Wg) * (x Wu)) Wd`` runs as three grouped GEMMs (`ragged_dot` with the group
sizes of the sort), and the rows are unsorted and combined with the router's weights.
The implementations (IMPLS): "lax" and "pallas_gemm" write that dataflow out here, each
with its `ragged_dot`; "moe_mlp" passes the same router's weights and experts (`route`) to
`pallas_gemm.moe_mlp`, which fuses the gate and up projections into one grouped GEMM and
gathers where this file scatters (its gradients too); "moe_mlp_fp8" is that call with
precision="fp8" (e4m3 GEMMs forward and backward from the bf16 weights, bf16 configs
only), whose loss curve is held to a band of its own around moe_mlp's (LOSS_ATOL_FP8).
The task: regress a fixed random teacher MLP (mean squared error), Adam, the same initial
parameters and data for every implementation. Prints each step time (median over the
steps, wall clock of the whole jitted step; the models step in turns) and checks that
each bf16 loss curve agrees with the first implementation's within the band of LOSS_ATOL
and LOSS_RTOL, and the fp8 curve with moe_mlp's within LOSS_ATOL_FP8 and LOSS_RTOL_FP8.

Expert parallelism (`moe_expert_parallel`): tokens and experts split over one mesh axis
of D devices. Each device routes its tokens, sends every other device the rows for its
experts (one all-to-all of padded per-destination chunks), computes the chunks it
received with its E / D experts: `ragged_dot(..., group_offset=first local expert)` over
the senders' global expert counts, vmapped over the D chunks, and sends the results back
(a second all-to-all) to be unsorted and combined where the tokens live. jax 0.11.2's
`jax.lax.ragged_dot` implements no `group_offset`, so its variant in the same layout
passes the local experts' counts instead. The library does the same for you:
`moe_mlp(..., expert_axis="expert")` (`moe_layer` with expert_axis) exchanges the rows into
a receive buffer already sorted by local expert and runs no vmap (docs/moe.md, "Expert
parallelism").
`--expert-parallel` checks the block's loss and gradients against one device's (the
hand-written variant) and times four training steps in turns: expert-parallel with each
grouped GEMM written here and with moe_mlp's own, and the same global batch on one device.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_gemm

try:  # the `flax` extra: pip install '.[flax]' (Flax brings optax)
  import flax.linen as nn
  import optax
except ModuleNotFoundError as e:
  sys.exit(f"{e}: this example needs Flax and optax: pip install '.[flax]'")

# (d_model and hidden multiples of 128: the fp8 form's scale blocks)
SMALL = dict(tokens=256, d_model=128, hidden=128, experts=8, top_k=2, steps=20,
             dtype="bfloat16")
FULL = dict(tokens=8192, d_model=4096, hidden=6144, experts=8, top_k=2, steps=20,
            dtype="bfloat16")
# Loss curves agree when at every step |loss - first impl's| <= LOSS_ATOL * (its first
# loss) + LOSS_RTOL * (its loss at that step), numpy.allclose's form. The grouped GEMMs are
# the same math accumulated in f32 in another order, bf16 rounds every activation (2^-9),
# and a rounding can move a token whose two best experts tie; the gaps that follow are
# absolute noise on a loss that falls ~50x in 20 steps (--full), so a band relative to
# each step's loss alone closes on them: an H200 measured 2.02e-2 of a late step's loss,
# an H100 1.4e-2, whose largest gap was 3.3e-4 of the first loss (13% of this band).
# LOSS_RTOL alone also bounds the expert-parallel check's one-step loss and gradients.
LOSS_ATOL = {"float32": 1e-5, "bfloat16": 2e-3}
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}
# moe_mlp_fp8 against moe_mlp, as examples/fp8_mlp.py holds its fp8 curves to bf16's:
# e4m3 keeps 4 significant bits (~3.6% rms on a GEMM's output against bf16's 0.4%), a
# floor under the loss the regression reaches, so an absolute part of the first loss,
# and a relative part where the curves move fast.
LOSS_ATOL_FP8 = 1e-2
LOSS_RTOL_FP8 = 2e-2
# The first is the one the others are compared with (moe_mlp_fp8: with moe_mlp).
IMPLS = ("lax", "pallas_gemm", "moe_mlp", "moe_mlp_fp8")
FP8 = "moe_mlp_fp8"


def ragged_fn(impl: str, backend: str = "auto"):
  """The grouped GEMM of `impl`: (lhs (M, K), rhs (G, K, N), group_sizes) -> (M, N)."""
  if impl == "lax":
    return jax.lax.ragged_dot
  return functools.partial(pallas_gemm.ragged_dot, backend=backend)


# ----------------------------------------------------------------------------- the block


def route(x, router, top_k: int):
  """(weights (T, k) f32, experts (T, k) int32): the k largest router logits per token,
  softmax over those k."""
  logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
  top, experts = jax.lax.top_k(logits, top_k)
  return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)


def sort_by_expert(x, experts, num_experts: int):
  """(order, rows, group_sizes): the T * k (token, expert) pairs sorted by expert (stable),
  their tokens' rows of x, and the rows per expert."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  rows = x[order // experts.shape[1]]
  return order, rows, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def swiglu_experts(rows, w_gate, w_up, w_down, group_sizes, ragged, **kwargs):
  """Each expert's SwiGLU on its rows: three grouped GEMMs."""
  gate = ragged(rows, w_gate, group_sizes, **kwargs)
  up = ragged(rows, w_up, group_sizes, **kwargs)
  hidden = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(rows.dtype)
  return ragged(hidden, w_down, group_sizes, **kwargs)


def unsort_and_combine(out_rows, order, weights):
  """Rows back in (token, k) order, summed over k with the router's weights."""
  t, k = weights.shape
  unsorted = jnp.zeros_like(out_rows).at[order].set(out_rows).reshape(t, k, -1)
  return jnp.einsum("tkd,tk->td", unsorted.astype(jnp.float32), weights).astype(out_rows.dtype)


def moe(params, x, *, top_k: int, ragged):
  """The block on one device: x (T, d) -> (T, d)."""
  num_experts = params["w_gate"].shape[0]
  weights, experts = route(x, params["router"], top_k)
  order, rows, sizes = sort_by_expert(x, experts, num_experts)
  out = swiglu_experts(rows, params["w_gate"].astype(x.dtype), params["w_up"].astype(x.dtype),
                       params["w_down"].astype(x.dtype), sizes, ragged)
  return unsort_and_combine(out, order, weights)


def moe_layer(params, x, *, top_k: int, backend: str = "auto", expert_axis=None,
              precision=None):
  """`moe` as one `pallas_gemm.moe_mlp` call on `route`'s weights and experts; the layer
  takes the gate and up projections side by side, (E, d, 2 * hidden). With expert_axis,
  moe_mlp's own expert parallelism over that mesh axis; precision as moe_mlp takes it."""
  weights, experts = route(x, params["router"], top_k)
  w_gate_up = jnp.concatenate([params["w_gate"], params["w_up"]], axis=-1).astype(x.dtype)
  return pallas_gemm.moe_mlp(x, weights, experts, w_gate_up, params["w_down"].astype(x.dtype),
                             backend=backend, expert_axis=expert_axis, precision=precision)


class MoE(nn.Module):
  """The block's parameters as a Flax module; `impl` (one of IMPLS) picks the grouped GEMM,
  or the whole layer ("moe_mlp", "moe_mlp_fp8")."""

  experts: int
  hidden: int
  top_k: int
  dtype: jnp.dtype
  impl: str = "pallas_gemm"
  backend: str = "auto"

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    params = dict(
        router=self.param("router", nn.initializers.lecun_normal(), (d, self.experts)),
        w_gate=self.param("w_gate", init, (self.experts, d, self.hidden)),
        w_up=self.param("w_up", init, (self.experts, d, self.hidden)),
        w_down=self.param("w_down", init, (self.experts, self.hidden, d)))
    if self.impl in ("moe_mlp", FP8):
      return moe_layer(params, x.astype(self.dtype), top_k=self.top_k, backend=self.backend,
                       precision="fp8" if self.impl == FP8 else None)
    return moe(params, x.astype(self.dtype), top_k=self.top_k,
               ragged=ragged_fn(self.impl, self.backend))


# ----------------------------------------------------------------------------- expert parallel


def moe_expert_parallel(params, x, *, top_k: int, mesh, axis: str, impl: str = "pallas_gemm",
                        backend: str = "auto"):
  """`moe` with tokens (x's rows) and experts (the weights' first axis) split over `axis`."""
  d_count = mesh.shape[axis]
  num_experts = params["w_gate"].shape[0]
  if num_experts % d_count or x.shape[0] % d_count:
    raise ValueError(f"experts ({num_experts}) and tokens ({x.shape[0]}) must divide over "
                     f"the {d_count} devices of mesh axis {axis!r}")
  local_experts = num_experts // d_count
  ragged = ragged_fn(impl, backend)

  def shard(router, w_gate, w_up, w_down, x):
    weights, experts = route(x, router, top_k)
    order, rows, sizes = sort_by_expert(x, experts, num_experts)
    capacity = rows.shape[0]  # no token dropped: one device may receive every row
    # Rows for device j: the sorted rows of its experts [j * E_l, (j + 1) * E_l).
    per_device = sizes.reshape(d_count, local_experts).sum(axis=1)
    starts = jnp.cumsum(per_device) - per_device
    slot = jnp.arange(capacity)
    index = starts[:, None] + slot[None, :]                                # (D, C)
    valid = slot[None, :] < per_device[:, None]
    send = jnp.where(valid[..., None], rows[jnp.clip(index, 0, capacity - 1)], 0)
    received = jax.lax.all_to_all(send, axis, 0, 0)                         # (D, C, d)
    # Each sender's chunk holds rows of this device's experts only: its global expert
    # counts with the other experts' set to 0, so the local groups start at row 0.
    offset = jax.lax.axis_index(axis).astype(jnp.int32) * local_experts
    mine = (jnp.arange(num_experts) >= offset) & (jnp.arange(num_experts) < offset + local_experts)
    counts = jnp.where(mine, jax.lax.all_gather(sizes, axis), 0)            # (D, E)
    if impl == "lax":  # the local experts' counts: lax has no group_offset
      counts = jax.lax.dynamic_slice_in_dim(counts, offset, local_experts, axis=1)
    local = {} if impl == "lax" else dict(group_offset=offset)
    ffn = lambda chunk, chunk_sizes: swiglu_experts(  # noqa: E731
        chunk, w_gate.astype(x.dtype), w_up.astype(x.dtype), w_down.astype(x.dtype),
        chunk_sizes, ragged, **local)
    if impl == "lax":  # lax's ragged_dot has no vmap rule for batched group sizes
      out = jnp.stack([ffn(received[j], counts[j]) for j in range(d_count)])
    else:
      out = jax.vmap(ffn)(received, counts)                                 # (D, C, d)
    back = jax.lax.all_to_all(out, axis, 0, 0)                              # (D, C, d)
    # Row r of the sorted order came back from its expert's device, at r - starts[device].
    owner = jnp.repeat(jnp.arange(d_count), per_device, total_repeat_length=capacity)
    out_rows = back[owner, slot - starts[owner]]
    return unsort_and_combine(out_rows, order, weights)

  run = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(axis), P(axis), P(axis), P(axis)),
                      out_specs=P(axis))
  return run(params["router"], params["w_gate"], params["w_up"], params["w_down"], x)


# ----------------------------------------------------------------------------- training


def problem(cfg: dict, seed: int = 0):
  """(x, y, params): Gaussian tokens, a random teacher MLP's outputs, the block's init."""
  dtype = jnp.dtype(cfg["dtype"])
  kx, kt, kp = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (cfg["tokens"], cfg["d_model"]), jnp.float32)
  teacher = nn.Sequential([nn.Dense(cfg["hidden"]), nn.gelu, nn.Dense(cfg["d_model"])])
  y = teacher.apply(teacher.init(kt, x), x)
  block = MoE(cfg["experts"], cfg["hidden"], cfg["top_k"], dtype)
  return x.astype(dtype), y.astype(dtype), block.init(kp, x.astype(dtype))


def trainer(impl: str, cfg: dict, backend: str = "auto", seed: int = 0, mesh=None,
            axis: str = "expert"):
  """A function that runs the next training step of `impl` and returns (loss, step ms).
  With a mesh: the expert-parallel block, parameters and tokens placed as it splits them."""
  x, y, params = problem(cfg, seed)
  if mesh is None:
    forward = MoE(cfg["experts"], cfg["hidden"], cfg["top_k"], jnp.dtype(cfg["dtype"]), impl,
                  backend).apply
  elif impl == "moe_mlp":  # the library's expert parallelism, the axis named
    forward = lambda v, x: moe_layer(  # noqa: E731
        v["params"], x, top_k=cfg["top_k"], backend=backend, expert_axis=axis)
  else:
    forward = lambda v, x: moe_expert_parallel(  # noqa: E731
        v["params"], x, top_k=cfg["top_k"], mesh=mesh, axis=axis, impl=impl, backend=backend)
    split = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
    params = jax.device_put(params, {"params": {
        name: split(P() if name == "router" else P(axis)) for name in params["params"]}})
    x, y = (jax.device_put(v, split(P(axis))) for v in (x, y))
  opt = optax.adam(1e-3)
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    def loss_fn(p):
      out = forward(p, x).astype(jnp.float32)
      return jnp.mean((out - y.astype(jnp.float32)) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  carry = [params, state]

  def next_step():
    start = time.perf_counter()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      carry[0], carry[1], loss = step(*carry)
    loss = float(loss)  # waits for the step
    return loss, (time.perf_counter() - start) * 1e3

  return next_step


def expert_mesh(axis: str = "expert"):
  """Every device on one mesh axis."""
  return jax.make_mesh((len(jax.devices()),), (axis,),
                       axis_types=(jax.sharding.AxisType.Auto,))


def expert_parallel_check(cfg: dict, axis: str = "expert", impl: str = "pallas_gemm") -> float:
  """The largest relative difference between the expert-parallel block's loss and
  gradients (its grouped GEMM: `impl`'s; "moe_mlp": the library's expert-parallel layer)
  and the one-device block's (same parameters and data, pallas_gemm's grouped GEMM)."""
  mesh = expert_mesh(axis)
  x, y, variables = problem(cfg)
  params = variables["params"]

  def loss(p, forward):
    return jnp.mean((forward(p, x).astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

  one = functools.partial(moe, top_k=cfg["top_k"], ragged=ragged_fn("pallas_gemm"))
  if impl == "moe_mlp":  # the library's expert parallelism, over the mesh in context
    ep = functools.partial(moe_layer, top_k=cfg["top_k"], expert_axis=axis)
  else:
    ep = functools.partial(moe_expert_parallel, top_k=cfg["top_k"], mesh=mesh, axis=axis,
                           impl=impl)
  ref = jax.jit(jax.value_and_grad(functools.partial(loss, forward=one)))(params)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(functools.partial(loss, forward=ep)))(params)
  diffs = [float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32))
                 / jnp.maximum(jnp.linalg.norm(b.astype(jnp.float32)), 1e-30))
           for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))]
  return max(diffs)


def expert_parallel_timing(cfg: dict, backend: str = "auto") -> dict:
  """Median step ms of the block expert-parallel over every device (written here with each
  grouped GEMM, and moe_mlp's own), and of the same global batch on one device; the four
  step in turns."""
  mesh = expert_mesh()
  runs = in_turns({
      "one device, pallas_gemm": trainer("pallas_gemm", cfg, backend),
      "expert parallel, pallas_gemm": trainer("pallas_gemm", cfg, backend, mesh=mesh),
      "expert parallel, moe_mlp": trainer("moe_mlp", cfg, backend, mesh=mesh),
      "expert parallel, lax": trainer("lax", cfg, backend, mesh=mesh)}, cfg["steps"])
  return {name: step_ms(run) for name, run in runs.items()}


def in_turns(trainers: dict, steps: int) -> dict:
  """{name: [(loss, ms)] * (steps + 1)}: the trainers take their steps in turns, so a drift
  of the GPU's clock reaches all alike."""
  runs = {name: [] for name in trainers}
  for _ in range(steps + 1):
    for name, next_step in trainers.items():
      runs[name].append(next_step())
  return runs


def step_ms(run) -> float:
  """The median step time of a run; step 0 compiles and is not timed."""
  return statistics.median(ms for _, ms in run[1:])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--full", action="store_true", help="the GPU config (8192 tokens, d 4096)")
  p.add_argument("--steps", type=int)
  p.add_argument("--backend", default="auto",
                 help="pallas_gemm's grouped-GEMM backend (ragged_dot's and moe_mlp's)")
  p.add_argument("--expert-parallel", action="store_true",
                 help="also check and time the shard_map variant over every device")
  p.add_argument("--out", type=pathlib.Path)
  args = p.parse_args(argv)
  cfg = dict(FULL if args.full else SMALL)
  if args.steps:
    cfg["steps"] = args.steps
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, config {cfg}",
        flush=True)
  # The fp8 form trains from bf16 weights and activations: a float32 config leaves it out.
  impls = tuple(i for i in IMPLS if i != FP8 or cfg["dtype"] == "bfloat16")
  runs = in_turns({impl: trainer(impl, cfg, args.backend) for impl in impls}, cfg["steps"])
  first = impls[0]
  results = {}
  for impl in impls:
    losses = [loss for loss, _ in runs[impl]]
    ms = step_ms(runs[impl])
    results[impl] = dict(losses=losses, step_ms=ms)
    base = results[first]["step_ms"]
    print(f"{impl:12s} {ms:10.3f} ms/step  {base / ms:6.3f}x {first}  "
          f"loss {losses[0]:.5f} -> {losses[-1]:.5f}", flush=True)
  if FP8 in results:
    print(f"{FP8} is {results['moe_mlp']['step_ms'] / results[FP8]['step_ms']:.3f}x moe_mlp",
          flush=True)
  agree = True
  for impl in impls[1:]:
    ref = "moe_mlp" if impl == FP8 else first
    atol, rtol = ((LOSS_ATOL_FP8, LOSS_RTOL_FP8) if impl == FP8
                  else (LOSS_ATOL[cfg["dtype"]], LOSS_RTOL[cfg["dtype"]]))
    base_losses = np.array(results[ref]["losses"])
    band = atol * base_losses[0] + rtol * base_losses
    gap = np.abs(np.array(results[impl]["losses"]) - base_losses)
    used = float(np.max(gap / band))
    results[impl]["max_rel_loss_diff"] = float(np.max(gap / base_losses))
    results[impl]["band_used"] = used
    agree &= used <= 1
    print(f"{impl:12s} loss curve vs {ref}: largest gap {np.max(gap):.2e} "
          f"({np.max(gap / base_losses):.2e} of its step's loss), {used:.0%} of the band "
          f"{atol:g} x first loss + {rtol:g} x loss ({'within' if used <= 1 else 'OUTSIDE'})",
          flush=True)
  # (the implementations of the same precision)
  results["max_rel_loss_diff"] = max(results[impl]["max_rel_loss_diff"]
                                     for impl in impls[1:] if impl != FP8)
  if args.expert_parallel:
    ep_diff = expert_parallel_check(cfg)
    ep_tol = LOSS_RTOL[cfg["dtype"]]
    results["expert_parallel_max_rel_diff"] = ep_diff
    agree &= ep_diff <= ep_tol
    print(f"expert parallel over {len(jax.devices())} devices: loss and gradients within "
          f"{ep_diff:.2e} of one device's ({'within' if ep_diff <= ep_tol else 'OUTSIDE'} "
          f"{ep_tol:g})", flush=True)
    timing = expert_parallel_timing(cfg, args.backend)
    results["expert_parallel_step_ms"] = timing
    ep = timing["expert parallel, pallas_gemm"]
    for name, ms in timing.items():
      print(f"{name:30s} {ms:10.3f} ms/step  expert-parallel pallas_gemm is {ms / ep:6.3f}x "
            f"faster", flush=True)
  if args.out is not None:
    _write(args.out, cfg, results)
  return 0 if agree else 1


def _write(out: pathlib.Path, cfg: dict, results: dict):
  out.mkdir(parents=True, exist_ok=True)
  (out / "losses.json").write_text(json.dumps(
      dict(device=jax.devices()[0].device_kind, jax=jax.__version__, config=cfg,
           results=results), indent=1))
  try:
    import matplotlib  # noqa: PLC0415 - optional (the bench extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  for impl, style in zip(IMPLS, ("-", "--", ":", "-.")):
    if impl not in results:
      continue
    r = results[impl]
    ax.plot(r["losses"], style, label=f"{impl} ({r['step_ms']:.2f} ms/step)")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("MSE loss")
  ax.set_title(f"Flax MoE, {cfg['dtype']}, {cfg['tokens']} tokens, {cfg['experts']} experts")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / "losses.png", dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
