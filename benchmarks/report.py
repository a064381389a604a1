"""Results out: results.json (everything), results.md (the table), PNG plots (if matplotlib).

A row that failed its correctness check keeps its timing (so a fast-but-wrong kernel is
visible) but is marked WRONG and never counts as a win in the summary.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import re

import jax
import numpy as np

from benchmarks import shapes as shapes_lib
from benchmarks.runner import DOT, geomean

# Dated records, committed with a README that says what they show (--record writes here).
RECORDS_DIR = pathlib.Path(__file__).parent / "results"
# Every other run without --out: git-ignored, so a run leaves the working tree clean.
SCRATCH_DIR = pathlib.Path(__file__).parent / "out"


def device_name(device_kind: str) -> str:
  """The short device name of a results folder: "NVIDIA H100 80GB HBM3" -> "h100".

  The model is the first word that runs letters into digits (h100, a100, t4); a kind without
  one ("cpu", "GeForce RTX 4090") keeps all its words.
  """
  words = [w for w in re.split(r"[^a-z0-9]+", device_kind.lower()) if w and w != "nvidia"]
  model = next((w for w in words if re.fullmatch(r"[a-z]+[0-9]+[a-z]*", w)), None)
  return model or "-".join(words) or "device"


def results_dir(record: bool = False, device_kind: str | None = None,
                day: datetime.date | None = None) -> pathlib.Path:
  """<RECORDS_DIR or SCRATCH_DIR>/<YYYY-MM-DD>-<device>/: one folder per day and device, so
  the modes run on one day (results.json, headline.json, mlp.json, ...) share it."""
  kind = jax.devices()[0].device_kind if device_kind is None else device_kind
  day = datetime.date.today() if day is None else day
  return (RECORDS_DIR if record else SCRATCH_DIR) / f"{day.isoformat()}-{device_name(kind)}"


def describe_dir(path: pathlib.Path) -> str:
  """Where a run's files went, in words a reader can act on."""
  shown = _relative(path)
  if path.resolve().is_relative_to(SCRATCH_DIR.resolve()):
    return (f"results in {shown}/ (git-ignored; --record writes a dated record to "
            f"{_relative(RECORDS_DIR)}/ instead)")
  if path.resolve().is_relative_to(RECORDS_DIR.resolve()):
    return f"results in {shown}/ (a dated record: add a README.md before committing it)"
  return f"results in {shown}/"


def _relative(path: pathlib.Path) -> str:
  try:
    return str(path.resolve().relative_to(pathlib.Path.cwd()))
  except ValueError:
    return str(path)


def run_metadata(info: dict, argv: list[str]) -> dict:
  device = jax.devices()[0]
  return dict(device=device.device_kind, platform=device.platform,
              device_count=jax.device_count(), jax=jax.__version__,
              jaxlib=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
              python=platform.python_version(),
              date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              argv=argv, flops="2*M*N*K*batch", **info)


def _jaxlib_version():
  try:
    import jaxlib  # noqa: PLC0415
    return jaxlib.__version__
  except Exception:  # noqa: BLE001
    return None


def _fmt_config(config) -> str:
  if not config:
    return ""
  return " ".join(f"{k}={v}" for k, v in config.items() if v is not None)


def _fmt(x, spec):
  return "" if x is None else format(x, spec)


def markdown(meta: dict, rows: list[dict], autotune_rows: list[dict] | None = None) -> str:
  lines = [f"# pallas_gemm benchmark: {meta['device']}", "",
           f"jax {meta['jax']}, {meta['date']}, timer: {meta['timer']}. "
           f"TFLOP/s = 2*M*N*K*batch / median time. `vs jnp.dot` > 1 means faster than "
           f"jnp.dot (same precision and output dtype, same run).", ""]
  if rows:
    lines += ["| category | shape (BxMxNxK) | dtype | backend | median ms | min ms | TFLOP/s "
              "| vs jnp.dot | rel err | check | config |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
      check = {None: "-", True: "ok", False: "**WRONG**"}[r["correct"]]
      if r["status"] != "ok" and r["status"] != "WRONG":
        check = r["status"]
      lines.append(
          f"| {r['category']} | {r['shape']} | {r['variant']} | {r['backend']} "
          f"| {_fmt(r['median_ms'], '.4f')} | {_fmt(r['min_ms'], '.4f')} "
          f"| {_fmt(r['tflops'], '.2f')} | {_fmt(r['ratio_vs_dot'], '.2f')} "
          f"| {_fmt(r['rel_err'], '.1e')} | {check} | {_fmt_config(r['config'])} |")
    lines += ["", "## Summary (correct rows only)", "",
              "| backend | rows | wins vs jnp.dot | geomean vs jnp.dot | wrong | errors | n/a |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for backend in dict.fromkeys(r["backend"] for r in rows):
      mine = [r for r in rows if r["backend"] == backend]
      good = [r for r in mine if r["median_ms"] is not None and r["correct"] is not False]
      wins = sum(1 for r in good if (r["ratio_vs_dot"] or 0) > 1.0)
      gm = geomean([r["ratio_vs_dot"] for r in good])
      lines.append(
          f"| {backend} | {len(good)} | {'-' if backend == DOT else wins} | {_fmt(gm, '.3f')} "
          f"| {sum(r['correct'] is False for r in mine)} "
          f"| {sum(r['status'].startswith('error') for r in mine)} "
          f"| {sum(r['status'].startswith('n/a') for r in mine)} |")
  if meta.get("skipped_for_budget"):
    lines += ["", f"**{meta['skipped_for_budget']} measurements skipped: time budget "
              f"(--budget-s) exhausted.**"]
  if meta.get("interpret_max_flops"):
    lines += ["", f"CPU run: Pallas backends (interpret mode) timed only for shapes of at most "
              f"{meta['interpret_max_flops']:.2e} FLOP; their times measure the interpreter, "
              "not a GPU."]
  if autotune_rows:
    lines += ["", "## Autotune gain (tuned config vs default_config)", "",
              "| backend | shape | dtype | default ms | tuned ms | gain | tuned config | status |",
              "|---|---|---|---:|---:|---:|---|---|"]
    for r in autotune_rows:
      lines.append(f"| {r['backend']} | {r['shape']} | {r['variant']} "
                   f"| {_fmt(r['default_ms'], '.4f')} | {_fmt(r['tuned_ms'], '.4f')} "
                   f"| {_fmt(r['gain'], '.3f')} | {_fmt_config(r['tuned_config'])} "
                   f"| {r['status']} |")
  return "\n".join(lines) + "\n"


def write_all(out_dir: pathlib.Path, meta: dict, rows: list[dict],
              autotune_rows: list[dict] | None = None) -> tuple[str, list[pathlib.Path]]:
  """Writes results.json, results.md and plots; returns (markdown text, written paths)."""
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  path = out_dir / "results.json"
  path.write_text(json.dumps(dict(meta=meta, rows=rows, autotune=autotune_rows or []),
                             indent=1, default=str))
  written.append(path)
  text = markdown(meta, rows, autotune_rows)
  path = out_dir / "results.md"
  path.write_text(text)
  written.append(path)
  written += plots(out_dir, meta, rows)
  return text, written


def plots(out_dir: pathlib.Path, meta: dict, rows: list[dict]) -> list[pathlib.Path]:
  """Per dtype variant: TFLOP/s vs square size (with the H100/H200 peak) and ratio to jnp.dot."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print("plots skipped: matplotlib is not installed (pip install matplotlib)", flush=True)
    return []
  hopper = any(name in meta["device"] for name in ("H100", "H200", "H800"))
  written = []
  square = [r for r in rows if r["category"].startswith("square") and r["tflops"] is not None
            and r["correct"] is not False]
  for variant in dict.fromkeys(r["variant"] for r in square):
    mine = [r for r in square if r["variant"] == variant]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 4.5))
    for backend in dict.fromkeys(r["backend"] for r in mine):
      pts = sorted((r["m"], r["tflops"], r["ratio_vs_dot"]) for r in mine
                   if r["backend"] == backend)
      ax_t.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
      ratio = [(p[0], p[2]) for p in pts if p[2] is not None]
      ax_r.plot([p[0] for p in ratio], [p[1] for p in ratio], marker="o", label=backend)
    peak = shapes_lib.DTYPES[variant].peak_label
    if hopper:
      ax_t.axhline(shapes_lib.PEAK_TFLOPS[peak], color="k", ls="--",
                   label=f"{peak} dense peak {shapes_lib.PEAK_TFLOPS[peak]:.0f}")
    ax_r.axhline(1.0, color="k", ls=":")
    for ax, ylabel in ((ax_t, "TFLOP/s"), (ax_r, "speed vs jnp.dot (x)")):
      ax.set_xscale("log", base=2)
      ax.set_xlabel("M = N = K")
      ax.set_ylabel(ylabel)
      ax.grid(True, alpha=0.3)
      ax.legend(fontsize=8)
    fig.suptitle(f"{variant} square GEMM on {meta['device']} (jax {meta['jax']}, "
                 f"{meta['timer'].split(' (')[0]})")
    fig.tight_layout()
    path = out_dir / f"square_{variant}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  # Every shape's ratio in one bar chart per variant: the non-square regimes live here.
  timed = [r for r in rows if r["ratio_vs_dot"] is not None and r["backend"] != DOT
           and r["correct"] is not False]
  for variant in dict.fromkeys(r["variant"] for r in timed):
    mine = [r for r in timed if r["variant"] == variant]
    labels = list(dict.fromkeys(f"{r['category']}\n{r['shape']}" for r in mine))
    backends = list(dict.fromkeys(r["backend"] for r in mine))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(labels) * len(backends)), 4.5))
    width = 0.8 / max(len(backends), 1)
    for j, backend in enumerate(backends):
      vals = {f"{r['category']}\n{r['shape']}": r["ratio_vs_dot"] for r in mine
              if r["backend"] == backend}
      xs = [i + j * width for i, lab in enumerate(labels) if lab in vals]
      ax.bar(xs, [vals[lab] for lab in labels if lab in vals], width, label=backend)
    ax.axhline(1.0, color="k", ls=":")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=6,
                  rotation=90)
    ax.set_ylabel("speed vs jnp.dot (x)")
    ax.set_title(f"{variant}: all shapes, {meta['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"ratio_{variant}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  summary_path = summary(out_dir, meta, rows)
  if summary_path is not None:
    written.append(summary_path)
  return written


def summary(out_dir: pathlib.Path, meta: dict, rows: list[dict]) -> pathlib.Path | None:
  """One figure for the whole run: a heatmap of shapes (rows, grouped by category) by dtype
  variant (columns); each cell is the fastest correct backend's speed vs jnp.dot, colored
  around 1.0 (red: slower, blue: faster), and names that backend."""
  import matplotlib  # noqa: PLC0415 - plots() checked that it is installed
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  from matplotlib.colors import TwoSlopeNorm  # noqa: PLC0415

  timed = [r for r in rows if r.get("ratio_vs_dot") is not None and r["backend"] != DOT
           and r.get("correct") is not False]
  if not timed:
    return None
  shapes = list(dict.fromkeys((r["category"], r["shape"]) for r in timed))
  variants = list(dict.fromkeys(r["variant"] for r in timed))
  best = {}
  for r in timed:
    key = (r["category"], r["shape"], r["variant"])
    if key not in best or r["ratio_vs_dot"] > best[key]["ratio_vs_dot"]:
      best[key] = r
  grid = np.full((len(shapes), len(variants)), np.nan)
  for i, (cat, shape) in enumerate(shapes):
    for j, variant in enumerate(variants):
      if (cat, shape, variant) in best:
        grid[i, j] = best[(cat, shape, variant)]["ratio_vs_dot"]
  fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(variants), 1.2 + 0.28 * len(shapes)))
  high = max(2.0, float(np.nanmax(grid)))
  image = ax.imshow(grid, cmap="RdBu", aspect="auto",
                    norm=TwoSlopeNorm(vcenter=1.0, vmin=min(0.5, float(np.nanmin(grid))),
                                      vmax=high))
  for i, (cat, shape) in enumerate(shapes):
    for j, variant in enumerate(variants):
      r = best.get((cat, shape, variant))
      if r is not None:
        dark = not 0.6 < r["ratio_vs_dot"] < 2.0
        ax.text(j, i, f"{r['ratio_vs_dot']:.2f}x {r['backend']}", ha="center", va="center",
                fontsize=7, color="white" if dark else "black")
  ax.set_xticks(range(len(variants)), variants)
  ax.set_yticks(range(len(shapes)), [f"{cat}: {shape}" for cat, shape in shapes], fontsize=7)
  ax.xaxis.tick_top()
  fig.colorbar(image, ax=ax, label="best backend vs jnp.dot (x)", shrink=0.5)
  ax.set_title(f"fastest pallas_gemm backend vs jnp.dot, {meta['device']} (jax {meta['jax']})",
               fontsize=9, pad=24)
  fig.tight_layout()
  path = out_dir / "summary.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


if __name__ == "__main__":  # python -m benchmarks.report results.json: redraw the figures
  import sys  # noqa: PLC0415

  source = pathlib.Path(sys.argv[1])
  data = json.loads(source.read_text())
  for written in plots(source.parent, data["meta"], data["rows"]):
    print(written)
