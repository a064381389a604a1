"""Probe of the grouped-GEMM Mosaic kernels alone (`grouped.mosaic_forward`,
`grouped.mosaic_weight_grad`) on one GPU.

    python -m benchmarks.ragged_kernel_probe                  # four MoE shapes, < 3 minutes
    python -m benchmarks.ragged_kernel_probe --shapes qwen3 --configs 128x128x64s4wm
    python -m benchmarks.ragged_kernel_probe --shapes qwen3,skewed --wgrad-configs 64x256x128e4
    python -m benchmarks.ragged_kernel_probe --shapes deepseek-gate-up --wgrad-only --no-check \
        --wgrad-configs 64x256x128e4      # moe_mlp's weight gradients, outputs of 14 GiB

Per shape (G groups, M rows, K, N), in one process: a dense bf16 jnp.dot of the same FLOPs
((M, K) @ (K, N)), the forward kernel (rhs (G, K, N)), the forward with rhs read transposed
(the dlhs form: dy (M, N) @ rhs(G, K, N)^T -> (M, K)), and the weight-gradient kernel
((G, K, N) from lhs and dy). CUPTI kernel time (`jax.experimental.mosaic.gpu.profiler.measure`),
median over ITERATIONS calls, of everything a call launches (the item table's small XLA
fusions included; "alone": the Pallas kernel only). TFLOP/s count 2 * M * K * N. Errors:
normwise relative error against `jax.lax.ragged_dot` (and its vjp for the weight grad) on
the first CHECK_ROWS rows, where XLA's dense (G, rows, K) formulation still fits.
The weight grad runs with an f32 output and with a bf16 one (what the vjp of a bf16
ragged_dot asks for: the output writes are half as large). --wgrad-only times the bf16
weight grad and --wgrad-configs alone; --no-check skips the float32 reference (too large
at the layer's shapes) and compares each config's output with the default kernel's.

--configs adds forward runs, --wgrad-configs weight-grad runs, at other configs, written
BMxBNxBK then any of: sS stages (default: the deepest ring that fits), wM|wN the warpgroup
split, eE epilogue slots per warpgroup, EN epi_block_n, and for the weight grad @f32
(default bf16 output). E.g. 128x128x64s4wm, 64x256x128e4, 64x256x128s4@f32.
"""

from __future__ import annotations

import argparse
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.grouped import mosaic_forward, mosaic_weight_grad
from pallas_gemm.grouped.config import SMEM_BYTES_PER_BLOCK, Config, smem_bytes
from pallas_gemm.testing.reference import relative_error

ITERATIONS = 10
CHECK_ROWS = 2048
KERNELS = ("pallas_gemm_ragged_forward", "pallas_gemm_ragged_weight_grad")
SHAPES = {  # (G, M, K, N, group-size distribution)
    "mixtral": (8, 16384, 4096, 14336, "uniform"),
    "deepseek": (32, 32768, 7168, 2048, "uniform"),
    "qwen3": (128, 65536, 2048, 768, "uniform"),
    "skewed": (64, 32768, 4096, 1536, "pareto"),
    "decode": (8, 256, 4096, 14336, "uniform"),
    # moe_mlp's weight gradients at DeepSeek-V3- and Qwen3-like sizes (8192 tokens, top-8):
    # w_gate_up's (K = D, N = 2F) and w_down's (K = F, N = D)
    "deepseek-gate-up": (256, 65536, 7168, 4096, "uniform"),
    "deepseek-down": (256, 65536, 2048, 7168, "uniform"),
    "qwen3-gate-up": (128, 65536, 2048, 1536, "uniform"),
    "qwen3-down": (128, 65536, 768, 2048, "uniform"),
}


def group_sizes(g: int, m: int, kind: str, seed: int = 0) -> np.ndarray:
  """Random sizes summing to m: multinomial with equal weights, or Pareto(1.2) weights
  (a few experts take most rows)."""
  rng = np.random.default_rng(seed)
  weights = rng.pareto(1.2, g) + 0.05 if kind == "pareto" else np.ones(g)
  return rng.multinomial(m, weights / weights.sum()).astype(np.int32)


def _time(f, *args, iterations: int = ITERATIONS):
  """(median ms of all kernels of a call, median ms of the Pallas kernel or None, out)."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 - GPU only

  out = jax.block_until_ready(f(*args))
  _, runs = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
  total = statistics.median(sum(t for _, t in run) for run in runs)
  alone = [sum(t for name, t in run if any(k in name for k in KERNELS)) for run in runs]
  return total, (statistics.median(alone) if any(alone) else None), out


_SPEC = re.compile(r"(\d+)x(\d+)x(\d+)((?:s\d+|w[mn]|e\d+|E\d+)*)(@f32)?")


def _parse_config(spec: str, *, weight_grad: bool) -> tuple[Config, object]:
  """(config, out dtype) of a spec (see the module docstring)."""
  match = _SPEC.fullmatch(spec)
  if match is None:
    raise SystemExit(f"bad config spec {spec!r}: BMxBNxBK[sS][wM|wN][eE][EN][@f32]")
  bm, bn, bk = (int(match.group(i)) for i in (1, 2, 3))
  out_dtype = jnp.float32 if match.group(5) else jnp.bfloat16
  fields = dict(block_m=bm, block_n=bn, block_k=bk, wg_split="n",
                epi_block_n=32 if out_dtype == jnp.float32 else 64)
  for token in re.findall(r"s\d+|w[mn]|e\d+|E\d+", match.group(4)):
    key, value = token[0], token[1:]
    if key == "s":
      fields["stages"] = int(value)
    elif key == "w":
      fields["wg_split"] = value
    elif key == "e":
      fields["epi_slots"] = int(value)
    else:
      fields["epi_block_n"] = int(value)
  cfg = Config(**{"stages": 6, **fields})
  tiles = (dict(a_tile=(bm, bk), b_tile=(bm, bn)) if weight_grad
           else dict(a_tile=(bm, bk), b_tile=(bk, bn)))
  if "stages" not in fields:  # the deepest ring that fits
    while cfg.stages > 2 and smem_bytes(cfg, dtype=jnp.bfloat16, out_dtype=out_dtype,
                                        **tiles) > SMEM_BYTES_PER_BLOCK:
      cfg = cfg.replace(stages=cfg.stages - 1)
  return cfg, out_dtype


def _subset_sizes(sizes: np.ndarray, rows: int) -> np.ndarray:
  ends = np.minimum(np.cumsum(sizes), rows)
  return np.diff(ends, prepend=0).astype(np.int32)


@jax.jit
def _device_relative_error(out, ref):
  out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.sqrt(jnp.sum((out - ref) ** 2) / jnp.sum(ref ** 2))


def run_shape(name: str, configs: list[str], wgrad_configs: list[str],
              check: bool = True, forward: bool = True) -> list[tuple]:
  g, m, k, n, kind = SHAPES[name]
  sizes_np = group_sizes(g, m, kind)
  sizes = jnp.asarray(sizes_np)
  flops = 2.0 * m * k * n
  keys = jax.random.split(jax.random.key(g * m + k), 4)
  lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  # (the forward's weights; a weight-gradient-only run leaves them out: 15 GB at
  # DeepSeek-V3-like sizes)
  rhs = jax.random.normal(keys[1], (g, k, n) if forward else (1, 1, 1), jnp.bfloat16)
  dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  dense_b = jax.random.normal(keys[3], (k, n), jnp.bfloat16)

  rows = min(CHECK_ROWS, m)
  sub = jnp.asarray(_subset_sizes(sizes_np, rows))
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  ragged = lambda a, b: jax.lax.ragged_dot(  # noqa: E731
      a, b, sub, precision=jax.lax.Precision.HIGHEST)
  ref_fwd = ref_dlhs = ref_wgrad = None
  if check:
    if forward:
      ref_fwd = ragged(f32(lhs[:rows]), f32(rhs))
      ref_dlhs = ragged(f32(dy[:rows]), jnp.swapaxes(f32(rhs), 1, 2))
    # (the vjp needs only rhs's shape: zeros where a weight-gradient-only run has none)
    rhs_like = f32(rhs) if forward else jnp.zeros((g, k, n), jnp.float32)
    _, vjp = jax.vjp(lambda r: ragged(f32(lhs[:rows]), r), rhs_like)
    ref_wgrad = vjp(f32(dy[:rows]))[0]

  def err(out, ref):
    if ref is None:
      return None
    if not check:  # against the default kernel's output, reduced on the device
      return float(_device_relative_error(out, ref))
    return relative_error(np.asarray(out.astype(jnp.float32)), np.asarray(ref, np.float64))

  cases = []
  dense_ms, _, _ = _time(jax.jit(jnp.dot), lhs, dense_b)
  cases.append(("dense bf16 jnp.dot", dense_ms, None, None))

  def fwd(config, transpose):
    return jax.jit(lambda a, b, s: mosaic_forward.forward(
        a, b, s, None, transpose_rhs=transpose, out_dtype=jnp.bfloat16, config=config))

  runs = [("forward (default)", None)] + [
      (f"forward {c}", _parse_config(c, weight_grad=False)[0]) for c in configs]
  runs = runs if forward else []
  for label, config in runs:
    try:
      ms, alone, _ = _time(fwd(config, False), lhs, rhs, sizes)
      out = fwd(config, False)(lhs[:rows], rhs, sub)
    except Exception as e:  # noqa: BLE001 - a config that does not fit or lower
      cases.append((f"{label} FAILED {type(e).__name__}: {str(e)[:80]}", None, None, None))
      continue
    cases.append((label, ms, alone, err(out, ref_fwd)))
  # dlhs: dy (M, N) @ rhs[g]^T, rhs (G, K, N) read in place as a transposed (G, N', K')
  # with N' = K (the output's columns) and K' = N (the contraction).
  if forward:
    ms, alone, _ = _time(fwd(None, True), dy, rhs, sizes)
    out = fwd(None, True)(dy[:rows], rhs, sub)
    cases.append(("forward, rhs transposed (dlhs)", ms, alone, err(out, ref_dlhs)))

  def wgrad(config, out_dtype):
    return jax.jit(lambda a, d, s: mosaic_weight_grad.weight_grad(
        a, d, s, None, out_dtype=out_dtype, config=config))

  runs = [("weight grad f32", None, jnp.float32)] if forward else []
  runs += [("weight grad bf16", None, jnp.bfloat16)]
  runs += [(f"weight grad {c}", *_parse_config(c, weight_grad=True)) for c in wgrad_configs]
  for label, config, out_dtype in runs:
    out = None  # the previous config's output, freed before this one runs
    try:
      # profiler.measure keeps every call's output: at most ~30 GB of them
      calls = int(np.clip(30e9 // (g * k * n * jnp.dtype(out_dtype).itemsize), 2, ITERATIONS))
      ms, alone = _time(wgrad(config, out_dtype), lhs, dy, sizes, iterations=calls)[:2]
      out = wgrad(config, out_dtype)(lhs[:rows], dy[:rows], sub)
    except Exception as e:  # noqa: BLE001 - a config that does not fit or lower
      cases.append((f"{label} FAILED {type(e).__name__}: {str(e)[:80]}", None, None, None))
      continue
    cases.append((label, ms, alone, err(out, ref_wgrad)))
    if ref_wgrad is None and not check and out_dtype == jnp.bfloat16:
      ref_wgrad = out  # the default kernel: what the other configs are compared with

  lines = [f"{name}: G={g} M={m} K={k} N={n}, sizes {kind} (max {sizes_np.max()},"
           f" zeros {(sizes_np == 0).sum()}), device {jax.devices()[0].device_kind}"]
  for label, ms, alone, e in cases:
    if ms is None:
      lines.append(f"  {label}")
      continue
    tflops = flops / ms / 1e9
    lines.append(f"  {label:36s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s {dense_ms / ms:6.3f}x"
                 f" dense" + (f"  alone {alone:8.3f} ms" if alone else "")
                 + (f"  err {e:.2e}" if e is not None else ""))
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="mixtral,deepseek,qwen3,skewed",
                      help=f"comma-separated, of {sorted(SHAPES)}")
  parser.add_argument("--configs", default="", help="extra forward configs (see above)")
  parser.add_argument("--wgrad-configs", default="",
                      help="extra weight-grad configs (see above), bf16 output unless @f32")
  parser.add_argument("--no-check", action="store_true",
                      help="no float32 lax reference (large shapes): configs are compared"
                           " with the default kernel's output")
  parser.add_argument("--wgrad-only", action="store_true",
                      help="only the bf16 weight-gradient kernel and --wgrad-configs")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("ragged_kernel_probe needs a GPU (CUPTI timing of the Hopper kernels)")
  configs = [c for c in args.configs.split(",") if c]
  wgrad_configs = [c for c in args.wgrad_configs.split(",") if c]
  for c in configs:
    _parse_config(c, weight_grad=False)  # a bad spec fails before any timing
  for c in wgrad_configs:
    _parse_config(c, weight_grad=True)
  for name in args.shapes.split(","):
    for line in run_shape(name, configs, wgrad_configs, check=not args.no_check,
                          forward=not args.wgrad_only):
      print(line, flush=True)


if __name__ == "__main__":
  main()
