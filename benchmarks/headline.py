"""The headline sweep: where pallas_gemm stands against jnp.dot, in one or two minutes.

    python -m benchmarks              # on a GPU (a CPU runs the small sweep: --quick)
    python -m benchmarks --headline   # this sweep on any machine (tiny sizes on a CPU)

Then each other family's key rows from its own benchmark, in the same process: the grouped
GEMM at Mixtral-like sizes (`benchmarks.ragged`, forward: against the dense GEMM of its
FLOPs, lax and tokamax), block-scaled and per-tensor fp8 at 4096^3 (`benchmarks.fp8
--quick`) and the MoE layer (`benchmarks.moe`, Qwen3-like, forward and backward), their
tables written under families/; last, one table with a line per family (`families`), also
appended to headline.md.

Each case times a baseline (jnp.dot, or the jnp expression a user would write) and
pallas_gemm's call in the same process, over `ROUNDS` rounds in rotated order, each round
the median of `CALLS` calls (`timing.rounds_ms`); the ratio is taken within each round and
reported as the median with its quartiles and extremes (`timing.ratio_stats`). Inputs are
standard normal, rotated over as many sets as overflow L2. Errors are relative Frobenius
norms of the first `precision.ERR_ROWS` rows against float64; the float32 cases add the
wide-range inputs of `benchmarks --precision` (x * exp(1.5 N(0,1))), whose errors are
reported beside, not judged.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_gemm
from pallas_gemm.testing import reference as ref_lib
from pallas_gemm.matmul import tuning

from benchmarks import fp8 as fp8_bench
from benchmarks import moe
from benchmarks import ragged as ragged_bench
from benchmarks import precision as precision_bench
from benchmarks import report
from benchmarks.timing import Timer, ratio_stats, rounds_ms

HIGHEST = jax.lax.Precision.HIGHEST
ROUNDS, CALLS = 7, 10
# The folder under --out for the other families' benchmark tables.
FAMILIES_DIR = "families"


@dataclasses.dataclass(frozen=True)
class Case:
  label: str
  dtype: np.dtype
  m: int
  n: int
  k: int
  baseline: tuple[str, Callable]        # (name, fn(a, b[, bias]))
  candidate: tuple[str, Callable]
  precision: object = None              # of the candidate (tolerance, error columns)
  bias: bool = False                    # a third operand: bias of shape (n,)

  @property
  def flops(self) -> float:
    return 2.0 * self.m * self.n * self.k


def _dot(precision=None):
  return jax.jit(lambda a, b: jnp.dot(a, b, precision=precision))


def _gemm(precision=None):
  return jax.jit(lambda a, b: pallas_gemm.gemm(a, b, precision=precision))


def cases(on_gpu: bool) -> list[Case]:
  """The GPU's headline problems; on a CPU the same cases at sizes the interpreter runs."""
  bf16, f32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)
  aligned, big, odd, f32_n = (4096, 8192, 4097, 4096) if on_gpu else (64, 128, 65, 64)
  rows, d, hidden = (8192, 4096, 16384) if on_gpu else (64, 32, 128)
  out = [Case(f"bf16 {n}^3" + (" (misaligned rows)" if n % 8 else ""), bf16, n, n, n,
              ("jnp.dot", _dot()), ("gemm", _gemm())) for n in (aligned, big, odd)]
  out.append(Case(f"f32 HIGHEST {f32_n}^3", f32, f32_n, f32_n, f32_n,
                  ("jnp.dot HIGHEST", _dot(HIGHEST)), ("gemm HIGHEST", _gemm(HIGHEST)),
                  HIGHEST))
  for n in (aligned, odd):
    out.append(Case(f"float32_accurate {n}^3", f32, n, n, n, ("jnp.dot HIGHEST", _dot(HIGHEST)),
                    ("gemm float32_accurate", _gemm("float32_accurate")), "float32_accurate"))
  # The first layer of the MLP in `benchmarks --mlp`: bias + GELU in the GEMM's epilogue.
  out.append(Case(f"dense bias+gelu bf16 {rows}x{hidden}x{d}", bf16, rows, hidden, d,
                  ("jax.nn.gelu(x @ w + b)", jax.jit(lambda x, w, b: jax.nn.gelu(x @ w + b))),
                  ("pallas_gemm.dense", jax.jit(lambda x, w, b: pallas_gemm.dense(
                      x, w, b, "gelu"))), bias=True))
  return out


def _inputs(case: Case, on_gpu: bool):
  set_bytes = case.dtype.itemsize * (case.m * case.k + case.k * case.n + case.m * case.n)
  count = tuning.input_set_count(set_bytes) if on_gpu else 2
  sets = tuning.random_inputs((case.m, case.k), (case.k, case.n), case.dtype, count)
  if case.bias:
    bias = jax.random.normal(jax.random.key(7), (case.n,), jnp.float32).astype(case.dtype)
    sets = [(a, b, bias) for a, b in sets]
  return sets


def _references(case: Case, args) -> dict:
  """float64 results of the first rows: of the timing inputs, and for float32 cases of
  wide-range inputs at the full shape (so that `auto` picks the kernel it is timed with)."""
  rows = min(precision_bench.ERR_ROWS, case.m)
  a, b = (np.asarray(x) for x in args[:2])
  want = a[:rows].astype(np.float64) @ b.astype(np.float64)
  if case.bias:
    with jax.enable_x64(True):
      want = np.asarray(ref_lib.ACTIVATIONS["gelu"](want + np.asarray(args[2], np.float64)))
  refs = dict(rows=rows, want=want)
  if case.dtype == np.float32:
    wa = precision_bench.family("wide", (case.m, case.k), 1)
    wb = precision_bench.family("wide", (case.k, case.n), 2, "b")
    refs["wide"] = (jnp.asarray(wa), jnp.asarray(wb), wa[:rows].astype(np.float64) @ wb)
  return refs


def _errors(fn, case: Case, args, refs: dict) -> dict:
  """fn's relative errors against `_references` and whether they are within
  reference.tolerance (the timing inputs'; the wide inputs' are reported)."""
  def err(out, want):
    got = np.asarray(out[:refs["rows"]], np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))

  rel = err(fn(*args), refs["want"])
  tol = ref_lib.tolerance(case.dtype, case.precision, case.k)
  result = dict(rel_err=rel, tol=tol, correct=bool(rel <= tol))
  if "wide" in refs:
    wa, wb, want = refs["wide"]
    result["rel_err_wide"] = err(fn(wa, wb), want)
  return result


def run(on_gpu: bool, rounds: int = ROUNDS, calls: int = CALLS, log=print) -> tuple[list, str]:
  """Rows (one per baseline and candidate of each case) and the timer's name."""
  timer = Timer()
  rows = []
  for case in cases(on_gpu):
    sets = _inputs(case, on_gpu)
    fns = dict([case.baseline, case.candidate])
    base_name, cand_name = case.baseline[0], case.candidate[0]
    try:
      refs = _references(case, sets[0])
      checks = {name: _errors(fn, case, sets[0], refs) for name, fn in fns.items()}
      del refs
      per_round = rounds_ms(timer, fns, sets, rounds, calls)
    except Exception as e:  # noqa: BLE001 - one failing case must not end the sweep
      status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
      log(f"{case.label:40s} {status}", flush=True)
      rows.append(dict(case=case.label, variant=cand_name, status=status))
      continue
    for name in fns:
      ms = float(np.median(per_round[name]))
      row = dict(case=case.label, variant=name, baseline=name == base_name, status="ok",
                 ms=ms, tflops=case.flops / ms / 1e9, round_ms=per_round[name], **checks[name])
      if name == cand_name:
        r = ratio_stats(per_round[base_name], per_round[name])
        row.update(ratio=r.median, p25=r.p25, p75=r.p75, low=r.low, high=r.high,
                   spread=r.spread, verdict=r.verdict, rounds=r.rounds)
        if not row["correct"]:
          row["verdict"] = "WRONG"
      rows.append(row)
      log(line(row), flush=True)
    del sets
  return rows, timer.name


def line(row: dict) -> str:
  head = f"{row['case']:40s} {row['variant']:24s}"
  if row["status"] != "ok":
    return f"{head} {row['status']}"
  text = f"{head} {row['ms']:9.4f} ms {row['tflops']:7.3g} TFLOP/s  err {row['rel_err']:.1e}"
  if "ratio" in row:
    text += (f"  {row['ratio']:.3f}x (IQR {row['p25']:.3f}-{row['p75']:.3f}, "
             f"{row['low']:.3f}-{row['high']:.3f}) {row['verdict']}")
  return text


def markdown(meta: dict, rows: list[dict]) -> str:
  lines = [f"# pallas_gemm headline: {meta['device']}", "",
           f"jax {meta['jax']}, {meta['date']}, timer: {meta['timer']}, {meta['rounds']} "
           f"rounds x {meta['calls']} calls in rotated order. `x baseline`: the median over "
           "rounds of the baseline's time / pallas_gemm's in the same round (> 1: pallas_gemm "
           "is faster), with the interquartile range and the extremes; parity where |x - 1| "
           "< half the IQR. Errors: relative Frobenius vs float64 (first rows); `wide`: "
           "inputs x * exp(1.5 N(0,1)).", "",
           "| case | baseline ms | pallas_gemm ms | TFLOP/s | x baseline | IQR | min-max "
           "| verdict | err (baseline / ours) | wide err (baseline / ours) |",
           "|---|---:|---:|---:|---:|---|---|---|---|---|"]
  by_case = {}
  for r in rows:
    by_case.setdefault(r["case"], []).append(r)
  for label, mine in by_case.items():
    base = next((r for r in mine if r.get("baseline")), None)
    cand = next((r for r in mine if not r.get("baseline")), None)
    if cand is None or cand["status"] != "ok" or base is None:
      status = cand["status"] if cand else "no result"
      lines.append(f"| {label} | | | | | | | {status} | | |")
      continue
    wide = (f"{base['rel_err_wide']:.1e} / {cand['rel_err_wide']:.1e}"
            if "rel_err_wide" in cand else "")
    lines.append(
        f"| {label} | {base['ms']:.4f} | {cand['ms']:.4f} | {cand['tflops']:.3g} "
        f"| **{cand['ratio']:.3f}** | {cand['p25']:.3f}-{cand['p75']:.3f} "
        f"| {cand['low']:.3f}-{cand['high']:.3f} | {cand['verdict']} "
        f"| {base['rel_err']:.1e} / {cand['rel_err']:.1e} | {wide} |")
  if meta["platform"] != "gpu":
    lines += ["", "CPU: tiny sizes, pallas_gemm's backends as `auto` picks them off a GPU; "
              "the times measure this CPU, not a GPU."]
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path: pathlib.Path) -> bool:
  """Each case's ratio as a bar, the interquartile range and the extremes as error bars."""
  try:
    import matplotlib  # noqa: PLC0415 - optional (the bench extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return False
  timed = [r for r in rows if "ratio" in r]
  if not timed:
    return False
  fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(timed)))
  ys = np.arange(len(timed))[::-1]
  ratios = np.array([r["ratio"] for r in timed])
  ax.barh(ys, ratios, color=["tab:blue" if r["verdict"] == "faster" else "tab:gray"
                             if r["verdict"] == "parity" else "tab:red" for r in timed])
  ax.errorbar(ratios, ys, xerr=[ratios - [r["low"] for r in timed],
                                [r["high"] for r in timed] - ratios],
              fmt="none", ecolor="k", capsize=3, lw=0.8)
  ax.axvline(1.0, color="k", ls=":")
  ax.set_yticks(ys, [r["case"] for r in timed], fontsize=8)
  ax.set_xlabel("speed vs baseline (x), median over rounds; bars: min-max")
  ax.set_title(f"pallas_gemm vs jnp.dot, {meta['device']} (jax {meta['jax']})", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv: list[str], out_dir: pathlib.Path, rounds: int = ROUNDS,
         calls: int = CALLS) -> int:
  on_gpu = jax.default_backend() == "gpu"
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}; headline sweep, {rounds} rounds x {calls} calls"
        + ("" if on_gpu else " (CPU: tiny sizes)"), flush=True)
  rows, timer_name = run(on_gpu, rounds, calls)
  meta = report.run_metadata(dict(timer=timer_name, mode="headline", rounds=rounds,
                                  calls=calls), argv)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "headline.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1,
                                                    default=str))
  text = markdown(meta, rows)
  (out_dir / "headline.md").write_text(text)
  written = ["headline.json", "headline.md"]
  if plot(rows, meta, out_dir / "headline.png"):
    written.append("headline.png")
  print("\n".join(f"wrote {out_dir / name}" for name in written), flush=True)
  print(text, flush=True)
  # The other families' key rows, each from its own benchmark: the grouped GEMM (forward,
  # Mixtral-like), fp8 at 4096^3, and the MoE layer in a training step (fwd+bwd, Qwen3-like)
  # against the unfused layer on the same grouped GEMM and the dense-MLP ceiling.
  # Their tables go to a folder of their own, so that they neither overwrite a full run's
  # of the same day (ragged.json, fp8.json, moe.json) nor are mistaken for one.
  sub = out_dir / FAMILIES_DIR
  for name in ("ragged.json", "fp8.json", "moe.json"):
    (sub / name).unlink(missing_ok=True)  # a failed run leaves no earlier result behind
  runs = [
      (ragged_bench.main, ["--problems", "mixtral", "--modes", "fwd", "--rounds",
                           "5" if on_gpu else "1", "--out", str(sub)]),
      (fp8_bench.main, ["--quick", "--out", str(sub)]),
      (moe.main, ["--configs", "qwen3", "--modes", "fwd+bwd" if on_gpu else "fwd",
                  "--variants", "moe_mlp,unfused/pallas_gemm,dense",
                  "--rounds", "5" if on_gpu else "1", "--out", str(sub)])]
  statuses = []
  for bench_main, bench_args in runs:  # one family's failure leaves the others' rows
    try:
      statuses.append(bench_main(bench_args))
    except Exception as e:  # noqa: BLE001 - reported, and the run's status says so
      print(f"{bench_main.__module__}: failed: {type(e).__name__}: {e}", flush=True)
      statuses.append(1)
  summary = families(sub, rows)
  with open(out_dir / "headline.md", "a") as f:
    f.write("\n" + summary)
  print(summary, flush=True)
  # The baselines' errors are reported, not judged: jnp's bf16 expression rounds z.
  return 1 if any(statuses) or "no result" in summary or any(
      r["status"] != "ok" or (not r.get("baseline") and r["correct"] is False)
      for r in rows) else 0


def _load(path: pathlib.Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def families(out_dir: pathlib.Path, rows: list[dict]) -> str:
  """One line per op family, from this run's tables: the headline cases' ratios to their
  baselines, and the JSON that benchmarks.ragged, .fp8 and .moe wrote into out_dir.
  Ratios are medians of per-round ratios (> 1: pallas_gemm faster), +- half the IQR."""
  def ratio(median, spread=None):
    return f"**{median:.2f}x**" + ("" if spread is None else f" +-{spread:.2f}")

  baseline = {r["case"]: r["variant"] for r in rows if r.get("baseline")}
  dense = [f"{r['case']}: {ratio(r['ratio'], (r['p75'] - r['p25']) / 2)} {baseline[r['case']]}"
           + ("" if r["correct"] else " (WRONG: outside its tolerance)")
           for r in rows if not r.get("baseline") and r["status"] == "ok" and "ratio" in r
           and (r["case"].startswith("bf16") or r["case"].startswith("float32_accurate"))]
  lines = ["| family | key result (this run) |", "|---|---|",
           f"| dense (`gemm`) | {'; '.join(dense) or 'no result'} |"]
  grouped = "no result"
  for res in (_load(out_dir / "ragged.json") or {}).get("results", []):
    mine = res["variants"].get("pallas_gemm", {})
    if res["mode"] == "fwd" and "vs_dense" in mine:
      p = res["problem"]
      grouped = (f"{p['name']} (G {p['g']}, M {p['m']}, K {p['k']}, N {p['n']}) forward: "
                 f"{ratio(mine['vs_dense']['median'], mine['vs_dense']['spread'])} the dense "
                 "GEMM of its FLOPs" + (f", {ratio(mine['vs_lax']['median'])} lax.ragged_dot"
                                       if "vs_lax" in mine else ""))
      break
  lines.append(f"| grouped (`ragged_dot`) | {grouped} |")
  fp8_rows = {}  # each kind's first shape (a CPU smoke run has two)
  for r in (_load(out_dir / "fp8.json") or {}).get("rows", []):
    if "vs_bf16" in r:
      fp8_rows.setdefault(r["impl"], r)
  fp8 = [f"{r['m']}x{r['n']}x{r['k']} {name}: {ratio(r['vs_bf16'], r['vs_bf16_spread'])} bf16"
         " jnp.dot" for name, r in fp8_rows.items()
         if name in ("pallas blocks", "pallas per tensor")]
  lines.append(f"| fp8 (`scaled_matmul`) | {'; '.join(fp8) or 'no result'} |")
  layer = "no result"
  for res in (_load(out_dir / "moe.json") or {}).get("results", []):
    v = res["variants"]
    unfused, dense_ = (v.get(n, {}).get("moe_mlp_speedup") for n in ("unfused/pallas_gemm",
                                                                    "dense"))
    if unfused and dense_:
      layer = (f"{res['config']['name']}-like {res['mode']}: "
               f"{ratio(unfused['median'], unfused['spread'])} the unfused layer on "
               f"ragged_dot, {dense_['median']:.2f} of the dense-MLP ceiling")
  lines.append(f"| MoE layer (`moe_mlp`) | {layer} |")
  return "\n".join(lines) + "\n"
