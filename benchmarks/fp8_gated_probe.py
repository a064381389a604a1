"""Probe: the fp8 gated kernel (`pallas_gemm.fp8.gated`, moe_mlp's fp8 inference form
between its GEMMs) against the three passes it replaces, on routed rows of MoE configs.

    python -m benchmarks.fp8_gated_probe [--configs qwen3,decode-qwen3] [--rounds 5]

Variants, each on the same quantized rows, weights and group sizes:
  three-pass   scaled_ragged_dot to bf16 h (R, 2F), SwiGLU, quantize (the unfused form)
  h-gemm       the first of those alone
  fused        gated_quantized on the Mosaic kernel (kernel + the scales' gather)
  fused-values the kernel's values alone (XLA drops the scales' gather)
Reports per variant CUPTI kernel time (the sum of its kernels) and pipelined wall clock,
median over rounds taken in turns. With --kernels, each variant's kernels by name
instead; with --layer, those of moe_mlp's fp8 inference form, fused and three-pass.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.moe import CONFIGS
from benchmarks.timing import PipelinedTimer, Timer
from pallas_gemm.core import epilogue, primitive
from pallas_gemm.fp8 import gated_quantized, mosaic_gated, quantize, scaled_ragged_dot


def operands(cfg, seed=0):
  """Quantized rows, weights (drawn on the device: DeepSeek-V3-like weights are 7.5e9
  numbers) and the group sizes of a uniform random routing."""
  rng = np.random.default_rng(seed)
  rows = cfg.tokens * cfg.top_k
  ids = rng.integers(0, cfg.experts, rows)
  sizes = jnp.asarray(np.bincount(ids, minlength=cfg.experts), jnp.int32)
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (rows, cfg.d_model), jnp.bfloat16)
  w = jax.random.normal(kw, (cfg.experts, 2 * cfg.d_ff, cfg.d_model), jnp.bfloat16) * 0.05
  x8, sx = quantize(x)
  w8, sw = quantize(w, block_shape=(128, 128))
  return x8, w8, sizes, sx, sw


def variants():
  def three_pass(x8, w8, sizes, sx, sw):
    h = scaled_ragged_dot(x8, w8, sizes, sx, sw, jnp.bfloat16)
    return quantize(epilogue.gated(h, "silu"))

  def h_gemm(x8, w8, sizes, sx, sw):
    return scaled_ragged_dot(x8, w8, sizes, sx, sw, jnp.bfloat16)

  def fused(x8, w8, sizes, sx, sw):
    return gated_quantized(x8, w8, sizes, sx, sw, "silu", backend="mosaic")

  def fused_values(x8, w8, sizes, sx, sw):
    with primitive.kernel_x64("mosaic"):
      return mosaic_gated.gated_ragged_gemm(x8, w8, sizes, sx, sw, activation="silu")[0]

  return {"three-pass": three_pass, "h-gemm": h_gemm, "fused": fused,
          "fused-values": fused_values}


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_gated_probe")
  p.add_argument("--configs", default="mixtral,qwen3,deepseek-v3,decode-qwen3")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--kernels", action="store_true",
                 help="instead: each variant's kernels by name (CUPTI), per config")
  p.add_argument("--layer", action="store_true",
                 help="instead: moe_mlp's fp8 inference form and its three-pass variant,"
                      " kernels by name (CUPTI), per config")
  args = p.parse_args(argv)
  if args.layer:
    from benchmarks import moe, probe  # noqa: PLC0415 - the layer and its CUPTI helpers
    fns = moe.variants(True, ["moe_mlp/fp8", "moe_mlp/fp8-3pass"])[0]
    for name in args.configs.split(","):
      ops = moe.operands(CONFIGS[name], "fwd", False)
      for k in ("moe_mlp/fp8", "moe_mlp/fp8-3pass"):
        placed = moe.PREPARE[k](*ops)
        probe.print_kernels(f"{name} {k}", probe.ranked_kernels(jax.jit(fns[k]), placed,
                                                                args.calls))
    return
  if args.kernels:
    from benchmarks import probe  # noqa: PLC0415 - its CUPTI helpers
    for name in args.configs.split(","):
      ops = operands(CONFIGS[name])
      for k, v in variants().items():
        probe.print_kernels(f"{name} {k}", probe.ranked_kernels(jax.jit(v), ops, args.calls))
    return
  cupti, wall = Timer(), PipelinedTimer()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; kernel time: {cupti.name}")
  print("| config | variant | kernels ms | wall ms | x three-pass (kernels) |")
  print("|---|---|---:|---:|---:|")
  for name in args.configs.split(","):
    cfg = CONFIGS[name]
    ops = operands(cfg)
    fns = {k: jax.jit(v) for k, v in variants().items()}
    for fn in fns.values():
      jax.block_until_ready(fn(*ops))
    kern = {k: [] for k in fns}
    walls = {k: [] for k in fns}
    for r in range(args.rounds):
      order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
      for k in order:
        kern[k].append(statistics.median(cupti.sample(fns[k], [ops], args.calls)))
        walls[k].append(wall.sample(fns[k], [ops], args.calls)[0])
    base = statistics.median(kern["three-pass"])
    for k in fns:
      km, wm = statistics.median(kern[k]), statistics.median(walls[k])
      print(f"| {name} | {k} | {km:.3f} | {wm:.3f} | {base / km:.2f}x |", flush=True)


if __name__ == "__main__":
  main()
