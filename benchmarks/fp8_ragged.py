"""python -m benchmarks --fp8-ragged: block-scaled fp8 grouped GEMM (`scaled_ragged_dot`)
against the bf16 grouped GEMMs, on Mixture-of-Experts problems (`testing.grouped_shapes.PROBLEMS`).

Paths, all in one process per problem, rounds in rotated order:
  bf16 pallas ragged_dot      pallas_gemm.ragged_dot on bf16 x (M, K) and w (G, K, N): the
                              bf16 grouped kernel, the baseline of the ratios;
  bf16 lax.ragged_dot         jax.lax.ragged_dot on the same operands;
  fp8 scaled_ragged_dot       x in 1x128 and w in 128x128 blocks per expert, quantized
                              beforehand (inference with fp8 weights);
  q(x) + fp8 ...              x quantized in the call (1x128, the one-pass kernel).
Time: CUPTI kernel time on a GPU, `--rounds` rounds of `--calls` calls over two input
sets; the median over rounds and its spread (half the IQR of the per-round ratios).
TFLOP/s count 2 * sum(group_sizes) * K * N. Error: normwise relative error of the first
256 rows (bf16 output) against the float64 product of the operands each path was given.
A CPU runs a tiny problem on the xla backends, as a smoke test of this script.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_gemm
from benchmarks.timing import Timer, ratio_stats, rounds_ms
from pallas_gemm.testing import reference
from pallas_gemm.testing import grouped_shapes as shapes

BF16 = jnp.bfloat16
BASE = "bf16 pallas ragged_dot"
PROBLEMS = ("mixtral", "deepseek", "qwen3_moe", "skewed")
CPU_PROBLEM = shapes.Problem("cpu-smoke", 4, 512, 256, 256)
ERROR_ROWS = 256


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks --fp8-ragged", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--problems", default=",".join(PROBLEMS),
                 help=f"comma-separated names of {sorted(shapes.PROBLEMS)}")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=10, help="timed calls per round (median)")
  p.add_argument("--out", type=pathlib.Path)
  return p.parse_args(argv)


def inputs(problem: shapes.Problem, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  sizes = shapes.group_sizes(problem.sizes, problem.g, problem.m, rng)
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (problem.m, problem.k), BF16)
  w_gnk = jax.random.normal(kw, (problem.g, problem.n, problem.k), BF16)
  x8, sx = pallas_gemm.quantize(x)
  w8, sw = pallas_gemm.quantize(w_gnk, block_shape=(128, 128))
  return dict(x=x, w=jnp.swapaxes(w_gnk, 1, 2), sizes=jnp.asarray(sizes), x8=x8, sx=sx,
              w8=w8, sw=sw)


def implementations(backend: str) -> dict:
  """{label: (jitted fn, names of its inputs)}; backend ("auto" or "xla") for both
  pallas_gemm paths."""
  fp8 = jax.jit(lambda x8, w8, sizes, sx, sw: pallas_gemm.scaled_ragged_dot(
      x8, w8, sizes, sx, sw, BF16, backend=backend))
  return {
      BASE: (jax.jit(lambda x, w, sizes: pallas_gemm.ragged_dot(
          x, w, sizes, backend=backend)), ("x", "w", "sizes")),
      "bf16 lax.ragged_dot": (jax.jit(jax.lax.ragged_dot), ("x", "w", "sizes")),
      "fp8 scaled_ragged_dot": (fp8, ("x8", "w8", "sizes", "sx", "sw")),
      "q(x) + fp8 scaled_ragged_dot": (jax.jit(functools.partial(_quantized, fp8)),
                                       ("x", "w8", "sizes", "sw")),
  }


def _quantized(fp8, x, w8, sizes, sw):
  x8, sx = pallas_gemm.quantize(x)
  return fp8(x8, w8, sizes, sx, sw)


def _error(name: str, out, d: dict) -> float:
  """Error of out's first ERROR_ROWS rows against float64 of the operands name was given."""
  rows = min(ERROR_ROWS, out.shape[0])
  ends = np.minimum(np.cumsum(np.asarray(d["sizes"])), rows)
  sizes = np.diff(np.concatenate([[0], ends]))
  if name.startswith("bf16"):  # (G, K, N) weights, as bf16 into float64
    ref = reference.scaled_ragged_reference(
        d["x"][:rows], jnp.swapaxes(d["w"], 1, 2), sizes, np.ones((rows, 1), np.float32),
        np.ones((d["w"].shape[0], 1, 1), np.float32))
  else:
    ref = reference.scaled_ragged_reference(d["x8"][:rows], d["w8"], sizes, d["sx"][:rows],
                                            d["sw"])
  return reference.relative_error(np.asarray(out[:rows], np.float32), ref)


def run_problem(problem: shapes.Problem, args, timer, backend: str) -> list[dict]:
  sets = [inputs(problem, seed) for seed in (1, 2)]
  impls = implementations(backend)
  calls = {name: (lambda i, fn=fn, names=names: fn(*(sets[i][x] for x in names)))
           for name, (fn, names) in impls.items()}
  times = rounds_ms(timer, calls, [(0,), (1,)], args.rounds, args.calls)
  flops = 2.0 * int(np.sum(np.asarray(sets[0]["sizes"]))) * problem.k * problem.n
  rows = []
  for name, (fn, names) in impls.items():
    ms = statistics.median(times[name])
    ratio = ratio_stats(times[BASE], times[name])
    out = fn(*(sets[0][x] for x in names))
    row = dict(problem=problem.name, g=problem.g, m=problem.m, k=problem.k, n=problem.n,
               sizes=problem.sizes, impl=name, ms=ms, round_ms=times[name],
               tflops=flops / ms / 1e9, vs_bf16_kernel=ratio.median,
               vs_bf16_kernel_spread=ratio.spread, relerr_bf16_out=_error(name, out, sets[0]))
    rows.append(row)
    print(f"{problem.name:10s} {name:30s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s"
          f" {ratio.median:5.2f}x bf16 kernel (+-{ratio.spread:.2f})"
          f"  err {row['relerr_bf16_out']:.1e}", flush=True)
  return rows


def main(argv=None) -> int:
  args = parse_args(list(sys.argv[1:] if argv is None else argv))
  on_gpu = jax.default_backend() == "gpu"
  device = jax.devices()[0].device_kind
  print(f"device: {device} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
  if on_gpu:
    problems, backend = [shapes.PROBLEMS[p] for p in args.problems.split(",") if p], "auto"
  else:
    print("no GPU: a tiny problem on the xla backends (the Mosaic interpreter is no"
          " timing); the MoE problems need a GPU", flush=True)
    problems, backend = [CPU_PROBLEM], "xla"
    args.rounds, args.calls = 2, 2
  timer = Timer()
  rows = []
  for problem in problems:
    rows += run_problem(problem, args, timer, backend)
  meta = dict(device=device, jax=jax.__version__, timer=timer.name, rounds=args.rounds,
              calls=args.calls, backend=backend)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_ragged.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  print("| problem (G, M, K, N, sizes) | path | ms | TFLOP/s | x bf16 grouped kernel | err |")
  print("|---|---|---:|---:|---|---|")
  for r in rows:
    print(f"| {r['problem']} ({r['g']}, {r['m']}, {r['k']}, {r['n']}, {r['sizes']}) |"
          f" {r['impl']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['vs_bf16_kernel']:.2f} +-"
          f" {r['vs_bf16_kernel_spread']:.2f} | {r['relerr_bf16_out']:.1e} |")
  return 0
