"""python -m benchmarks: time pallas_gemm's backends against jnp.dot.

  python -m benchmarks                      # GPU: the headline sweep (~1-2 min); CPU: --quick
  python -m benchmarks --quick              # the small sweep, 128^3-512^3 (also on a CPU)
  python -m benchmarks --headline           # the headline sweep anywhere (tiny on a CPU)
  python -m benchmarks --gpu-default        # a ~2 min GPU check of the main regimes
  python -m benchmarks --full               # the GPU sweep (~7 min on an H100, budget 400 s)
  python -m benchmarks --full --shapes square,skinny --dtypes bf16 --backends triton,mosaic
  python -m benchmarks --shapes 4096x4096x4096,8x1024x1024x1024 --dtypes f32
  python -m benchmarks --autotune           # GPU: autotune key shapes, report the gain
  python -m benchmarks --full --list        # print the plan and its time estimate, run nothing
  python -m benchmarks --sharded            # many GPUs: gemm vs jnp.dot under jit shardings
  python -m benchmarks --mlp                # an MLP training step and an epilogue vs XLA
  python -m benchmarks --precision          # float32 presets / float32_accurate: speed, error
  python -m benchmarks --ragged             # grouped GEMM (benchmarks/ragged.py)
  python -m benchmarks --fp8                # fp8 GEMMs with scales (benchmarks/fp8.py)
  python -m benchmarks --fp8-ragged         # fp8 grouped GEMM (benchmarks/fp8_ragged.py)

The headline sweep compares bf16 (aligned and misaligned), f32 HIGHEST, float32_accurate
and a fused bias + GELU layer with jnp.dot in the same run: ratios per round, variants in
rotated order, median with the quartiles and extremes (benchmarks/headline.py).

Writes results.json, results.md and PNG plots to --out (default
benchmarks/results/<date>-<device>/) and prints the markdown table last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import pathlib
import re
import sys

import jax

from benchmarks import headline, report, runner
from benchmarks import shapes as shapes_lib


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
  p.add_argument("--out", type=pathlib.Path, help="results directory")
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
  """Runs benchmarks.<module_name>.main on argv without `flag`; exit 2 if it is absent."""
  try:
    module = importlib.import_module(f"benchmarks.{module_name}")
  except ModuleNotFoundError as e:
    if e.name != f"benchmarks.{module_name}":
      raise
    print(f"{flag}: benchmarks/{module_name}.py is not in this checkout", file=sys.stderr)
    return 2
  return module.main([x for x in argv if x != flag])


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


def _default_out() -> pathlib.Path:
  kind = re.sub(r"[^A-Za-z0-9]+", "-", jax.devices()[0].device_kind).strip("-")
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  return pathlib.Path(__file__).parent / "results" / f"{stamp}-{kind}"


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  # Each of these has its own table and options (`python -m benchmarks --mlp --help`).
  for flag in ("--sharded", "--mlp", "--precision", "--ragged", "--fp8", "--fp8-ragged"):
    if flag in argv:
      return _delegate(flag, flag[2:].replace("-", "_"), argv)
  args = parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  sweep = any(getattr(args, name) for name in _SWEEP_FLAGS)
  if args.headline or (on_gpu and not sweep):
    return headline.main(argv, args.out or _default_out(), args.rounds, args.iterations)
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
    text, written = report.write_all(args.out or _default_out(), meta, [], tune_rows)
    print("\n".join(f"wrote {p}" for p in written), flush=True)
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
  print(f"plan: {len(pairs)} (shape, dtype) pairs x [jnp.dot, {', '.join(backends)}] = "
        f"{planned} measurements, estimated {runner.estimate_seconds(planned, on_gpu) / 60:.1f} "
        f"min" + (f" (budget {budget:.0f} s)" if budget else ""), flush=True)
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
  text, written = report.write_all(args.out or _default_out(), meta, rows)
  print("\n".join(f"wrote {p}" for p in written), flush=True)
  print(text, flush=True)
  return 1 if any(r["correct"] is False for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
