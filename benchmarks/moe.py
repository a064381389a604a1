"""The MoE layer: `pallas_gemm.moe_mlp` against the same layer written as users write it
on a grouped GEMM, and against a dense MLP of the same FLOPs (its ceiling).

    python -m benchmarks --moe                     # every config; tiny ones on a CPU
    python -m benchmarks --moe --configs qwen3,decode-qwen3 --modes fwd
    python -m benchmarks --moe --expert-parallel   # over several devices: moe_parallel.py

Variants, each given the same routing (topk weights and ids: the router is not timed):
  moe_mlp           pallas_gemm.moe_mlp (sort, gathers, grouped GEMMs; its own gradients)
  moe_mlp/two-pass  the same layer with its first grouped GEMM and SwiGLU as two passes
                    (grouped GEMM writing h, then an elementwise pass) instead of the gated
                    kernel, where that runs
  moe_mlp/fp8       moe_mlp's fp8 inference form (fwd only): expert weights quantized once
                    outside the timed call (`moe.quantize_experts`), activations in the call
  moe_mlp/fp8-3pass the same fp8 form with its first GEMM, activation and quantize of a as
                    three passes instead of the fused fp8 gated kernel, where that runs
  moe_mlp/fp8-train moe_mlp(precision="fp8"): bf16 master weights quantized in the call,
                    forward and input gradients in fp8, weight gradients in bf16
  moe_mlp/fp8-train-cached  the same with the weights quantized once, before timing
                    (`moe.quantize_experts_for_training`, passed as fp8_weights): a
                    microbatch's layer when the optimizer step quantizes them for all
  unfused/<gemm>    MaxText-style: argsort by expert, x repeated and permuted, three grouped
                    GEMMs with SwiGLU between them, the rows unsorted by a scatter and
                    combined with the weights; jax.grad of that; <gemm> is pallas_gemm's
                    ragged_dot, tokamax's (when importable) or jax.lax.ragged_dot
  dense             T * k rows through (D, 2F) and (F, D) with jnp.dot and SwiGLU between:
                    the same FLOPs with no routing, the layer's ceiling
Modes: fwd, and fwd+bwd (jax.vjp of the layer with a random cotangent, the forward's
output kept live; gradients in x, the weights, w_gate_up and w_down).
Timing: wall clock of back-to-back jitted calls (a layer is many kernels; their launch
gaps are its cost too), rounds in rotated order, median per round; ratios per round
against moe_mlp (median and half the interquartile range). Decode configs also report
the HBM roofline of the expert weights they read, and every variant XLA's temporary bytes.
A decode call is a fraction of a millisecond, and a round's first launch (on the H200
about 0.3 ms from the host's first call to its first kernel) would be a fifth of five
calls' time: a decode round runs as many calls as DECODE_ROUND_MS of its roofline takes
(about 200 at Qwen3-like sizes, where that launch is then under 2 us a call; a model's
decode step runs one MoE layer per block, back to back), unless --calls says.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp

from benchmarks.ragged import import_tokamax
from benchmarks.timing import PipelinedTimer, ratio_stats, rounds_ms
from pallas_gemm import moe_mlp, ragged_dot
from pallas_gemm.moe import (fp8 as moe_fp8, layer as moe_layer, quantize_experts,
                             quantize_experts_for_training, softmax_topk)

MODES = ("fwd", "fwd+bwd")
DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Config:
  name: str
  tokens: int
  d_model: int
  d_ff: int
  experts: int
  top_k: int

  @property
  def flops(self) -> float:
    """Forward FLOPs of the experts' GEMMs: T * k rows through (D, 2F) and (F, D)."""
    return 2.0 * self.tokens * self.top_k * self.d_model * 3 * self.d_ff

  def weight_bytes(self) -> int:
    return self.experts * 3 * self.d_model * self.d_ff * jnp.dtype(DTYPE).itemsize


CONFIGS = {c.name: c for c in (
    Config("mixtral", 8192, 4096, 14336, 8, 2),
    Config("deepseek-v3", 8192, 7168, 2048, 256, 8),
    Config("qwen3", 8192, 2048, 768, 128, 8),
    Config("gpt-oss", 8192, 2880, 2880, 128, 4),
    Config("decode-qwen3", 128, 2048, 768, 128, 8),
    Config("decode-deepseek-v3", 128, 7168, 2048, 256, 8),
)}
TINY = dict(tokens=64, d_model=128, d_ff=128, experts=8)  # K multiples of 128 for fp8
# Peak HBM bandwidth (bytes/s) by device kind, for the decode roofline.
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}
DECODE_ROUND_MS = 50  # a decode round's calls: this much of its roofline (module docstring)


def decode_calls(roofline: float | None) -> int:
  """Calls per round of a decode config: DECODE_ROUND_MS of its roofline, 10 to 400."""
  return 40 if roofline is None else int(min(400, max(10, -(-DECODE_ROUND_MS // roofline))))


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks --moe", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--configs", default=",".join(CONFIGS),
                 help=f"comma-separated names from {list(CONFIGS)}")
  p.add_argument("--modes", default=",".join(MODES), help="fwd, fwd+bwd")
  p.add_argument("--variants", default=None,
                 help="comma-separated subset of moe_mlp, moe_mlp/two-pass, moe_mlp/fp8,"
                      " moe_mlp/fp8-3pass, moe_mlp/fp8-train, moe_mlp/fp8-train-cached,"
                      " unfused/pallas_gemm, unfused/tokamax, unfused/lax, dense (default: all"
                      " that can run)")
  p.add_argument("--rounds", type=int, default=None, help="rounds (GPU 7, CPU 2)")
  p.add_argument("--calls", type=int, default=None,
                 help=f"calls per round (GPU 5, decode configs {DECODE_ROUND_MS} ms of their"
                      " roofline; CPU 1)")
  p.add_argument("--kernels", action="store_true",
                 help="GPU: also each variant's kernels by name (CUPTI), against its wall clock")
  p.add_argument("--out", type=pathlib.Path, default=None)
  p.add_argument("--expert-parallel", action="store_true",
                 help="the expert-parallel layer over 1, 2, 4, ... devices instead; its own"
                      " options: python -m benchmarks --moe --expert-parallel --help")
  return p.parse_args(argv)


def _options(args) -> argparse.Namespace:
  if args is None or isinstance(args, (list, tuple)):
    return parse_args(list(args or []))
  defaults = vars(parse_args([]))
  return argparse.Namespace(**{k: getattr(args, k, v) for k, v in defaults.items()})


# ----------------------------------------------------------------------------- variants


def unfused(ragged, x, topk_weights, topk_ids, w_gate_up, w_down):
  """The layer as a MaxText-style block writes it (module docstring)."""
  t, k = topk_ids.shape
  e, f = w_down.shape[0], w_down.shape[1]
  flat = topk_ids.reshape(-1)
  order = jnp.argsort(flat)
  group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  rows = x[order // k]
  h = ragged(rows, w_gate_up, group_sizes)
  a = jax.nn.silu(h[:, :f]) * h[:, f:]
  y = ragged(a, w_down, group_sizes)
  unsorted = jnp.zeros_like(y).at[order].set(y)
  return jnp.einsum("tkd,tk->td", unsorted.reshape(t, k, -1).astype(jnp.float32),
                    topk_weights).astype(x.dtype)


def two_pass(backend, x, topk_weights, topk_ids, w_gate_up, w_down):
  """moe_mlp's layer (SwiGLU) with its first grouped GEMM and activation as two passes."""
  plan = moe_layer.Plan(activation="swiglu", precision=None, out_dtype=x.dtype,
                        backend=backend, fuse_gate=False)
  return moe_layer.layer(plan, x, topk_weights, w_gate_up, w_down,
                         moe_layer.dispatch(topk_ids, w_down.shape[0]))


def fp8_three_pass(backend, x, topk_weights, topk_ids, w_gate_up, w_down):
  """moe_mlp's fp8 inference form (quantize_experts weights) with its first GEMM, SwiGLU
  and the quantize of a as three passes."""
  plan = moe_layer.Plan(activation="swiglu", precision=None, out_dtype=x.dtype,
                        backend=backend, fuse_gate=False)
  return moe_fp8.layer_fp8(plan, x, topk_weights, *w_gate_up, *w_down,
                           moe_layer.dispatch(topk_ids, w_down[0].shape[0]))


def dense(x, topk_weights, topk_ids, w_gate_up, w_down):
  """x (T * k, D) through one expert's weights: the layer's FLOPs with no routing."""
  del topk_weights, topk_ids
  f = w_down.shape[1]
  h = jnp.dot(x, w_gate_up[0])
  return jnp.dot(jax.nn.silu(h[:, :f]) * h[:, f:], w_down[0])


# variant -> how its operands are made from the shared ones, once per config and mode:
# moe_mlp/fp8's weights are quantized once, before timing, as a served model holds them.
_QUANTIZED = lambda x, w, ids, wgu, wd, *rest: (x, w, ids, *quantize_experts(wgu, wd),  # noqa: E731
                                               *rest)
PREPARE = {"moe_mlp/fp8": _QUANTIZED, "moe_mlp/fp8-3pass": _QUANTIZED,
           # the weights stay, their fp8 copies come last (not differentiated)
           "moe_mlp/fp8-train-cached": lambda *a: (*a, quantize_experts_for_training(*a[3:5]))}
# variants that have no backward pass
FORWARD_ONLY = ("moe_mlp/fp8", "moe_mlp/fp8-3pass")


def variants(on_gpu: bool, wanted: list[str] | None) -> tuple[dict, dict]:
  """({name: layer(x, topk_weights, topk_ids, w_gate_up, w_down)}, {name: why left out})."""
  backend = "auto" if on_gpu else "mosaic"  # on a CPU the kernels' code in the interpreter
  fns = {
      "moe_mlp": functools.partial(moe_mlp, backend=backend),
      "unfused/pallas_gemm": functools.partial(
          unfused, functools.partial(ragged_dot, backend=backend)),
      "unfused/lax": functools.partial(unfused, jax.lax.ragged_dot),
      "dense": dense,
  }
  fns["moe_mlp/two-pass"] = functools.partial(two_pass, backend)
  fns["moe_mlp/fp8-train"] = functools.partial(moe_mlp, backend=backend, precision="fp8")
  fns["moe_mlp/fp8-train-cached"] = lambda x, w, ids, wgu, wd, cached: moe_mlp(
      x, w, ids, wgu, wd, backend=backend, precision="fp8", fp8_weights=cached)
  fns["moe_mlp/fp8"] = functools.partial(moe_mlp, backend=backend)  # on PREPARE's operands
  fns["moe_mlp/fp8-3pass"] = functools.partial(fp8_three_pass, backend)
  missing = {}
  tokamax, why = import_tokamax()
  if tokamax is None:
    missing["unfused/tokamax"] = f"not importable ({why})"
  elif not on_gpu:
    missing["unfused/tokamax"] = "its Mosaic GPU kernel needs a GPU"
  else:
    fns["unfused/tokamax"] = functools.partial(
        unfused, functools.partial(tokamax.ragged_dot, implementation="mosaic"))
  if wanted is not None:
    fns = {n: f for n, f in fns.items() if n in wanted}
  return fns, missing


def _program(layer, mode: str):
  if mode == "fwd":
    return jax.jit(layer)

  def fwd_bwd(x, w, ids, wgu, wd, ct, *rest):  # rest: operands not differentiated
    out, vjp = jax.vjp(lambda x, w, wgu, wd: layer(x, w, ids, wgu, wd, *rest), x, w, wgu, wd)
    return (out,) + vjp(ct)

  return jax.jit(fwd_bwd)


def operands(cfg: Config, mode: str, is_dense: bool):
  """(x, topk_weights, topk_ids, w_gate_up, w_down[, cotangent]); for the dense ceiling
  x holds the T * k rows and the weights one expert."""
  keys = jax.random.split(jax.random.key(0), 6)
  t, d, f, e, k = cfg.tokens, cfg.d_model, cfg.d_ff, cfg.experts, cfg.top_k
  x = jax.random.normal(keys[0], (t * k if is_dense else t, d), DTYPE)
  logits = jax.random.normal(keys[1], (t, e), jnp.float32)
  weights, ids = softmax_topk(logits, k)
  ne = 1 if is_dense else e
  wgu = (jax.random.normal(keys[2], (ne, d, 2 * f), jnp.float32) / math.sqrt(d)).astype(DTYPE)
  wd = (jax.random.normal(keys[3], (ne, f, d), jnp.float32) / math.sqrt(f)).astype(DTYPE)
  args = (x, weights, ids, wgu, wd)
  if mode == "fwd+bwd":
    args += (jax.random.normal(keys[4], x.shape, DTYPE),)
  return args


def _reason(e: Exception) -> str:
  text = f"{type(e).__name__}: {e}".splitlines()[0]
  return text[:200]


def kernel_breakdown(program, args, calls: int, top: int = 12) -> dict:
  """A program's kernel time per call by kernel name (CUPTI); the gap to its wall clock
  is time no kernel ran (launch gaps, host work)."""
  from benchmarks.probe import ranked_kernels  # noqa: PLC0415 - GPU only
  found = ranked_kernels(program, args, calls, top=top)
  return dict(kernel_ms=found["kernel_ms"], launches=found["launches"],
              top=[dict(k, name=k["name"][:120]) for k in found["kernels"]])


def run_config(cfg: Config, mode: str, fns: dict, timer, rounds: int, calls: int,
               kernels: bool = False) -> dict:
  programs, temps, failed, args = {}, {}, {}, {}
  # One set of operands for the routed variants (the largest weights are 22 GiB).
  shared = {flag: operands(cfg, mode, flag) for flag in {n == "dense" for n in fns}}
  for name, layer in fns.items():
    if mode != "fwd" and name in FORWARD_ONLY:
      failed[name] = "inference only"
      continue
    try:
      a = shared[name == "dense"]
      if name in PREPARE:
        a = jax.block_until_ready(jax.jit(PREPARE[name])(*a))
      prog = _program(layer, mode)
      compiled = prog.lower(*a).compile()
      stats = compiled.memory_analysis()
      temps[name] = None if stats is None else int(stats.temp_size_in_bytes)
      jax.block_until_ready(prog(*a))
      programs[name], args[name] = prog, a
    except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
      failed[name] = _reason(e)
  # rounds_ms times functions of one argument list: bind each variant to its own.
  bound = {n: (lambda p=p, a=args[n]: p(*a)) for n, p in programs.items()}
  times = rounds_ms(timer, bound, [()], rounds, calls) if bound else {}
  out = {}
  for name in fns:
    if name in failed:
      out[name] = dict(status="failed", reason=failed[name])
      continue
    ms = sorted(times[name])[len(times[name]) // 2]
    row = dict(status="ok", ms=ms, rounds_ms=times[name], temp_bytes=temps[name],
               tflops=cfg.flops * (3 if mode == "fwd+bwd" else 1) / ms / 1e9)
    if kernels:
      row["kernels"] = k = kernel_breakdown(programs[name], args[name], calls)
      print(f"{cfg.name} {mode} {name}: {ms:.3f} ms wall, {k['kernel_ms']:.3f} ms in"
            f" {k['launches']:.0f} kernels", flush=True)
      for t in k["top"]:
        print(f"   {t['ms']:7.3f} ms  x{t['count']:<4.1f} {t['name']}", flush=True)
    if "moe_mlp" in times and name != "moe_mlp":
      r = ratio_stats(times[name], times["moe_mlp"])  # > 1: moe_mlp is faster
      row["moe_mlp_speedup"] = dict(median=r.median, spread=r.spread, verdict=r.verdict)
    out[name] = row
  return out


def roofline_ms(cfg: Config, device_kind: str) -> float | None:
  """The time to read every expert weight a decode step touches once, at peak HBM."""
  peak = next((v for k, v in HBM_BYTES_PER_S.items() if k in device_kind), None)
  if peak is None:
    return None
  hit = 1 - (1 - 1 / cfg.experts) ** (cfg.tokens * cfg.top_k)  # expected fraction touched
  return cfg.weight_bytes() * hit / peak * 1e3


def main(args=None) -> int:
  if isinstance(args, (list, tuple)) and "--expert-parallel" in args:
    from benchmarks import moe_parallel  # noqa: PLC0415 - its own parser and options
    return moe_parallel.main([a for a in args if a != "--expert-parallel"])
  opts = _options(args)
  on_gpu = jax.default_backend() == "gpu"
  rounds = opts.rounds or (7 if on_gpu else 2)
  calls = opts.calls or (5 if on_gpu else 1)
  names = [n.strip() for n in opts.configs.split(",") if n.strip()]
  modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
  unknown = [n for n in names if n not in CONFIGS]
  if unknown or any(m not in MODES for m in modes):
    print(f"unknown configs {unknown} or modes {modes}: choose from {list(CONFIGS)} and"
          f" {MODES}", file=sys.stderr)
    return 2
  configs = [CONFIGS[n] for n in names]
  if not on_gpu:
    configs = [dataclasses.replace(c, **TINY, top_k=min(c.top_k, 4)) for c in configs[:1]]
  wanted = None if opts.variants is None else [v.strip() for v in opts.variants.split(",")]
  fns, missing = variants(on_gpu, wanted)
  timer = PipelinedTimer()
  kind = jax.devices()[0].device_kind
  print(f"device: {kind}, jax {jax.__version__}, timer {timer.name}, {rounds} rounds x"
        f" {calls} calls" + ("" if on_gpu else "; no GPU: one tiny config, interpreter"),
        flush=True)
  for name, why in missing.items():
    print(f"{name}: left out, {why}", flush=True)
  if opts.kernels and not on_gpu:
    print("--kernels: left out, CUPTI times kernels on a GPU only", flush=True)
  results = []
  for cfg in configs:
    for mode in modes:
      if cfg.name.startswith("decode") and mode != "fwd":
        continue  # decode is inference
      # A pipelined sample holds every call's results: one call per sample where those
      # are the weights' gradients of a large config.
      n_calls = 1 if mode == "fwd+bwd" and cfg.weight_bytes() > 4 << 30 else calls
      decode = cfg.name.startswith("decode")
      roof = roofline_ms(cfg, kind) if decode else None
      if decode and on_gpu and opts.calls is None:
        n_calls = decode_calls(roof)
      row = dict(config=dataclasses.asdict(cfg), mode=mode, calls=n_calls, roofline_ms=roof,
                 variants=run_config(cfg, mode, fns, timer, rounds, n_calls,
                                     kernels=opts.kernels and on_gpu))
      results.append(row)
      print(markdown([row], header=len(results) == 1), flush=True)
  text = markdown(results)
  if opts.out is not None:
    opts.out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=kind, jax=jax.__version__, timer=timer.name, rounds=rounds,
                calls=calls, left_out=missing)
    (opts.out / "moe.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    (opts.out / "moe.md").write_text(text + "\n")
    print(f"wrote {opts.out}/moe.json, moe.md", flush=True)
  print(text, flush=True)
  return 0


def markdown(results: list[dict], header: bool = True) -> str:
  """One line per (config, mode): each variant's ms and moe_mlp's speedup over it."""
  lines = []
  if header:
    lines += ["| config | mode | variant | ms | TFLOP/s | moe_mlp speedup | temp MiB |",
              "|---|---|---|---:|---:|---:|---:|"]
  for row in results:
    c = row["config"]
    label = (f"{c['name']} (T {c['tokens']}, D {c['d_model']}, F {c['d_ff']},"
             f" E {c['experts']}, k {c['top_k']})")
    for name, v in row["variants"].items():
      if v["status"] != "ok":
        lines.append(f"| {label} | {row['mode']} | {name} | - | - | {v['reason']} | - |")
        continue
      s = v.get("moe_mlp_speedup")
      # no ratio where moe_mlp itself did not run (out of memory, say)
      speed = ("1" if name == "moe_mlp" else "-" if s is None
               else f"{s['median']:.2f}x ±{s['spread']:.2f}")
      temp = "-" if v["temp_bytes"] is None else f"{v['temp_bytes'] / 2**20:.0f}"
      lines.append(f"| {label} | {row['mode']} | {name} | {v['ms']:.3f} | {v['tflops']:.0f} |"
                   f" {speed} | {temp} |")
    if row.get("roofline_ms") and row["variants"].get("moe_mlp", {}).get("status") == "ok":
      frac = row["roofline_ms"] / row["variants"]["moe_mlp"]["ms"]
      lines.append(f"| {label} | {row['mode']} | HBM roofline (expert weights) |"
                   f" {row['roofline_ms']:.3f} | - | moe_mlp at {frac:.2f} of it | - |")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
