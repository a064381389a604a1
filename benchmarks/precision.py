"""float32 GEMM precisions: speed and error of every DotAlgorithmPreset, gemm vs jnp.dot.

    python -m benchmarks --precision [--quick] [--shapes 4096,8192,4097] [--out DIR]
                                     [--split-configs BMxBNxBK/STAGES[/cm2][/cn2][/wgm|/wgn][/epiN],...]

For each square shape: jnp.dot at HIGHEST (IEEE SGEMM, the baseline), then for each
precision (the float32 presets and "float32_accurate") jnp.dot with that preset beside
gemm(precision=...) (backend auto). Time: CUPTI device time on a GPU (wall clock
elsewhere), median over calls that rotate three input sets (beyond L2). Error: relative
Frobenius and max elementwise error (over max |C|) of the first rows against float64,
on N(0,1) inputs and on wide-range inputs x * exp(1.5 * N(0,1)). --split-configs adds
rows of the mosaic split kernel with other tiles. Writes precision.json and a
speed-vs-error plot (precision.png, with matplotlib) to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import pallas_gemm
from benchmarks.timing import Timer
from pallas_gemm.matmul import mosaic
from pallas_gemm.core import precision as P
from pallas_gemm.testing.reference import input_family

Preset = jax.lax.DotAlgorithmPreset
PRECISIONS = (Preset.TF32_TF32_F32, Preset.TF32_TF32_F32_X3, Preset.BF16_BF16_F32,
              Preset.BF16_BF16_F32_X3, Preset.BF16_BF16_F32_X6, Preset.BF16_BF16_F32_X9,
              P.FLOAT32_ACCURATE, P.FLOAT32_F16X3)
ERR_ROWS = 256


def _name(precision) -> str:
  return getattr(precision, "name", str(precision))


def family(kind: str, shape, seed: int, operand: str = "a") -> np.ndarray:
  """reference.input_family's inputs (those of tests/test_precision.py), seeded."""
  return input_family(kind, np.random.default_rng(seed), shape, operand)


def errors(out, a, b) -> tuple[float, float]:
  rows = min(ERR_ROWS, a.shape[0])
  ref = a[:rows].astype(np.float64) @ b.astype(np.float64)
  got = np.asarray(out[:rows], np.float64)
  return (float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
          float(np.abs(got - ref).max() / np.abs(ref).max()))


def _jnp_dot(precision):
  return jax.jit(lambda a, b: jnp.dot(a, b, precision=precision))


def _gemm(precision, config=None):
  backend = "mosaic" if config is not None else "auto"
  return jax.jit(lambda a, b: pallas_gemm.gemm(a, b, precision=precision, backend=backend,
                                               config=config))


def split_config(n: int, spec: str, precision=P.FLOAT32_ACCURATE):
  """A mosaic config for the FP32 split from BMxBNxBK/STAGES[/cm2][/cn2][/wgm|/wgn][/epiN]:
  the default's other fields, one consumer warpgroup per 64 rows (or 128 columns) of the
  split dimension, at most two. Raises ValueError for a config the kernel cannot run."""
  tile, stages, *opts = spec.split("/")
  bm, bn, bk = (int(x) for x in tile.split("x"))
  cfg = mosaic.default_config(n, n, n, jnp.float32, precision=precision)
  wg_split = "n" if "wgn" in opts else "m" if "wgm" in opts else cfg.wg_split
  wgs = min(2, bm // 64) if wg_split == "m" else min(2, bn // 128)
  epi = [int(o[3:]) for o in opts if o.startswith("epi")]
  cfg = cfg.replace(block_m=bm, block_n=bn, block_k=bk, stages=int(stages),
                    num_compute_wgs=max(1, wgs), wg_split=wg_split,
                    cluster_m=2 if "cm2" in opts else 1, cluster_n=2 if "cn2" in opts else 1,
                    epi_block_n=epi[0] if epi else cfg.epi_block_n)
  mosaic.check_fits(cfg, jnp.float32, jnp.float32, None, n, precision)
  return cfg


def run(shapes, split_configs, iterations: int, precisions=PRECISIONS) -> list[dict]:
  timer = Timer()
  rows = []
  for n in shapes:
    flops = 2.0 * n ** 3
    inputs = {kind: (family(kind, (n, n), 1), family(kind, (n, n), 2, "b"))
              for kind in ("normal", "wide", "range")}
    arg_sets = [tuple(jnp.asarray(family("normal", (n, n), s + i)) for s in (10, 20))
                for i in range(3)]

    def measure(label, impl, precision, fn, base=None):
      try:
        t = timer.measure(fn, arg_sets, iterations)
      except Exception as e:  # noqa: BLE001 - a precision a backend refuses: say why
        print(f"{n:6d} {label:34s} unavailable: {type(e).__name__}: {str(e)[:150]}", flush=True)
        rows.append(dict(n=n, label=label, impl=impl, precision=_name(precision),
                         error=f"{type(e).__name__}: {e}"))
        return None
      row = dict(n=n, label=label, impl=impl, precision=_name(precision),
                 ms=t.median_ms, tflops=flops / t.median_ms / 1e9)
      for kind, (a, b) in inputs.items():
        row[f"relerr_{kind}"], row[f"maxerr_{kind}"] = errors(
            fn(jnp.asarray(a), jnp.asarray(b)), a, b)
      if base is not None:
        row["vs_sgemm"] = base["ms"] / row["ms"]
      rows.append(row)
      print(f"{n:6d} {label:34s} {row['tflops']:7.1f} TFLOP/s"
            + (f" {row['vs_sgemm']:5.2f}x SGEMM" if base else " " * 12)
            + f"  relerr {row['relerr_normal']:.2e} (wide {row['relerr_wide']:.2e},"
            f" range {row['relerr_range']:.2e})"
            f"  max {row['maxerr_normal']:.1e}", flush=True)
      return row

    sgemm = measure("jnp.dot HIGHEST", "jnp.dot", jax.lax.Precision.HIGHEST,
                    _jnp_dot(jax.lax.Precision.HIGHEST))
    for precision in precisions:
      ref = None
      if isinstance(precision, Preset):
        ref = measure(f"jnp.dot {_name(precision)}", "jnp.dot", precision,
                      _jnp_dot(precision), sgemm)
      variants = [("gemm", _gemm(precision))]
      if isinstance(precision, Preset) and P.split_of(precision, jnp.float32) is not None:
        # The mosaic kernel's bf16 pieces beside auto's choice: what auto's rule rests on.
        cfg = mosaic.default_config(n, n, n, jnp.float32, precision=precision)
        variants.append(("mosaic", _gemm(precision, cfg)))
      for label, fn in variants:
        row = measure(f"{label} {_name(precision)}", "gemm", precision, fn, sgemm)
        if row is not None and ref is not None and "ms" in ref:
          row["vs_jnp_dot_same_preset"] = ref["ms"] / row["ms"]
          print(f"{'':6s} {'':34s} {row['vs_jnp_dot_same_preset']:.2f}x jnp.dot with the same"
                " preset", flush=True)
    own = [x for x in (P.FLOAT32_ACCURATE, P.FLOAT32_F16X3) if x in precisions]
    for precision, spec in ((x, spec) for x in own for spec in split_configs):
      label = f"mosaic {precision} {spec}"
      try:
        cfg = split_config(n, spec, precision)
      except ValueError as e:
        print(f"{n:6d} {label:34s} invalid: {str(e)[:150]}", flush=True)
        rows.append(dict(n=n, label=label, impl="gemm", precision=precision,
                         error=f"ValueError: {e}"))
        continue
      measure(label, "gemm", precision, _gemm(precision, cfg), sgemm)
  return rows


def plot(rows, path: pathlib.Path) -> bool:
  try:
    import matplotlib  # noqa: PLC0415 - optional (the bench extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return False
  sizes = sorted({r["n"] for r in rows})
  fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
  for ax, n in zip(axes[0], sizes):
    for r in rows:
      if r["n"] != n or "ms" not in r:
        continue
      marker = "o" if r["impl"] == "gemm" else "s"
      color = "tab:red" if r["impl"] == "gemm" else "tab:gray"
      ax.scatter(r["relerr_normal"], r["tflops"], marker=marker, color=color)
      ax.annotate(r["label"].replace("jnp.dot ", "dot ").replace("_BF16_F32", "")
                  .replace("_TF32_F32", ""), (r["relerr_normal"], r["tflops"]),
                  fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("relative Frobenius error vs float64 (N(0,1) inputs)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"float32 {n}^3: gemm (red) vs jnp.dot (gray)")
    ax.grid(True, alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks --precision")
  p.add_argument("--quick", action="store_true", help="small shapes (a CPU can run them)")
  p.add_argument("--shapes", help="comma-separated square sizes (default 4096,8192,4097)")
  p.add_argument("--split-configs", default="",
                 help="extra mosaic split tiles, e.g. 128x128x32/4/epi32,64x256x32/3/wgn/epi32")
  p.add_argument("--precisions", help="comma-separated subset of: "
                 + ", ".join(_name(x) for x in PRECISIONS))
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--out", type=pathlib.Path)
  args = p.parse_args(argv)
  device = jax.devices()[0].device_kind
  print(f"device: {device}, jax {jax.__version__}", flush=True)
  if args.shapes:
    shapes = [int(s) for s in args.shapes.split(",")]
  else:
    shapes = [128, 129] if args.quick else [4096, 8192, 4097]
  split_configs = [s for s in args.split_configs.split(",") if s]
  precisions = PRECISIONS
  if args.precisions:
    names = args.precisions.split(",")
    precisions = [x for x in PRECISIONS if _name(x) in names]
  rows = run(shapes, split_configs, 3 if args.quick else args.iterations, precisions)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "precision.json").write_text(json.dumps(
        dict(device=device, jax=jax.__version__, rows=rows), indent=1))
    if plot(rows, args.out / "precision.png"):
      print(f"plot: {args.out / 'precision.png'}")
  return 0
