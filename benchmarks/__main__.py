"""python -m benchmarks: time pallas_gemm's backends against jnp.dot.

  python -m benchmarks                      # GPU: the headline sweep (minutes); CPU: --quick
  python -m benchmarks --quick              # the small sweep, 128^3-512^3 (also on a CPU)
  python -m benchmarks --headline           # the headline sweep anywhere (tiny on a CPU)
  python -m benchmarks --gpu-default        # a ~2 min GPU check of the main regimes
  python -m benchmarks --full               # the GPU sweep (~7 min on an H100, budget 400 s)
  python -m benchmarks --full --shapes square,skinny --dtypes bf16 --backends triton,mosaic
  python -m benchmarks --shapes 4096x4096x4096,8x1024x1024x1024 --dtypes f32
  python -m benchmarks --autotune           # GPU: autotune key shapes, report the gain
  python -m benchmarks --full --list        # print the plan and its time estimate, run nothing
  python -m benchmarks --record             # write a dated record to benchmarks/results/
  python -m benchmarks --sharded            # many GPUs: gemm vs jnp.dot under jit shardings
  python -m benchmarks --mlp                # an MLP training step and an epilogue vs XLA
  python -m benchmarks --precision          # float32 presets / float32_accurate: speed, error
  python -m benchmarks --ragged             # grouped GEMM (benchmarks/ragged.py)
  python -m benchmarks --fp8                # fp8 GEMMs with scales (benchmarks/fp8.py)
  python -m benchmarks --fp8-ragged         # fp8 grouped GEMM (benchmarks/fp8_ragged.py)
  python -m benchmarks --moe                # the MoE layer (benchmarks/moe.py)
  python -m benchmarks --moe --expert-parallel   # several devices: expert-parallel moe_mlp,
                                            # weak and strong scaling (benchmarks/moe_parallel.py)

The headline sweep compares bf16 (aligned and misaligned), f32 HIGHEST, float32_accurate
and a fused bias + GELU layer with jnp.dot in the same run: ratios per round, variants in
rotated order, median with the quartiles and extremes; then the grouped GEMM's, fp8's and
the MoE layer's key rows from their own benchmarks, and one line per family
(benchmarks/headline.py).

Writes results.json, results.md and PNG plots to --out, by default to
benchmarks/out/<YYYY-MM-DD>-<device>/ (git-ignored) or, with --record, to the dated record
benchmarks/results/<YYYY-MM-DD>-<device>/; prints the markdown table, then that folder.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

import jax

from benchmarks import headline, report, runner
from benchmarks import shapes as shapes_lib

# The benchmarks with parsers of their own (`python -m benchmarks --mlp --help`): main hands
# them the command line; the shape sweep's options below do not apply to them.
DELEGATED = {
    "--sharded": ("sharded", "many GPUs: gemm vs jnp.dot under jit shardings"),
    "--mlp": ("mlp", "MLP training steps and the fused epilogue vs XLA"),
    "--precision": ("precision", "float32 presets and float32_accurate: speed and error"),
    "--ragged": ("ragged", "grouped GEMM (ragged_dot) vs lax.ragged_dot and a dense GEMM"),
    "--fp8": ("fp8", "fp8 GEMMs with scales (scaled_matmul) vs bf16 jnp.dot"),
    "--fp8-ragged": ("fp8_ragged", "fp8 grouped GEMM (scaled_ragged_dot) vs bf16 grouped"),
    "--moe": ("moe", "the MoE layer (moe_mlp) vs one written on a grouped GEMM, and dense"),
}


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="the small sweep (square 128-512, ragged, batched): the CPU's default")
  p.add_argument("--headline", action="store_true",
                 help="the headline sweep (the GPU's default) on any machine")
  p.add_argument("--rounds", type=int, default=headline.ROUNDS,
                 help="headline: rounds in rotated order (each --iterations calls)")
  p.add_argument("--full", action="store_true",
                 help="the full GPU sweep (square 256..16384, ragged, skinny, K-heavy/light, "
                      "batched; f32 IEEE/TF32, bf16, f16)")
  p.add_argument("--gpu-default", action="store_true",
                 help="a ~2-minute GPU check: square 1024/4096/8192 in every dtype, 4097^3, "
                      "16x8192x8192, 16x1024^3")
  p.add_argument("--shapes", help="comma-separated categories (" + ", ".join(shapes_lib.FULL)
                 + ") and/or shapes MxNxK / BxMxNxK")
  p.add_argument("--dtypes", help="comma-separated: f32-highest, f32-default, bf16, f16 "
                 "(aliases: f32 = both f32, tf32, ieee, all)")
  p.add_argument("--backends", help="comma-separated: xla, triton, mosaic, cuda, jax-hopper "
                 "(default: every available one; jnp.dot always runs as the baseline)")
  where = p.add_mutually_exclusive_group()
  where.add_argument("--out", type=pathlib.Path,
                     help="results directory (default: benchmarks/out/<YYYY-MM-DD>-<device>/, "
                          "git-ignored)")
  where.add_argument("--record", action="store_true",
                     help="write to benchmarks/results/<YYYY-MM-DD>-<device>/, the dated "
                          "record to commit (also with the other benchmarks below)")
  p.add_argument("--iterations", type=int, default=10, help="timed calls per row (median)")
  p.add_argument("--correctness", action=argparse.BooleanOptionalAction, default=True,
                 help="check each row against an IEEE-f32 reference before timing")
  p.add_argument("--tuned", action=argparse.BooleanOptionalAction, default=True,
                 help="use tuned configs (cache/table) like gemm() does; --no-tuned: "
                      "each backend's default_config")
  p.add_argument("--budget-s", type=float,
                 help="stop starting new shapes after this many seconds (defaults: --full "
                      "400, --gpu-default 300, --autotune 240)")
  p.add_argument("--autotune", action="store_true",
                 help="GPU only: autotune key shapes (or --shapes) and report the gain")
  p.add_argument("--list", action="store_true", help="print the plan only")
  other = p.add_argument_group(
      "other benchmarks", "each takes its own options: python -m benchmarks --mlp --help")
  for flag, (module_name, text) in DELEGATED.items():
    other.add_argument(flag, action="store_true", help=f"{text} (benchmarks/{module_name}.py)")
  args = p.parse_args(argv)
  if args.iterations < 1:
    p.error("--iterations must be >= 1")
  if args.rounds < 1:
    p.error("--rounds must be >= 1")
  return args


# Flags that ask for the shape sweep (runner.py); without any of them a GPU runs the
# headline sweep.
_SWEEP_FLAGS = ("quick", "full", "gpu_default", "shapes", "dtypes", "backends", "autotune",
                "list")


def _delegate(flag: str, module_name: str, argv: list[str]) -> int:
  """Runs benchmarks.<module_name>.main on argv without `flag`, --record turned into --out
  (their parsers know only --out); exit 2 if the module is absent."""
  try:
    module = importlib.import_module(f"benchmarks.{module_name}")
  except ModuleNotFoundError as e:
    if e.name != f"benchmarks.{module_name}":
      raise
    print(f"{flag}: benchmarks/{module_name}.py is not in this checkout", file=sys.stderr)
    return 2
  rest = [x for x in argv if x != flag]
  if "--record" in rest:
    rest.remove("--record")
    if any(x == "--out" or x.startswith("--out=") for x in rest):
      print(f"{flag}: --record and --out name two folders; pass one", file=sys.stderr)
      return 2
    rest += ["--out", str(report.results_dir(record=True))]
  return module.main(rest)


def _select_backends(spec, status) -> tuple[list[str], list[str]]:
  """(backends to run, notes about those left out)."""
  names = [b for b in status]
  if spec:
    names = []
    for token in spec.split(","):
      token = runner.BACKEND_ALIASES.get(token.strip(), token.strip())
      if token == runner.DOT:
        continue  # always runs
      if token not in status:
        raise SystemExit(f"unknown backend {token!r}; choose from {sorted(status)}")
      names.append(token)
  chosen = [b for b in names if status[b] is None]
  notes = [f"{b}: skipped ({status[b]})" for b in names if status[b] is not None]
  return chosen, notes


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  for flag, (module_name, _) in DELEGATED.items():
    if flag in argv:
      return _delegate(flag, module_name, argv)
  args = parse_args(argv)
  out = args.out or report.results_dir(record=args.record)
  on_gpu = jax.default_backend() == "gpu"
  sweep = any(getattr(args, name) for name in _SWEEP_FLAGS)
  if args.headline or (on_gpu and not sweep):
    print(report.describe_dir(out), flush=True)  # first: the tables print last
    return headline.main(argv, out, args.rounds, args.iterations)
  status = runner.available_backends()
  backends, notes = _select_backends(args.backends, status)
  dtypes = shapes_lib.parse_dtypes(args.dtypes)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}",
        flush=True)
  for note in notes:
    print(note, flush=True)

  if args.autotune:
    if not on_gpu:
      print("--autotune needs a GPU (autotuning on a CPU would tune the interpreter)",
            file=sys.stderr)
      return 2
    pairs = (shapes_lib.plan(shapes_lib.FULL, args.shapes, dtypes) if args.shapes else
             [(s, shapes_lib.DTYPES[d]) for s, d in runner.AUTOTUNE_SHAPES
              if dtypes is None or d in dtypes])
    budget = 240.0 if args.budget_s is None else args.budget_s
    tune_rows = runner.run_autotune(pairs, backends, args.iterations, budget_s=budget)
    meta = report.run_metadata(dict(timer=runner.Timer().name, mode="autotune"), argv)
    text, written = report.write_all(out, meta, [], tune_rows)
    print("\n".join(f"wrote {p}" for p in written), flush=True)
    print(report.describe_dir(out), flush=True)
    print(text, flush=True)
    return 0

  table = (shapes_lib.FULL if args.full else
           shapes_lib.MEDIUM if args.gpu_default else shapes_lib.SMALL)
  if args.shapes and not args.full:  # categories only the full sweep defines are allowed too
    table = {**shapes_lib.FULL, **shapes_lib.SMALL}
  pairs = shapes_lib.plan(table, args.shapes, dtypes)
  planned = runner.count_planned(pairs, backends, on_gpu)
  budget = args.budget_s if args.budget_s is not None else (
      400.0 if args.full else 300.0 if args.gpu_default else None)
  seconds = runner.estimate_seconds(pairs, backends, on_gpu, args.iterations, budget)
  print(f"plan: {len(pairs)} (shape, dtype) pairs x [jnp.dot, {', '.join(backends)}] = "
        f"{planned} measurements, estimated {_duration(seconds)} on this "
        f"{'GPU' if on_gpu else 'CPU'}" + (f" (budget {budget:.0f} s)" if budget else ""),
        flush=True)
  if not on_gpu and any(b != "xla" for b in backends):
    print(f"CPU: Pallas backends run in interpret mode, only on shapes <= "
          f"{shapes_lib.INTERPRET_MAX_FLOPS:.1e} FLOP", flush=True)
  if args.list:
    for shape, dt in pairs:
      print(f"  {shape.category:<9} {shape.label:<18} {dt.name}", flush=True)
    return 0

  opts = runner.Options(iterations=args.iterations, correctness=args.correctness,
                        use_tuned=args.tuned, budget_s=budget)
  rows, info = runner.run(pairs, backends, opts)
  meta = report.run_metadata(dict(info, mode="full" if args.full else
                                  "gpu-default" if args.gpu_default else "quick",
                                  backends_status=status), argv)
  text, written = report.write_all(out, meta, rows)
  print("\n".join(f"wrote {p}" for p in written), flush=True)
  print(report.describe_dir(out), flush=True)
  print(text, flush=True)  # the short table last
  return 1 if any(r["correct"] is False for r in rows) else 0


def _duration(seconds: float) -> str:
  return f"~{seconds:.0f} s" if seconds < 100 else f"~{seconds / 60:.1f} min"


if __name__ == "__main__":
  sys.exit(main())
