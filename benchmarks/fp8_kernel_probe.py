"""Probe of the fp8 Mosaic kernel alone (`pallas_gemm.fp8.mosaic_gemm.scaled_gemm`) on one GPU.

    python -m benchmarks.fp8_kernel_probe                 # 4096^3 and 8192^3, < 2 minutes
    python -m benchmarks.fp8_kernel_probe --sizes 4096 --configs 128x128s5p,128x192s4cn
    python -m benchmarks.fp8_kernel_probe --sizes 4096x7168x2048 --tensor-configs 128x256s4wnf

Per size (N for N^3, or MxNxK), in one process: bf16 jnp.dot, the dequantize + bf16 dot
path (1x128 / 128x128 block scales applied in XLA), XLA's scaled per-tensor pattern
(`xla.per_tensor_pattern`, which XLA rewrites to one cuBLASLt fp8 GEMM: the probe prints
whether the compiled HLO holds `__cublas$lt$matmul$f8`; its scales are passed 0-d, and
again as constants of the program), and the kernel with 1x128 lhs /
128x128 rhs block scales and with per-tensor scales (promoted every 128 of K, the
default, and the opt-in fast accumulation). CUPTI kernel time
(`jax.experimental.mosaic.gpu.profiler.measure`), median over ITERATIONS calls, of
everything a call launches (the kernel's "alone" column: the Pallas kernel without the
scale transposes and pads around it). Errors: normwise relative error of the first
ERR_ROWS rows against the float64 product of the dequantized operands (bf16 results),
and per size a line comparing the per-tensor paths' float32-result errors: cuBLASLt fp8,
the kernel's promoted loop and its fast accumulation. --configs adds the block-scaled
kernel at other tiles (BMxBNsS[wW][cC][eE][f], e.g. 128x192s4; w: wg_split, default m; c:
clusters of 2 CTAs along m or n), --tensor-configs the per-tensor kernel (promoted, or
with f fast accumulation).
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics

import jax
import jax.numpy as jnp

from benchmarks.fp8 import constant_pattern
from pallas_gemm.testing.reference import relative_error, scaled_reference
from pallas_gemm.fp8 import config as fp8_config
from pallas_gemm.fp8 import mosaic_gemm as mosaic
from pallas_gemm.fp8 import xla as sm_xla

ITERATIONS = 20
ERR_ROWS = 256
KERNEL_NAME = "pallas_gemm_scaled_fp8"
E4M3_MAX = 448.0


def _quantize(x, rows: int, cols: int):
  """x (R, K) f32 -> (e4m3 values, f32 scales (ceil(R/rows), K/cols) or (1, 1)): each
  block's amax maps to 448. rows = cols = 0: one scale for the tensor, a power of two
  (exact in bf16, so XLA's bf16 pattern below multiplies by the same scale)."""
  r, k = x.shape
  if rows == 0:
    s = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(jnp.max(jnp.abs(x)), 1e-30) / E4M3_MAX)))
    return (x / s).astype(jnp.float8_e4m3fn), s.reshape(1, 1)
  xb = jnp.pad(x, ((0, -r % rows), (0, 0))).reshape(-1, rows, k // cols, cols)
  s = jnp.maximum(jnp.max(jnp.abs(xb), axis=(1, 3)), 1e-30) / E4M3_MAX
  full = jnp.repeat(jnp.repeat(s, rows, axis=0)[:r], cols, axis=1)
  return (x / full).astype(jnp.float8_e4m3fn), s


def _dequantized_bf16(v, s, rows: int, cols: int):
  r, _ = v.shape
  full = jnp.repeat(jnp.repeat(s, rows, axis=0)[:r], cols, axis=1) if rows else s
  return (v.astype(jnp.float32) * full).astype(jnp.bfloat16)


def _time(f, *args):
  """(median ms of all kernels of a call, median ms of the Pallas kernel or None, out)."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 - GPU only

  out = jax.block_until_ready(f(*args))
  _, runs = profiler.measure(f, aggregate=False, iterations=ITERATIONS)(*args)
  total = statistics.median(sum(t for _, t in run) for run in runs)
  kernel = [sum(t for name, t in run if KERNEL_NAME in name) for run in runs]
  return total, (statistics.median(kernel) if any(kernel) else None), out


def _parse_config(spec: str) -> fp8_config.Config:
  """BMxBNsS[wW][cC][eE][f] -> Config: e.g. 128x192s4, 256x128s4wm, 128x128s5cn (clusters
  of 2 CTAs along n; cm: along m), 128x176s4e176 (e: epi_block_n; default the widest of
  64, 32, 16 dividing the warpgroup tile), 256x128s4cnf (f: fast accumulation, per tensor
  only)."""
  match = re.fullmatch(r"(\d+)x(\d+)s(\d+)(?:w([mn]))?(?:c([mn]))?(?:e(\d+))?(f)?", spec)
  if match is None:
    raise SystemExit(f"--configs: {spec!r} is not BMxBNsS[wm|wn][cm|cn][eE][f]")
  bm, bn, stages, split, cluster, epi, fast = match.groups()
  wg_n = int(bn) // 2 if split == "n" else int(bn)
  epi_n = int(epi) if epi else next((e for e in (64, 32, 16) if wg_n % e == 0), 16)
  return fp8_config.Config(block_m=int(bm), block_n=int(bn), stages=int(stages),
                           wg_split=split or "m", cluster_m=2 if cluster == "m" else 1,
                           cluster_n=2 if cluster == "n" else 1, epi_block_n=epi_n,
                           fast_accumulation=fast == "f")


def _dims(size: str) -> tuple[int, int, int]:
  """"N" (N^3) or "MxNxK" -> (M, N, K)."""
  dims = [int(d) for d in size.lower().split("x")]
  if len(dims) not in (1, 3):
    raise SystemExit(f"--sizes: {size!r} is not N or MxNxK")
  return tuple(dims * 3 if len(dims) == 1 else dims)


def run_size(size: str, configs: list[str], tensor_configs: list[str]) -> list[tuple]:
  m, n, k = _dims(size)
  flops = 2.0 * m * n * k
  key_a, key_b = jax.random.split(jax.random.key(m * 7 + n * 3 + k))
  a = jax.random.normal(key_a, (m, k), jnp.float32)
  b = jax.random.normal(key_b, (n, k), jnp.float32)  # (N, K): K-major, as fp8 wgmma reads it
  a_bf16, b_bf16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  a8, sa = _quantize(a, 1, 128)        # 1x128 blocks
  b8, sb = _quantize(b, 128, 128)      # 128x128 blocks
  a8t, sat = _quantize(a, 0, 0)        # per tensor
  b8t, sbt = _quantize(b, 0, 0)
  # XLA's pattern takes its scales 0-d: reshaped here, outside the jitted function.
  sat0, sbt0 = sat.reshape(()), sbt.reshape(())
  dims = (((1,), (1,)), ((), ()))
  rows = slice(0, ERR_ROWS)

  def err(out, lhs, rhs, ls, rs):
    ref = scaled_reference(lhs[rows][None], rhs[None], ls[rows][None] if ls.shape[0] > 1
                           else ls[None], rs[None])
    return relative_error(jnp.asarray(out)[..., rows, :].reshape(ERR_ROWS, n).astype(
        jnp.float32), ref.reshape(ERR_ROWS, n))

  cases = []
  bf16_ms, _, _ = _time(jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims)), a_bf16, b_bf16)
  cases.append(("bf16 jnp.dot", bf16_ms, None, None))

  deq = jax.jit(lambda v, s, w, t: jax.lax.dot_general(
      _dequantized_bf16(v, s, 1, 128), _dequantized_bf16(w, t, 128, 128), dims))
  ms, _, out = _time(deq, a8, sa, b8, sb)
  cases.append(("dequantize + bf16 dot (blocks)", ms, None, err(out, a8, b8, sa, sb)))

  xla_tensor = jax.jit(sm_xla.per_tensor_pattern)
  rewritten = sm_xla.is_cublaslt_fp8(
      xla_tensor.lower(a8t, b8t, sat0, sbt0).compile().as_text())
  print(f"{size}: XLA's per-tensor pattern compiled to cublas$lt$matmul$f8: {rewritten}",
        flush=True)
  ms, _, out = _time(xla_tensor, a8t, b8t, sat0, sbt0)
  cases.append(("XLA scaled per-tensor (cuBLASLt" + ("" if rewritten else ", NOT rewritten")
                + ")", ms, None, err(out, a8t, b8t, sat, sbt)))
  constant = jax.jit(functools.partial(constant_pattern, sa=float(sat0), sb=float(sbt0)))
  ms, _, out = _time(constant, a8t, b8t)
  cases.append(("XLA per-tensor, constant scales (cuBLASLt: "
                f"{sm_xla.is_cublaslt_fp8(constant.lower(a8t, b8t).compile().as_text())})",
                ms, None, err(out, a8t, b8t, sat, sbt)))

  def kernel(config):
    return jax.jit(lambda v, w, s, t: mosaic.scaled_gemm(
        v[None], w[None], s[None], t[None], out_dtype=jnp.bfloat16, config=config)[0])

  blocks = [("kernel blocks 1x128/128x128 (default)", None)]
  blocks += [(f"kernel blocks {spec}", _parse_config(spec)) for spec in configs]
  def run_kernel(name, config, lhs, rhs, ls, rs):
    try:
      ms, alone, out = _time(kernel(config), lhs, rhs, ls, rs)
    except ValueError as e:  # a config that does not fit (registers, shared memory)
      print(f"{name}: rejected: {e}", flush=True)
      return
    cases.append((name, ms, alone, err(out, lhs, rhs, ls, rs)))

  for name, config in blocks:
    run_kernel(name, config, a8, b8, sa, sb)
  tensor = [("kernel per-tensor (promoted, default)", None),
            ("kernel per-tensor (fast accumulation)",
             fp8_config.default_config(m, n, k, out_dtype=jnp.bfloat16, promoted=False))]
  tensor += [(f"kernel per-tensor {spec}", _parse_config(spec)) for spec in tensor_configs]
  for name, config in tensor:
    run_kernel(name, config, a8t, b8t, sat, sbt)

  # Per tensor, float32 results (no bf16 rounding hiding the accumulation's error).
  f32_out = {"cuBLASLt fp8": jax.jit(lambda v, w, s, t: sm_xla.per_tensor_pattern(
      v, w, s, t, out_dtype=jnp.float32))}
  for label, config in tensor[:2]:
    if config is not None:  # the fast-accumulation default, sized for a float32 epilogue
      config = fp8_config.default_config(m, n, k, out_dtype=jnp.float32, promoted=False)
    f32_out[label.removeprefix("kernel per-tensor ")] = jax.jit(
        lambda v, w, s, t, config=config: mosaic.scaled_gemm(
            v[None], w[None], s[None], t[None], out_dtype=jnp.float32, config=config)[0])
  errors = {label: err(f(a8t, b8t, *((sat0, sbt0) if label == "cuBLASLt fp8" else
                                      (sat, sbt))), a8t, b8t, sat, sbt)
            for label, f in f32_out.items()}
  print(f"{size} per-tensor error, f32 out: " + ", ".join(
      f"{label} {e:.3e}" for label, e in errors.items()), flush=True)
  return [(size, name, ms, alone, flops / ms / 1e9, bf16_ms / ms, e)
          for name, ms, alone, e in cases]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="4096,8192",
                      help="comma-separated N (N^3) or MxNxK")
  parser.add_argument("--configs", default="", help="extra block-scaled kernel configs")
  parser.add_argument("--tensor-configs", default="", help="extra per-tensor kernel configs")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("fp8_kernel_probe times the kernel on a GPU (CUPTI); none here")
  configs = [c for c in args.configs.split(",") if c]
  tensor_configs = [c for c in args.tensor_configs.split(",") if c]
  for spec in configs + tensor_configs:
    _parse_config(spec)  # bad specs fail before any timing
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, CUPTI median of"
        f" {ITERATIONS}; error: first {ERR_ROWS} rows vs float64 of the dequantized operands")
  print("| size | case | ms | kernel alone ms | TFLOP/s | x bf16 | relerr |")
  print("|---|---|---|---|---|---|---|")
  sizes = [s for s in args.sizes.split(",") if s]
  for size in sizes:
    _dims(size)  # bad sizes fail before any timing
  for size in sizes:
    for size_, name, ms, alone, tflops, ratio, e in run_size(size, configs, tensor_configs):
      print(f"| {size_} | {name} | {ms:.3f} | {'' if alone is None else f'{alone:.3f}'} |"
            f" {tflops:.0f} | {ratio:.2f} | {'' if e is None else f'{e:.2e}'} |", flush=True)


if __name__ == "__main__":
  main()
