"""fp8 GEMMs with scales: pallas_gemm.scaled_matmul against JAX's paths, speed and error.

    python -m benchmarks --fp8 [--shapes 4096,8192,4097x4097x4096,...] [--rounds 5]
                               [--calls 10] [--budget-s 480] [--quick] [--out DIR]

Per shape (M, N, K), in the same run, bf16 results:
  bf16 jnp.dot          x (M, K) @ w (K, N) in bf16: the baseline of every ratio;
  fp8 jnp.dot           the per-tensor fp8 values, unscaled, dot with preferred bf16;
  cuBLASLt pattern      dot(a8.astype(bf16) * sa, b8.astype(bf16) * sb), scalar float32
                        scales: XLA's rewrite to one cuBLASLt fp8 GEMM (per tensor); the
                        row says whether the compiled HLO holds that custom call;
  cuBLASLt pattern, constant scales   the same with the scales as Python floats, constants
                        of the compiled program (a program that knows its scales);
  dequant + bf16 dot    1x128 / 128x128 block scales expanded in bf16, then a bf16 dot:
                        the block-scaled path JAX has on Hopper;
  pallas per tensor     scaled_matmul with (1, 1) scales (promoted: f32 every 128 of K);
  pallas per tensor, fast accumulation   the same with Config(fast_accumulation=True):
                        all of K accumulated in the tensor core, as cuBLASLt does (GPU only);
                        the per-tensor rows also give their speed over both cuBLASLt rows;
  pallas blocks         scaled_matmul with 1x128 lhs and 128x128 rhs scales;
  quantize x / w        quantize(x) (1x128) and quantize(w, (128, 128)) from bf16, alone
                        (backend "auto": x through the one-pass Hopper kernel on a GPU);
                        "(xla)": quantize(x) on the xla path, its two passes over x;
  q(x) + pallas         quantize x, then the block-scaled GEMM (pre-quantized weights);
  q(x, w) + pallas      both quantized in the call: a training step's forward GEMM.
Time: CUPTI kernel time on a GPU (wall clock elsewhere), `--rounds` rounds with the
order rotated each round (`timing.rounds_ms`), each round the median of `--calls` calls
over two input sets; the table gives the median over rounds, its spread (half the IQR of
the per-round ratios to bf16 jnp.dot) and TFLOP/s (2MNK / t; the quantize rows' times
are in ms). Error: normwise relative error of the first 256 rows against the float64
product of the dequantized operands each path was given (bf16 output: ~1.1e-3 is bf16's
rounding), plus float32-output errors of the three scaled paths on N(0,1) data and on
"wide" data (each 1x128 block of x and 128x128 block of w scaled by 2^u, u in [-20, 20]).
K stays a multiple of 128 (block scales need K / 128 blocks); the misaligned shapes are
misaligned in M and N (a row of N bf16 results not 16-byte aligned: the output is computed
wider and sliced) and in M alone.
A CPU runs one small shape on the xla backend (the Mosaic kernel's interpreter is not a
timing), as a smoke test of this script.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from benchmarks.timing import Timer, ratio_stats, rounds_ms
from pallas_gemm.testing import reference
from pallas_gemm import quantize, scaled_matmul
from pallas_gemm.fp8 import config as fp8_config, xla as sm_xla

BF16 = jnp.bfloat16
BASE = "bf16 jnp.dot"
CUBLASLT = "cuBLASLt pattern (per tensor)"
CUBLASLT_CONST = "cuBLASLt pattern (per tensor, constant scales)"
FAST = "pallas per tensor, fast accumulation"
# (label, M, N, K). DeepSeek-V3's layer GEMMs at M = 4096 tokens (N x K from its MLA and
# MoE projections, as DeepGEMM benchmarks them).
# In order of importance: a spent --budget-s drops the last.
SHAPES = [("square", 4096, 4096, 4096), ("square", 8192, 8192, 8192),
          ("deepseek-v3", 4096, 7168, 16384), ("deepseek-v3", 4096, 24576, 1536),
          ("deepseek-v3", 4096, 4096, 7168), ("deepseek-v3", 4096, 7168, 2048),
          ("misaligned", 4097, 4097, 4096), ("misaligned rows", 4097, 4096, 4096)]
CPU_SHAPES = [("cpu-smoke", 256, 256, 256), ("cpu-smoke", 200, 136, 384)]
ERROR_ROWS = 256


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks --fp8", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", help="comma-separated N (N^3) or MxNxK; default: the table")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=10, help="timed calls per round (median)")
  # On an H100 the two squares take ~3 minutes and the five other shapes ~4.5.
  p.add_argument("--budget-s", type=float, default=480.0,
                 help="start no new shape after this many seconds")
  p.add_argument("--quick", action="store_true", help="4096^3 only, 3 rounds")
  p.add_argument("--backend", default="auto", help="scaled_matmul's backend")
  p.add_argument("--out", type=pathlib.Path,
                 help="results directory (default: benchmarks/out/<YYYY-MM-DD>-<device>/)")
  return p.parse_args(argv)


def _shapes(spec) -> list[tuple[str, int, int, int]]:
  shapes = []
  for token in spec.split(","):
    dims = [int(d) for d in token.lower().split("x")]
    m, n, k = dims * 3 if len(dims) == 1 else dims
    shapes.append(("custom", m, n, k))
  return shapes


def _dequant_bf16(v8, s, rows: int):
  """v8 (R, K) fp8 with (R', K/128) scales expanded in bf16 (exact: powers of two)."""
  s = jnp.repeat(s.astype(BF16), 128, axis=1)
  if rows > 1:
    s = jnp.repeat(s, rows, axis=0)[:v8.shape[0]]
  return v8.astype(BF16) * s


def constant_pattern(a, b, sa: float, sb: float, out_dtype=BF16):
  """XLA's per-tensor pattern with the scales constants of the program (Python floats:
  weakly typed, so the multiplies stay bf16)."""
  return jax.lax.dot_general(a.astype(BF16) * sa, b.astype(BF16) * sb,
                             (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def _fast_per_tensor(a, b, sa, sb, out_dtype=BF16):
  """scaled_matmul per tensor with fast accumulation, the shape's tiles for it."""
  cfg = fp8_config.default_config(a.shape[0], b.shape[0], a.shape[1], out_dtype=out_dtype,
                                  promoted=False, step_scales=False)
  return scaled_matmul(a, b, sa, sb, preferred_element_type=out_dtype, config=cfg)


def has_fast(backend: str) -> bool:
  """Whether the fast-accumulation row runs: the Mosaic kernel on a GPU (its config is
  the kernel's; on a CPU its interpreter is no timing)."""
  return backend in ("auto", "mosaic") and jax.default_backend() == "gpu"


def implementations(backend: str) -> dict:
  """{label: (jitted fn, names of its inputs)}."""
  sm = functools.partial(scaled_matmul, preferred_element_type=BF16, backend=backend)
  dims = (((1,), (1,)), ((), ()))
  fast = {FAST: (jax.jit(_fast_per_tensor), ("a8t", "b8t", "sat", "sbt"))} if has_fast(
      backend) else {}
  return {
      BASE: (jax.jit(lambda x, wt: jnp.dot(x, wt)), ("x", "wt")),
      "fp8 jnp.dot": (jax.jit(lambda a, b: jax.lax.dot_general(
          a, b, dims, preferred_element_type=BF16)), ("a8t", "b8t")),
      CUBLASLT: (jax.jit(sm_xla.per_tensor_pattern), ("a8t", "b8t", "sat0", "sbt0")),
      CUBLASLT_CONST: (jax.jit(constant_pattern, static_argnums=(2, 3)),
                       ("a8t", "b8t", "sa_float", "sb_float")),
      "dequant + bf16 dot (blocks)": (jax.jit(lambda a, sa, b, sb: jax.lax.dot_general(
          _dequant_bf16(a, sa, 1), _dequant_bf16(b, sb, 128), dims,
          preferred_element_type=BF16)), ("a8", "sa", "b8", "sb")),
      "pallas per tensor": (jax.jit(lambda a, b, sa, sb: sm(a, b, sa, sb)),
                            ("a8t", "b8t", "sat", "sbt")),
      **fast,
      "pallas blocks": (jax.jit(lambda a, b, sa, sb: sm(a, b, sa, sb)),
                        ("a8", "b8", "sa", "sb")),
      "quantize x 1x128": (jax.jit(lambda x: quantize(x)), ("x",)),
      "quantize x 1x128 (xla)": (jax.jit(lambda x: quantize(x, backend="xla")), ("x",)),
      "quantize w 128x128": (jax.jit(lambda w: quantize(w, block_shape=(128, 128))), ("w",)),
      "q(x) + pallas blocks": (jax.jit(lambda x, b, sb: _quantized_gemm(sm, x, b, sb)),
                               ("x", "b8", "sb")),
      "q(x, w) + pallas blocks": (jax.jit(lambda x, w: _quantized_gemm(
          sm, x, *quantize(w, block_shape=(128, 128)))), ("x", "w")),
  }


def _quantized_gemm(sm, x, b8, sb):
  a8, sa = quantize(x)
  return sm(a8, b8, sa, sb)


QUANTIZE_ROWS = ("quantize x 1x128", "quantize x 1x128 (xla)", "quantize w 128x128")


def inputs(m: int, n: int, k: int, seed: int, family: str = "normal") -> dict:
  kx, kw, ksx, ksw = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (m, k), jnp.float32)
  w = jax.random.normal(kw, (n, k), jnp.float32)
  if family == "wide":  # a power-of-two factor per 1x128 block of x, 128x128 block of w
    fx = jnp.exp2(jax.random.randint(ksx, (m, k // 128), -20, 21).astype(jnp.float32))
    fw = jnp.exp2(jax.random.randint(ksw, (-(-n // 128), k // 128), -20, 21).astype(jnp.float32))
    x = x * jnp.repeat(fx, 128, axis=1)
    w = w * jnp.repeat(jnp.repeat(fw, 128, axis=0)[:n], 128, axis=1)
  x, w = x.astype(BF16), w.astype(BF16)
  a8, sa = quantize(x)
  b8, sb = quantize(w, block_shape=(128, 128))
  a8t, sat = quantize(x, block_shape=None)
  b8t, sbt = quantize(w, block_shape=None)
  # XLA's per-tensor pattern takes 0-d scales, reshaped outside its jitted function.
  return dict(x=x, w=w, wt=w.T, a8=a8, sa=sa, b8=b8, sb=sb, a8t=a8t, sat=sat, b8t=b8t, sbt=sbt,
              sat0=sat.reshape(()), sbt0=sbt.reshape(()), sa_float=float(sat[0, 0]),
              sb_float=float(sbt[0, 0]))


def _reference(label: str, d: dict):
  """float64 product of what `label` was given, first ERROR_ROWS rows; None: no product."""
  r = ERROR_ROWS
  if label == BASE:
    return reference.reference(d["x"][:r], d["wt"])
  if label == "fp8 jnp.dot":
    return reference.scaled_reference(d["a8t"][:r], d["b8t"], np.ones((1, 1), np.float32),
                                      np.ones((1, 1), np.float32))
  if "per tensor" in label:
    return reference.scaled_reference(d["a8t"][:r], d["b8t"], d["sat"], d["sbt"])
  if label in QUANTIZE_ROWS:
    return None
  # The block-scaled paths; q(...) quantizes x and w as `inputs` did.
  return reference.scaled_reference(d["a8"][:r], d["b8"], d["sa"][:r], d["sb"])


def f32_paths(backend: str) -> dict:
  """The three scaled paths with float32 results: {label: (jitted fn, input names)}."""
  sm = jax.jit(functools.partial(scaled_matmul, preferred_element_type=jnp.float32,
                                 backend=backend))
  pattern = jax.jit(functools.partial(sm_xla.per_tensor_pattern, out_dtype=jnp.float32))
  constant = jax.jit(functools.partial(constant_pattern, out_dtype=jnp.float32),
                     static_argnums=(2, 3))
  fast = jax.jit(functools.partial(_fast_per_tensor, out_dtype=jnp.float32))
  return {"pallas per tensor": (sm, ("a8t", "b8t", "sat", "sbt")),
          **({FAST: (fast, ("a8t", "b8t", "sat", "sbt"))} if has_fast(backend) else {}),
          "pallas blocks": (sm, ("a8", "b8", "sa", "sb")),
          CUBLASLT: (pattern, ("a8t", "b8t", "sat0", "sbt0")),
          CUBLASLT_CONST: (constant, ("a8t", "b8t", "sa_float", "sb_float"))}


def _f32_errors(paths: dict, d: dict) -> dict:
  """float32-output errors of the scaled paths on d (first ERROR_ROWS rows)."""
  return {label: reference.relative_error(fn(*(d[x] for x in names))[:ERROR_ROWS],
                                          _reference(label, d))
          for label, (fn, names) in paths.items()}


def run_shape(label, m, n, k, args, timer) -> list[dict]:
  flops = 2.0 * m * n * k
  impls = implementations(args.backend)
  sets = [inputs(m, n, k, seed) for seed in (1, 2)]
  fns = {name: fn for name, (fn, _) in impls.items()}
  # Each function takes its own inputs: close over the set index instead of the arrays.
  arg_sets = [(i,) for i in range(len(sets))]
  calls = {name: (lambda i, fn=fn, names=names: fn(*(sets[i][x] for x in names)))
           for name, (fn, names) in impls.items()}
  times = rounds_ms(timer, calls, arg_sets, args.rounds, args.calls)
  wide = inputs(m, n, k, 3, "wide")
  paths = f32_paths(args.backend)
  errors_normal, errors_wide = _f32_errors(paths, sets[0]), _f32_errors(paths, wide)
  rows = []
  for name, (fn, names) in impls.items():
    ms = statistics.median(times[name])
    row = dict(shape=label, m=m, n=n, k=k, impl=name, ms=ms, round_ms=times[name])
    if name not in QUANTIZE_ROWS:
      row["tflops"] = flops / ms / 1e9
      ratio = ratio_stats(times[BASE], times[name])
      row.update(vs_bf16=ratio.median, vs_bf16_spread=ratio.spread)
      ref = _reference(name, sets[0])
      row["relerr_bf16_out"] = reference.relative_error(
          fns[name](*(sets[0][x] for x in names))[:ERROR_ROWS], ref)
    if name in errors_normal:
      row.update(relerr_f32_normal=errors_normal[name], relerr_f32_wide=errors_wide[name])
    if name.startswith("pallas per tensor"):  # > 1: faster than cuBLASLt's pattern
      for key, other in (("vs_cublaslt", CUBLASLT), ("vs_cublaslt_constant", CUBLASLT_CONST)):
        r = ratio_stats(times[other], times[name])
        row.update({key: r.median, f"{key}_spread": r.spread})
    if name in (CUBLASLT, CUBLASLT_CONST):  # whether XLA made it one cuBLASLt fp8 GEMM
      hlo = fns[name].lower(*(sets[0][x] for x in names)).compile().as_text()
      row["cublaslt_fp8_in_hlo"] = sm_xla.is_cublaslt_fp8(hlo)
    rows.append(row)
    print(_line(row), flush=True)
  return rows


def _line(row) -> str:
  shape = f"{row['m']}x{row['n']}x{row['k']}"
  text = f"{shape:17s} {row['impl']:30s} {row['ms']:8.3f} ms"
  if "tflops" in row:
    text += (f" {row['tflops']:7.1f} TFLOP/s {row['vs_bf16']:5.2f}x bf16"
             f" (+-{row['vs_bf16_spread']:.2f})  err {row['relerr_bf16_out']:.1e}")
  if "relerr_f32_normal" in row:
    text += f"  f32-out err {row['relerr_f32_normal']:.1e} (wide {row['relerr_f32_wide']:.1e})"
  if "cublaslt_fp8_in_hlo" in row:
    text += f"  cublas$lt$matmul$f8 in HLO: {row['cublaslt_fp8_in_hlo']}"
  if "vs_cublaslt" in row:
    text += (f"  x cuBLASLt {row['vs_cublaslt']:.2f} (+-{row['vs_cublaslt_spread']:.2f}),"
             f" constant scales {row['vs_cublaslt_constant']:.2f}"
             f" (+-{row['vs_cublaslt_constant_spread']:.2f})")
  return text


def markdown(rows, meta) -> str:
  lines = [f"# fp8 GEMMs: {meta['device']}, jax {meta['jax']}, timer {meta['timer']}", "",
           f"`{meta['command']}`; {meta['rounds']} rounds x {meta['calls']} calls, bf16 "
           "results; ratio = bf16 jnp.dot's time / this one's (median over rounds, +- half "
           "the IQR); errors vs float64 of the dequantized operands, first 256 rows.", "",
           "| shape | path | ms | TFLOP/s | x bf16 dot | x cuBLASLt (scales traced / constant) "
           "| err (bf16 out) | err f32 out: N(0,1) | wide |", "|---" * 9 + "|"]
  for r in rows:
    shape = f"{r['m']}x{r['n']}x{r['k']} {r['shape']}"
    impl = r["impl"] + ({True: " [cuBLASLt fp8]", False: " [NOT rewritten to cuBLASLt"
                          " fp8]"}[r["cublaslt_fp8_in_hlo"]] if "cublaslt_fp8_in_hlo" in r
                         else "")
    cells = [shape, impl, f"{r['ms']:.3f}"]
    if "tflops" in r:
      cells += [f"{r['tflops']:.0f}", f"{r['vs_bf16']:.2f} +- {r['vs_bf16_spread']:.2f}",
                (f"{r['vs_cublaslt']:.2f} / {r['vs_cublaslt_constant']:.2f}"
                 if "vs_cublaslt" in r else ""), f"{r['relerr_bf16_out']:.1e}"]
    else:
      cells += ["", "", "", ""]
    cells += ([f"{r['relerr_f32_normal']:.1e}", f"{r['relerr_f32_wide']:.1e}"]
              if "relerr_f32_normal" in r else ["", ""])
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  args = argv if isinstance(argv, argparse.Namespace) else parse_args(
      list(sys.argv[1:] if argv is None else argv))
  on_gpu = jax.default_backend() == "gpu"
  device = jax.devices()[0].device_kind
  print(f"device: {device} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
  if args.shapes:
    shapes = _shapes(args.shapes)
  elif not on_gpu:
    shapes = CPU_SHAPES
    print("no GPU: a smoke run at small shapes, scaled_matmul on its xla backend (the Mosaic"
          " kernel's interpreter is no timing); the table's shapes need a GPU", flush=True)
  else:
    shapes = SHAPES[:1] if args.quick else SHAPES
  rounds = 3 if args.quick or not on_gpu else args.rounds
  args.rounds, args.calls = rounds, (args.calls if on_gpu else 2)
  timer = Timer()
  start, rows, skipped = time.perf_counter(), [], []
  for label, m, n, k in shapes:
    if time.perf_counter() - start > args.budget_s:
      skipped.append(f"{m}x{n}x{k}")
      continue
    rows += run_shape(label, m, n, k, args, timer)
  if skipped:
    print(f"budget of {args.budget_s:.0f} s spent: skipped {', '.join(skipped)}", flush=True)
  meta = dict(device=device, jax=jax.__version__, timer=timer.name, rounds=rounds,
              calls=args.calls, command="python -m benchmarks --fp8 " + " ".join(
                  sys.argv[2:] if argv is None else [] if isinstance(argv, argparse.Namespace)
                  else argv), skipped=skipped, seconds=time.perf_counter() - start)
  text = markdown(rows, meta)
  out = args.out or report.results_dir(device_kind=device)
  out.mkdir(parents=True, exist_ok=True)
  (out / "fp8.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / "fp8.md").write_text(text)
  print(f"wrote {out / 'fp8.json'}, {out / 'fp8.md'}", flush=True)
  print(report.describe_dir(out), flush=True)
  print(text, flush=True)  # the short table last
  return 0


if __name__ == "__main__":
  sys.exit(main())
