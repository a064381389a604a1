"""Grouped GEMM (MoE expert layers): pallas_gemm.ragged_dot vs jax.lax.ragged_dot, tokamax
and a dense bf16 GEMM of the same FLOPs, forward and forward+backward, in one run.

    python -m benchmarks --ragged [--problems mixtral,decode] [--rounds 10] [--calls 5]
                                  [--modes fwd,fwd+bwd] [--out DIR]

Problems (`pallas_gemm.testing.grouped_shapes.PROBLEMS`, (G, M, K, N), bf16): Mixtral-like,
DeepSeek-like, Qwen3-MoE-like, skewed (Pareto group sizes) and decode (256 rows); group
sizes from `shapes.group_sizes` with a fixed seed. Variants:
  dense        jnp.dot (M, K) @ (K, N): the same FLOPs as one dense GEMM (the ceiling);
  lax          jax.lax.ragged_dot (XLA; on a GPU through a dense (G, M, K) operand);
  pallas_gemm  pallas_gemm.ragged_dot (backend "auto": the Mosaic kernels on sm_90);
  tokamax      tokamax.ragged_dot(implementation="mosaic"), when tokamax imports (never
               a dependency: see ../shared/wheels/tokamax/README.md for the GPU machine).
fwd+bwd is jax.vjp: the forward and both cotangents (dlhs, drhs) for a fixed cotangent.
A variant that fails to compile or run (XLA's dense operand can exceed the GPU's memory)
is reported as "fails: <reason>", the others still run.

Method: `timing.rounds_ms` with CUPTI device time (`timing.Timer`): `--rounds` rounds, the
variants in an order rotated by one place each round, per round the median of `--calls`
calls; reported: the median over rounds with the min-max spread, TFLOP/s counted as
2*M*K*N (fwd) and 3x that (fwd+bwd), and per-round ratios to dense and to lax
(`timing.ratio_stats`: base time / variant time, so 0.8x dense is 80% of the dense
GEMM's TFLOP/s). "temp MiB": XLA's temporary buffers of the compiled call
(`memory_analysis`), beside the operands' size.
On a CPU the problems are cut to a tiny (4, 128, 64, 64) and the Mosaic kernels run in
their interpreter: a smoke run of the same code, whose times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import Timer, ratio_stats, rounds_ms
from pallas_gemm.grouped import ragged_dot
from pallas_gemm.testing import grouped_shapes as shapes

MODES = ("fwd", "fwd+bwd")
TINY = dict(g=4, m=128, k=64, n=64)
DTYPE = jnp.bfloat16


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks --ragged", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--problems", default=",".join(shapes.PROBLEMS),
                 help=f"comma-separated names from {list(shapes.PROBLEMS)}")
  p.add_argument("--modes", default=",".join(MODES), help="fwd, fwd+bwd")
  p.add_argument("--rounds", type=int, default=None, help="rounds (GPU 10, CPU 2)")
  p.add_argument("--calls", type=int, default=None, help="calls per round (GPU 5, CPU 1)")
  p.add_argument("--no-tokamax", action="store_true", help="leave tokamax out")
  p.add_argument("--out", type=pathlib.Path, default=None)
  return p.parse_args(argv)


def _options(args) -> argparse.Namespace:
  """Accepts argv (a list, as `python -m benchmarks --ragged` passes) or a Namespace
  (missing attributes take their defaults)."""
  if args is None or isinstance(args, (list, tuple)):
    return parse_args(list(args or []))
  defaults = vars(parse_args([]))
  return argparse.Namespace(**{k: getattr(args, k, v) for k, v in defaults.items()})


# ----------------------------------------------------------------------------- variants


def import_tokamax():
  """(tokamax or None, why not): the optional peer, when its wheels are installed."""
  try:
    import tokamax  # noqa: PLC0415 - optional peer
  except Exception as e:  # noqa: BLE001 - an import of an optional peer may fail any way
    return None, f"{type(e).__name__}: {e}"
  return tokamax, None


def variants(on_gpu: bool, with_tokamax: bool) -> tuple[dict, dict]:
  """({name: forward(lhs, rhs, group_sizes)}, {name: why it is left out})."""
  fns = {
      # bf16 in and out (cuBLAS accumulates in f32), as the grouped variants: its vjp is
      # two more bf16 GEMMs. An f32 result cast to bf16 would add an f32 pass and make
      # the backward GEMMs f32.
      "dense": lambda x, w, s: jnp.dot(x, w[0]),
      "lax": jax.lax.ragged_dot,
      # On a CPU "auto" would pick xla: the interpreter is named to run the kernels' code.
      "pallas_gemm": functools.partial(ragged_dot, backend="auto" if on_gpu else "mosaic"),
  }
  missing = {}
  if with_tokamax:
    tokamax, why = import_tokamax()
    if tokamax is None:
      missing["tokamax"] = f"not importable ({why})"
    elif not on_gpu:
      missing["tokamax"] = "its Mosaic GPU kernel needs a GPU"
    else:
      fns["tokamax"] = functools.partial(tokamax.ragged_dot, implementation="mosaic")
  return fns, missing


def _program(forward, mode: str):
  """A jitted call of the forward (fwd) or of the forward and both cotangents (fwd+bwd)."""
  if mode == "fwd":
    return jax.jit(forward)

  def fwd_bwd(x, w, s, ct):
    out, vjp = jax.vjp(lambda x, w: forward(x, w, s), x, w)
    return (out,) + vjp(ct)

  return jax.jit(fwd_bwd)


def _operands(problem: shapes.Problem, mode: str, dense: bool):
  rng = np.random.default_rng(0)
  key = jax.random.key(0)
  k1, k2, k3 = jax.random.split(key, 3)
  g = 1 if dense else problem.g  # dense: one (K, N) matrix, the same FLOPs
  x = jax.random.normal(k1, (problem.m, problem.k), DTYPE)
  w = (jax.random.normal(k2, (g, problem.k, problem.n), jnp.float32)
       / np.sqrt(problem.k)).astype(DTYPE)
  sizes = jnp.asarray(shapes.group_sizes(problem.sizes, problem.g, problem.m, rng))
  args = (x, w, sizes)
  if mode == "fwd+bwd":
    args += (jax.random.normal(k3, (problem.m, problem.n), DTYPE),)
  return args


def _reason(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:160] if text else ''}"


# ----------------------------------------------------------------------------- run


def run_problem(problem, mode, fns, timer, rounds, calls) -> dict:
  """{variant: result dict} for one problem and mode."""
  flops = problem.flops() * (3 if mode == "fwd+bwd" else 1)
  programs, failed, temp = {}, {}, {}
  arg_sets = {}
  for name, forward in fns.items():
    args = _operands(problem, mode, dense=name == "dense")
    program = _program(forward, mode)
    try:
      compiled = program.lower(*args).compile()
      analysis = compiled.memory_analysis()
      temp[name] = None if analysis is None else analysis.temp_size_in_bytes / 2**20
      jax.block_until_ready(compiled(*args))
    except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
      failed[name] = _reason(e)
      continue
    programs[name], arg_sets[name] = compiled, args
  # rounds_ms takes one argument list for all: each variant closes over its own.
  bound = {name: functools.partial(programs[name], *arg_sets[name]) for name in programs}
  times = rounds_ms(timer, bound, [()], rounds, calls) if bound else {}
  out = {}
  for name in fns:
    if name in failed:
      out[name] = dict(fails=failed[name])
      continue
    ms = times[name]
    med = statistics.median(ms)
    out[name] = dict(ms=med, ms_min=min(ms), ms_max=max(ms), tflops=flops / med / 1e9,
                     temp_mib=temp[name], rounds=ms)
  for base in ("dense", "lax"):
    if base in times:
      for name in times:
        if name != base:
          r = ratio_stats(times[base], times[name])  # base / name: > 1, name is faster
          out[name][f"vs_{base}"] = dataclasses.asdict(r) | dict(spread=r.spread)
  return out


def operand_mib(problem: shapes.Problem) -> float:
  return 2 * (problem.m * problem.k + problem.g * problem.k * problem.n
              + problem.m * problem.n) / 2**20


def main(args=None) -> int:
  opts = _options(args)
  on_gpu = jax.default_backend() == "gpu"
  rounds = opts.rounds or (10 if on_gpu else 2)
  calls = opts.calls or (5 if on_gpu else 1)
  names = [n.strip() for n in opts.problems.split(",") if n.strip()]
  unknown = [n for n in names if n not in shapes.PROBLEMS]
  modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
  if unknown or any(m not in MODES for m in modes):
    print(f"unknown problems {unknown} or modes {modes}: choose from {list(shapes.PROBLEMS)} "
          f"and {MODES}", file=sys.stderr)
    return 2
  problems = [shapes.PROBLEMS[n] for n in names]
  if not on_gpu:
    problems = [dataclasses.replace(p, **TINY) for p in problems]
  fns, missing = variants(on_gpu, not opts.no_tokamax)
  timer = Timer()
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, timer {timer.name}, "
        f"{rounds} rounds x {calls} calls" + ("" if on_gpu else
                                            "; no GPU: tiny problems, Mosaic interpreter"),
        flush=True)
  for name, why in missing.items():
    print(f"{name}: left out, {why}", flush=True)
  results = []
  for problem in problems:
    for mode in modes:
      row = dict(problem=dataclasses.asdict(problem), mode=mode,
                 operand_mib=operand_mib(problem),
                 variants=run_problem(problem, mode, fns, timer, rounds, calls))
      results.append(row)
      print(_markdown([row], header=not results[:-1]), flush=True)
  text = _markdown(results)
  if opts.out is not None:
    opts.out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, timer=timer.name,
                rounds=rounds, calls=calls, left_out=missing)
    (opts.out / "ragged.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    (opts.out / "ragged.md").write_text(text + "\n")
    _plot(results, opts.out / "ragged.png")
    print(f"wrote {opts.out}/ragged.json, ragged.md, ragged.png", flush=True)
  print(text, flush=True)
  return 0


# ----------------------------------------------------------------------------- report


def _markdown(results: list[dict], header: bool = True) -> str:
  lines = []
  if header:
    lines += ["| problem (G, M, K, N) | mode | variant | ms (min-max) | TFLOP/s | vs dense "
              "| vs lax | temp MiB / operands |",
              "|---|---|---|---|---|---|---|---|"]
  for row in results:
    p = row["problem"]
    shape = f"{p['name']} ({p['g']}, {p['m']}, {p['k']}, {p['n']})"
    for name, r in row["variants"].items():
      if "fails" in r:
        lines.append(f"| {shape} | {row['mode']} | {name} | fails: {r['fails']} | | | | |")
        continue
      ratio = lambda key: ("" if key not in r else  # noqa: E731
                           f"{r[key]['median']:.3f}x ±{r[key]['spread']:.3f}")
      temp = "" if r["temp_mib"] is None else f"{r['temp_mib']:.0f} / {row['operand_mib']:.0f}"
      lines.append(f"| {shape} | {row['mode']} | {name} | {r['ms']:.3f} ({r['ms_min']:.3f}-"
                   f"{r['ms_max']:.3f}) | {r['tflops']:.1f} | {ratio('vs_dense')} | "
                   f"{ratio('vs_lax')} | {temp} |")
  return "\n".join(lines)


def _plot(results: list[dict], path: pathlib.Path):
  try:
    import matplotlib  # noqa: PLC0415 - optional (the bench extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return
  names = sorted({n for row in results for n in row["variants"]})
  fig, axes = plt.subplots(1, len(MODES), figsize=(12, 4), squeeze=False)
  for ax, mode in zip(axes[0], MODES):
    rows = [r for r in results if r["mode"] == mode]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
      values = [r["variants"].get(name, {}).get("tflops", 0.0) for r in rows]
      ax.bar(np.arange(len(rows)) + i * width, values, width, label=name)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2)
    ax.set_xticklabels([r["problem"]["name"] for r in rows], rotation=20)
    ax.set_ylabel("TFLOP/s (2MKN per GEMM)")
    ax.set_title(f"ragged_dot {mode} (a failed variant shows 0)")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
