"""A Flax (linen) MLP trained with stock layers and with pallas_gemm, side by side.

    python examples/flax_mlp.py                 # small config: runs on a CPU in seconds
    python examples/flax_mlp.py --full          # GPU: x 8192x4096, hidden 16384, bf16
    python examples/flax_mlp.py --out DIR       # + losses.json and loss curves (losses.png)

Five models with the same parameters and data, trained with the same Adam steps:
  stock      nn.Dense layers (XLA's dot, bias and GELU fusions);
  dot_general  the same nn.Dense layers with `dot_general=pallas_gemm.dot_general`;
  fused      `FusedDense`, which calls `pallas_gemm.dense(x, w, bias, "gelu")`: bias and
             activation in the GEMM's epilogue where the backend fuses them;
  gated      GELU moved into the second layer's input (`input_activation="gelu"`): the
             same function, with GELU's derivative in the epilogue of the backward GEMM
             that computes the hidden gradient;
  mlp        both layers as one `pallas_gemm.mlp(x, w1, b1, w2, b2, "gelu")`: the hidden
             layer's epilogue stores z and GELU(z) (cuBLASLt's GELU_AUX), so neither GELU
             nor its derivative runs as a pass of its own.
The task: regress a fixed random "teacher" MLP from Gaussian inputs (mean squared error).
Prints the step time of each model (median of the timed steps, wall clock of the whole
jitted step; the models step in turns) and checks that the loss curves agree within the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_gemm

try:  # the `flax` extra: pip install '.[flax]' (Flax brings optax)
  import flax.linen as nn
  import optax
except ModuleNotFoundError as e:
  sys.exit(f"{e}: this example needs Flax and optax: pip install '.[flax]'")

SMALL = dict(batch=256, d_in=128, hidden=512, d_out=128, steps=30, dtype="float32")
FULL = dict(batch=8192, d_in=4096, hidden=16384, d_out=4096, steps=30, dtype="bfloat16")
# Loss curves of two models agree when every step's losses are within this relative
# difference: the GEMMs are the same math, accumulated in f32 in a different order, and
# bf16 rounds every activation (half an ulp: 2^-9).
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}


class FusedDense(nn.Module):
  """nn.Dense's parameters (kernel (in, out), bias (out,)) and dtype handling, computed as
  one `pallas_gemm.dense` call with the activation fused into its epilogue."""

  features: int
  activation: str | None = None
  dtype: jnp.dtype = jnp.float32
  input_activation: str | None = None

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
    return pallas_gemm.dense(x.astype(self.dtype), kernel.astype(self.dtype),
                             bias.astype(self.dtype), self.activation,
                             input_activation=self.input_activation)


class DenseParams(nn.Module):
  """nn.Dense's parameters alone, (kernel (in, out), bias (out,)), for `pallas_gemm.mlp`."""

  features: int

  @nn.compact
  def __call__(self, d_in: int):
    return (self.param("kernel", nn.initializers.lecun_normal(), (d_in, self.features)),
            self.param("bias", nn.initializers.zeros_init(), (self.features,)))


class MLP(nn.Module):
  hidden: int
  d_out: int
  dtype: jnp.dtype
  variant: str  # "stock" | "dot_general" | "fused" | "gated" | "mlp"

  @nn.compact
  def __call__(self, x):
    if self.variant == "fused":
      h = FusedDense(self.hidden, "gelu", self.dtype, name="Dense_0")(x)
      return FusedDense(self.d_out, None, self.dtype, name="Dense_1")(h)
    if self.variant == "mlp":
      w1, b1 = DenseParams(self.hidden, name="Dense_0")(x.shape[-1])
      w2, b2 = DenseParams(self.d_out, name="Dense_1")(self.hidden)
      cast = lambda *v: [t.astype(self.dtype) for t in v]  # noqa: E731
      return pallas_gemm.mlp(*cast(x, w1, b1, w2, b2), "gelu")
    if self.variant == "gated":
      z = FusedDense(self.hidden, None, self.dtype, name="Dense_0")(x)
      return FusedDense(self.d_out, None, self.dtype, "gelu", name="Dense_1")(z)
    extra = {} if self.variant == "stock" else {"dot_general": pallas_gemm.dot_general}
    h = nn.Dense(self.hidden, dtype=self.dtype, **extra)(x)
    h = nn.gelu(h, approximate=True)
    return nn.Dense(self.d_out, dtype=self.dtype, **extra)(h)


def trainer(variant: str, cfg: dict, seed: int = 0):
  """A function that runs the next training step of `variant` on `cfg` and returns
  (loss, wall-clock ms of the step)."""
  dtype = jnp.dtype(cfg["dtype"])
  kx, kt, kp = jax.random.split(jax.random.key(seed), 3)
  model = MLP(cfg["hidden"], cfg["d_out"], dtype, variant)
  teacher = MLP(cfg["hidden"], cfg["d_out"], jnp.float32, "stock")
  x = jax.random.normal(kx, (cfg["batch"], cfg["d_in"]), jnp.float32)
  y = teacher.apply(teacher.init(kt, x), x)
  x, y = x.astype(dtype), y.astype(dtype)
  # Same initial parameters for every variant (the fused layers use Dense's names/shapes).
  params = MLP(cfg["hidden"], cfg["d_out"], dtype, "stock").init(kp, x)
  opt = optax.adam(1e-3)
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    def loss_fn(p):
      out = model.apply(p, x).astype(jnp.float32)
      return jnp.mean((out - y.astype(jnp.float32)) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  carry = [params, state]

  def next_step():
    start = time.perf_counter()
    carry[0], carry[1], loss = step(*carry)
    loss = float(loss)  # waits for the step
    return loss, (time.perf_counter() - start) * 1e3

  return next_step


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--full", action="store_true", help="the GPU config (x 8192x4096, bf16)")
  p.add_argument("--steps", type=int)
  p.add_argument("--out", type=pathlib.Path)
  args = p.parse_args(argv)
  cfg = dict(FULL if args.full else SMALL)
  if args.steps:
    cfg["steps"] = args.steps
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, config {cfg}", flush=True)
  variants = ("stock", "dot_general", "fused", "gated", "mlp")
  steps = {variant: trainer(variant, cfg) for variant in variants}
  # The models take their steps in turns, so a drift of the GPU's clock during the run
  # reaches all of them alike; step 0 compiles and is not timed.
  runs = {variant: [] for variant in variants}
  for i in range(cfg["steps"] + 1):
    for variant in variants:
      runs[variant].append(steps[variant]())
  results = {}
  for variant in variants:
    losses = [loss for loss, _ in runs[variant]]
    ms = statistics.median(t for _, t in runs[variant][1:])
    results[variant] = dict(losses=losses, step_ms=ms)
    base = results["stock"]["step_ms"]
    print(f"{variant:12s} {ms:9.3f} ms/step  {base / ms:5.3f}x stock  "
          f"loss {losses[0]:.5f} -> {losses[-1]:.5f}", flush=True)
  rtol = LOSS_RTOL[cfg["dtype"]]
  stock = np.array(results["stock"]["losses"])
  agree = True
  for variant in variants[1:]:
    diff = float(np.max(np.abs(np.array(results[variant]["losses"]) - stock) / stock))
    results[variant]["max_rel_loss_diff"] = diff
    agree &= diff <= rtol
    print(f"{variant:12s} loss curve vs stock: max relative difference {diff:.2e} "
          f"({'within' if diff <= rtol else 'OUTSIDE'} {rtol:g})", flush=True)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "losses.json").write_text(json.dumps(
        dict(device=jax.devices()[0].device_kind, jax=jax.__version__, config=cfg,
             results=results), indent=1))
    try:
      import matplotlib  # noqa: PLC0415 - optional (the bench extra)
      matplotlib.use("Agg")
      import matplotlib.pyplot as plt  # noqa: PLC0415
      fig, ax = plt.subplots(figsize=(6, 4))
      for variant, r in results.items():
        ax.plot(r["losses"], label=f"{variant} ({r['step_ms']:.2f} ms/step)",
                linestyle={"stock": "-", "dot_general": "--", "fused": ":", "gated": "-.",
                                   "mlp": (0, (5, 1, 1, 1))}[variant])
      ax.set_yscale("log")
      ax.set_xlabel("step")
      ax.set_ylabel("MSE loss")
      ax.set_title(f"Flax MLP, {cfg['dtype']}, batch {cfg['batch']}, hidden {cfg['hidden']}")
      ax.legend()
      fig.tight_layout()
      fig.savefig(args.out / "losses.png", dpi=110)
      plt.close(fig)
    except ImportError:
      pass
  return 0 if agree else 1


if __name__ == "__main__":
  sys.exit(main())
