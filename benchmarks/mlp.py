"""A training step and a GEMM epilogue in real jax.jit programs: pallas_gemm vs XLA.

    python -m benchmarks --mlp [--quick] [--out DIR]

1. value_and_grad of a two-layer MLP (x 8192x4096, W1 4096x16384, W2 16384x4096, bias +
   GELU (tanh), mean squared error), bf16 and f32 HIGHEST, written several ways in the same run:
   jnp.dot + jax.nn.gelu (XLA's fusions), `dot_general` passed where a Flax layer would take
   it (no fused layers), `pallas_gemm.dense` with the fused bias + GELU (backend auto
   and xla), "gated": GELU as the second layer's `input_activation`, so its derivative
   is the epilogue of the backward GEMM for the hidden gradient, and `pallas_gemm.mlp`:
   gated, with GELU stored beside z by the hidden layer's epilogue (auto and mosaic).
2. `gemm(a, b, c, alpha=0.5, beta=2.0)` vs the jnp.dot expression `0.5 * (a @ b) + 2 * c`,
   bf16 2048^3, 4096^3, 8192^3 (`--parts epilogue` runs this part alone).

Wall clock over back-to-back jitted calls (the step's elementwise kernels count too), the
variants timed in turns (`timing.interleaved_ms`: 7 rounds of 10 calls each), median; the
loss of each variant is printed beside XLA's. (CUPTI device time of each step, taken one
variant after the other, drifted with the GPU's temperature: the same XLA kernels summed to
7.45 ms in one place and 8.16 in another. `probe.py step_kernels` lists a step's kernels.)
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp

import pallas_gemm
from pallas_gemm import dot_general
from benchmarks.timing import interleaved_ms

HIGHEST = jax.lax.Precision.HIGHEST


def variants(precision):
  def xla(params, x, y):
    h = jax.nn.gelu(jnp.dot(x, params["w1"], precision=precision) + params["b1"])
    return jnp.dot(h, params["w2"], precision=precision) + params["b2"]

  def with_dot_general(backend):
    def dot(a, b):
      return dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), precision, backend=backend)

    def f(params, x, y):
      h = jax.nn.gelu(dot(x, params["w1"]) + params["b1"])
      return dot(h, params["w2"]) + params["b2"]
    return f

  def fused(backend):
    def f(params, x, y):
      h = pallas_gemm.dense(x, params["w1"], params["b1"], "gelu", precision=precision,
                            backend=backend)
      return pallas_gemm.dense(h, params["w2"], params["b2"], precision=precision,
                               backend=backend)
    return f

  def both(backend):  # pallas_gemm.mlp: GELU stored beside z by the hidden layer's epilogue
    def f(params, x, y):
      return pallas_gemm.mlp(x, params["w1"], params["b1"], params["w2"], params["b2"], "gelu",
                             precision=precision, backend=backend)
    return f

  def gated(backend):  # GELU as the second layer's input: its derivative in a GEMM epilogue
    def f(params, x, y):
      z = pallas_gemm.dense(x, params["w1"], params["b1"], precision=precision, backend=backend)
      return pallas_gemm.dense(z, params["w2"], params["b2"], input_activation="gelu",
                               precision=precision, backend=backend)
    return f

  return {"jnp.dot (XLA)": xla, "dot_general auto": with_dot_general("auto"),
          "dense auto": fused("auto"), "dense xla": fused("xla"),
          "gated mosaic": gated("mosaic"), "mlp auto": both("auto"), "mlp mosaic": both("mosaic")}


def problem(dtype, m: int = 8192, d: int = 4096, hidden: int = 16384):
  """(params, x, y) of the MLP: W1 (d, hidden), W2 (hidden, d), x and y (m, d)."""
  keys = jax.random.split(jax.random.key(0), 6)
  params = {"w1": jax.random.normal(keys[0], (d, hidden), dtype) / d**0.5,
            "b1": jax.random.normal(keys[1], (hidden,), dtype) * 0.1,
            "w2": jax.random.normal(keys[2], (hidden, d), dtype) / hidden**0.5,
            "b2": jax.random.normal(keys[3], (d,), dtype) * 0.1}
  x = jax.random.normal(keys[4], (m, d), dtype)
  y = jax.random.normal(keys[5], (m, d), dtype)
  return params, x, y


def loss_of(forward):
  """The mean squared error of forward(params, x, y) against y, in f32."""
  return lambda p, x, y: jnp.mean((forward(p, x, y).astype(jnp.float32)
                                   - y.astype(jnp.float32)) ** 2)


def mlp(quick: bool) -> list[dict]:
  rows = []
  m, d, hidden = (256, 128, 512) if quick else (8192, 4096, 16384)
  for dtype, precision, label in ((jnp.bfloat16, None, "bf16"), (jnp.float32, HIGHEST, "f32-highest")):
    params, x, y = problem(dtype, m, d, hidden)
    steps = {}
    for name, forward in variants(precision).items():
      if "mosaic" in name and (dtype == jnp.float32 or jax.default_backend() != "gpu"):
        continue  # mosaic has no IEEE f32 (and only interprets on a CPU)
      steps[name] = jax.jit(jax.value_and_grad(loss_of(forward)))
    times = interleaved_ms(steps, params, x, y)
    base_ms = times["jnp.dot (XLA)"]
    for name, step in steps.items():
      ms, value = times[name], float(step(params, x, y)[0])
      rows.append(dict(bench="mlp step", dtype=label, variant=name, ms=ms, vs_xla=base_ms / ms,
                       loss=value))
      print(f"mlp step {label:12s} {name:20s} {ms:9.3f} ms  {base_ms / ms:6.3f}x XLA  "
            f"loss {value:.6f}", flush=True)
  return rows


def epilogue(quick: bool) -> list[dict]:
  return [row for n in ((256,) if quick else (2048, 4096, 8192)) for row in _epilogue(n)]


def _epilogue(n: int) -> list[dict]:
  keys = jax.random.split(jax.random.key(1), 3)
  a = jax.random.normal(keys[0], (n, n), jnp.bfloat16)
  b = jax.random.normal(keys[1], (n, n), jnp.bfloat16)
  c = jax.random.normal(keys[2], (n, n), jnp.bfloat16)
  variants = {"jnp.dot expression": jax.jit(lambda a, b, c: 0.5 * (a @ b) + 2.0 * c)}
  for backend in ("auto", "xla", "mosaic"):
    if backend != "mosaic" or jax.default_backend() == "gpu":
      variants[f"gemm {backend}"] = jax.jit(lambda a, b, c, backend=backend: pallas_gemm.gemm(
          a, b, c, alpha=0.5, beta=2.0, backend=backend))
  times = interleaved_ms(variants, a, b, c, calls=20)
  base_ms, rows = times["jnp.dot expression"], []
  for name, ms in times.items():
    rows.append(dict(bench=f"alpha/beta*C bf16 {n}^3", variant=name, ms=ms, vs_xla=base_ms / ms,
                     tflops=2 * n**3 / ms / 1e9))
    print(f"alpha/beta*C bf16 {n}^3 {name:20s} {ms:9.3f} ms  {base_ms / ms:6.3f}x", flush=True)
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks --mlp")
  p.add_argument("--quick", action="store_true", help="small shapes (a CPU can run them)")
  p.add_argument("--out", type=pathlib.Path)
  p.add_argument("--parts", default="epilogue,mlp", help="comma-separated: epilogue, mlp")
  args = p.parse_args(argv)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  parts = args.parts.split(",")
  rows = (epilogue(args.quick) if "epilogue" in parts else []) + (
      mlp(args.quick) if "mlp" in parts else [])
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mlp.json").write_text(json.dumps(
        dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), indent=1))
  return 0
