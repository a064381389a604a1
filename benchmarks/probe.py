"""Focused GPU probes behind the numbers in benchmarks/results (device-side CUPTI timing).

  python3 benchmarks/probe.py cuda [N]     every compiled cuda config x transpose case at N^3,
                                           the seeds' textbook kernel, jnp.dot HIGHEST
  python3 benchmarks/probe.py ragged [N]   where the time of a ragged (N+1)^3 bf16 mosaic GEMM
                                           goes: the padding copies vs the kernel
  python3 benchmarks/probe.py mosaic [N|MxNxK ..]  mosaic configs (tiles, clusters, tile order) vs
                                           jnp.dot and JAX's hopper_matmul_mgpu at its best,
                                           bf16 4096^3 / 8192^3, f16 8192^3, bf16 4097^3
  python3 benchmarks/probe.py ab [N|MxNxK ..]  mosaic variants (module switches) vs jnp.dot,
                                           called in turn (ratios to the adjacent jnp.dot call)
  python3 benchmarks/probe.py power [N]    SM clock and board power while jnp.dot / mosaic /
                                           triton run back to back (bf16 N^3, nvidia-smi)
  python3 benchmarks/probe.py triton        triton bf16 4096^3 tile-order / pipeline variants,
                                           and the ratio by wall clock (anchors.md's method)
  python3 benchmarks/probe.py cuda_ab LIB..  builds of cuda_sgemm.cu (e.g. with different -D switches)
                                           vs jnp.dot HIGHEST, called in turn, each under its own
                                           FFI target: NN/TN/NT/TT at 4096^3 and NN at 8192^3
  python3 benchmarks/probe.py cuda_sk        the cuda kernel's 128x128 and 128x64 tiles with stream-K
                                           on and off vs jnp.dot HIGHEST, called in turn, on
                                           square, ragged, skinny and long-K shapes
  python3 benchmarks/probe.py mosaic_sk     the default mosaic config with stream-K on and off vs
                                           jnp.dot, called in turn, then by wall clock
  python3 benchmarks/probe.py dense        the bf16 MLP step of `--mlp` written with the bias +
                                           GELU epilogue expressed several ways (f32 or bf16 dot
                                           output, pallas_gemm backends): wall clock, and the
                                           GEMM custom calls (cuBLASLt epilogues) XLA compiled
  python3 benchmarks/probe.py step_gemms    the five GEMMs of that step (forward with bias [+ GELU],
                                           the three backward layouts), CUPTI: jnp.dot / the jnp.dot
                                           expression vs gemm on xla and mosaic
  python3 benchmarks/probe.py step_kernels  the kernels of one bf16 MLP step (`--mlp`'s variants),
                                           by name, CUPTI time summed over 5 steps
  python3 benchmarks/probe.py step_tiles    the mlp step's five mosaic GEMMs as it runs them, with
                                           config variants, beside the jnp.dot expression
  python3 benchmarks/probe.py split_kernels [N ...]  float32_accurate's kernels (CUPTI) and the
                                           fusions of its optimized HLO (the split pass)
  python3 benchmarks/probe.py gate          the step's gated GEMM dz = g @ W2^T: mosaic plain / + C /
                                           * relu'(C) / * gelu'(C) vs cuBLAS (+ XLA's gate), CUPTI
  python3 benchmarks/probe.py ksplit [N]    2+ GPUs, bf16 N^3 with K sharded: jnp.dot vs local mosaic
                                           GEMMs (shard_map) in row chunks, each chunk's f32 partial
                                           summed by psum (or reduce-scatter + bf16 all-gather),
                                           on a persistent grid of fewer CTAs (SMs left to NCCL);
                                           wall clock, and the order XLA scheduled them in
  python3 benchmarks/probe.py once WHAT [N] one compiled, warmed-up GEMM between cuProfilerStart /
                                           Stop, for `ncu --profile-from-start off` (WHAT: cuda,
                                           dot32 = jnp.dot HIGHEST f32, mosaic, mosaic_nosk (stream-K
                                           off), dot16 = jnp.dot bf16):
                                           XLA's autotuning launches are not captured
"""

import dataclasses
import math
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import cuda, epilogue, gemm, mosaic, triton, tuning
from pallas_gemm.reference import relative_error

HIGHEST = jax.lax.Precision.HIGHEST


def _inputs(shape_a, shape_b, dtype):
  set_bytes = np.dtype(dtype).itemsize * (math.prod(shape_a) + math.prod(shape_b))
  return tuning.random_inputs(shape_a, shape_b, dtype, tuning.input_set_count(set_bytes))


def _ms(fn, inputs):
  return float(np.median(tuning.time_gpu_ms(jax.jit(fn), inputs, iterations=20)))


def probe_cuda(n: int = 4096):
  inputs = _inputs((n, n), (n, n), jnp.float32)
  ref = jnp.dot(*inputs[0], precision=HIGHEST)
  tflops = lambda ms: 2 * n**3 / (ms * 1e-3) / 1e12
  base = tflops(_ms(lambda a, b: jnp.dot(a, b, precision=HIGHEST), inputs))
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {n}^3 f32: "
        f"jnp.dot HIGHEST {base:.1f} TFLOP/s")
  default = cuda.default_config(n, n, n, jnp.float32)
  t = tflops(_ms(lambda a, b: gemm(a, b, backend="cuda"), inputs))
  print(f"  gemm(backend='cuda') default {default.astuple()}: {t:6.1f} TFLOP/s  {t / base:.3f}x jnp.dot")
  for fields in cuda.compiled_configs():
    config = cuda.Config(**dict(zip(cuda._CONFIG_FIELDS, fields)))
    for ta, tb in ((False, False), (True, False), (False, True), (True, True)):
      if config.is_textbook and (ta or tb):
        continue
      fn = lambda a, b: gemm(a, b, transpose_a=ta, transpose_b=tb, backend="cuda", config=config)
      a0, b0 = inputs[0]
      err = relative_error(fn(a0.T if ta else a0, b0.T if tb else b0), ref)
      t = tflops(_ms(fn, inputs))
      print(f"  {fields} ta={ta:d} tb={tb:d}: {t:6.1f} TFLOP/s  {t / base:.3f}x jnp.dot  "
            f"{t / 67.0:5.1%} of FP32 peak  relerr {err:.1e}", flush=True)


def probe_ragged(n: int = 4096):
  r = n + 1
  inputs = _inputs((r, r), (r, r), jnp.bfloat16)
  padded = _inputs((r + 7, r + 63), (r + 63, r + 63), jnp.bfloat16)
  aligned = _inputs((n + 64, n + 64), (n + 64, n + 64), jnp.bfloat16)
  rows = [
      (f"gemm mosaic {r}^3", lambda a, b: gemm(a, b, backend="mosaic"), inputs),
      (f"jnp.dot {r}^3", jnp.dot, inputs),
      ("pad A and B", lambda a, b: (jnp.pad(a, ((0, 7), (0, 63))), jnp.pad(b, ((0, 63), (0, 63)))), inputs),
      ("slice the output", lambda a, b: a[:r, :r] * 1, padded),
      (f"gemm mosaic {r + 7}x{r + 63}x{r + 63} (no padding)", lambda a, b: gemm(a, b, backend="mosaic"), padded),
      (f"gemm mosaic {n + 64}^3 aligned", lambda a, b: gemm(a, b, backend="mosaic"), aligned),
  ]
  for name, fn, args in rows:
    print(f"  {name:45s} {_ms(fn, args):.4f} ms", flush=True)


def _hopper_best(n, inputs):
  """JAX's hopper_matmul_mgpu: the best median over a small sweep of its own configs."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # noqa: PLC0415
  dim = hm.MatmulDimension
  best = (math.inf, None)
  for tile_m, tile_n, wg, cluster, width in (
      (128, 128, dim.N, None, 4), (128, 128, dim.N, dim.M, 4), (128, 128, dim.N, dim.N, 4),
      (128, 128, dim.M, None, 4), (128, 128, dim.M, dim.N, 4), (128, 128, dim.N, None, 8)):
    cfg = hm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                          grid_minor_dim=dim.N, grid_tile_width=width, wg_dimension=wg,
                          cluster_dimension=cluster)
    try:
      best = min(best, (_ms(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg), inputs), str(cfg)))
    except Exception as e:  # noqa: BLE001 - a config its rules refuse
      print(f"    hopper {cfg}: {type(e).__name__} {str(e)[:80]}")
  return best


def _mosaic(a, b, config=None, *, transpose_b=False, c=None, c_gate=None):
  """mosaic.gemm itself, without gemm()'s per-plan caches (+ c, or c as a gate)."""
  m, k = a.shape
  config = config or mosaic.default_config(m, b.shape[0 if transpose_b else 1], k, a.dtype)
  return mosaic.gemm(a[None], b[None], None if c is None else c[None], alpha=1.0,
                     beta=0.0 if c is None else 1.0, transpose_a=False,
                     transpose_b=transpose_b, precision=None, out_dtype=a.dtype,
                     config=config, interpret=False, c_gate=c_gate)[0]


def _cuda(a, b, config, transpose_a=False, transpose_b=False):
  """cuda.gemm itself (IEEE f32), without gemm()'s per-plan caches (which would also keep
  the FFI target of the first trace: probe_cuda_ab swaps it)."""
  return cuda.gemm(a[None], b[None], None, alpha=1.0, beta=0.0, transpose_a=transpose_a,
                   transpose_b=transpose_b, precision=HIGHEST, out_dtype=jnp.float32,
                   config=config, interpret=False)[0]


def probe_mosaic(*sizes):
  """Mosaic configs vs jnp.dot (and hopper_matmul_mgpu on aligned shapes).

  sizes: bf16 problems to run, N (N^3) or MxNxK; none: bf16 4096^3 / 8192^3, f16 8192^3,
  bf16 4097^3, then the un-padding copies.
  """
  Cfg = mosaic.Config
  tall = dict(block_m=256, block_n=128, wg_split="m")
  configs = {
      "default": None,
      "256x128 cluster_n2 wait1": Cfg(**tall, cluster_n=2, wgmma_wait=1),
      "256x128 cluster_n2 warpgroup producer": Cfg(**tall, cluster_n=2, producer="warpgroup"),
      "256x128 cluster_n2 grid m": Cfg(**tall, cluster_n=2, grid_minor_dim="m"),
      "256x128 cluster_n2 width 4": Cfg(**tall, cluster_n=2, grid_tile_width=4),
      "256x128 cluster_n2 width 16": Cfg(**tall, cluster_n=2, grid_tile_width=16),
      "128x256": Cfg(block_m=128, block_n=256, wg_split="n"),
      "128x256 cluster_m2": Cfg(block_m=128, block_n=256, cluster_m=2),
      "256x128": Cfg(**tall),
      "256x192 s3": Cfg(block_m=256, block_n=192, wg_split="m", stages=3),
  }
  shape = lambda s: tuple(map(int, s.split("x"))) if "x" in str(s) else (int(s),) * 3  # noqa: E731
  cases = ([(shape(s), jnp.bfloat16) for s in sizes] if sizes else
           [((n,) * 3, dt) for n, dt in ((4096, jnp.bfloat16), (8192, jnp.bfloat16),
                                        (8192, jnp.float16), (4097, jnp.bfloat16))])
  for (m, n, k), dtype in cases:
    inputs = _inputs((m, k), (k, n), dtype)
    ref = jnp.dot(*inputs[0], preferred_element_type=jnp.float32)
    tflops = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e12  # noqa: E731
    dot = tflops(_ms(jnp.dot, inputs))
    line = (f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {m}x{n}x{k} "
            f"{jnp.dtype(dtype).name}: jnp.dot {dot:.1f}")
    if m == n == k and m % 256 == 0:
      hop_ms, hop_cfg = _hopper_best(m, inputs)
      line += f", hopper_matmul_mgpu best {tflops(hop_ms):.1f} ({hop_cfg})"
    print(line, flush=True)
    for name, cfg in configs.items():
      cfg = cfg or mosaic.default_config(m, n, k, dtype)
      fn = lambda a, b, cfg=cfg: _mosaic(a, b, cfg)  # noqa: E731
      try:
        err = relative_error(fn(*inputs[0]), ref)
        t = tflops(_ms(fn, inputs))
      except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  {name:38s} failed: {type(e).__name__} {str(e)[:150]}", flush=True)
        continue
      print(f"  {name:38s} {t:6.1f} TFLOP/s  {t / dot:.3f}x jnp.dot  relerr {err:.1e}", flush=True)
  if sizes:
    return
  # Dropping the padding of a misaligned output, (4104, 4160) -> (4097, 4097), which
  # costs 0.080 ms as an XLA slice: compare a Pallas Triton copy kernel.
  r = 4097
  padded = _inputs((r + 7, r + 63), (8, 8), jnp.bfloat16)
  x0 = padded[0][0]
  for name, fn in (("XLA slice x[:r, :r]", lambda x, _: x[:r, :r]),
                   ("XLA pad (the input side)", lambda x, _: jnp.pad(x[:r, :r], ((0, 7), (0, 63)))),
                   ("pallas triton unpad", lambda x, _: triton.unpad(x[None], r, r)[0])):
    ok = bool(jnp.array_equal(jax.jit(fn)(x0, None), x0[:r, :r])) if "pad (" not in name else True
    print(f"  unpad {name:40s} {_ms(fn, padded):.4f} ms  exact={ok}", flush=True)


def probe_ab(*sizes, iterations: int = 200):
  """Differences of ~1% between mosaic variants and jnp.dot, measured call by call.

  At 8192^3 the H200's clock moves with power within milliseconds, so separately timed
  runs of 20-30 calls disagree by several percent. Here every iteration calls jnp.dot
  and each variant back to back (one CUPTI capture, the order rotated per iteration),
  each variant's time is compared with the jnp.dot call of its iteration, and the median
  and 10th/90th percentiles of those ratios are reported. sizes: bf16 N^3 or MxNxK
  (default 4096 8192), then f16 8192^3.
  """
  variants = {  # name: fields replaced in the shape's default config
      "default (warp producer)": {},
      "warpgroup producer": {"producer": "warpgroup"},
      "wgmma_wait=1": {"wgmma_wait": 1},
      "grid_tile_width=4": {"grid_tile_width": 4},
      "grid_tile_width=16": {"grid_tile_width": 16},
  }
  shape = lambda s: tuple(map(int, s.split("x"))) if "x" in str(s) else (int(s),) * 3  # noqa: E731
  cases = [(shape(s), jnp.bfloat16) for s in (sizes or (4096, 8192))] + [((8192,) * 3, jnp.float16)]
  for (m, n, k), dtype in cases:
    inputs = _inputs((m, k), (k, n), dtype)
    ref = jnp.dot(*(x.astype(jnp.float32) for x in inputs[0]), precision=HIGHEST)
    fns = {"jnp.dot": jax.jit(jnp.dot)}
    base = mosaic.default_config(m, n, k, dtype)
    configs = {name: base.replace(**fields) for name, fields in variants.items()} | {
        name: _pingpong(base, fields) for name, fields in PINGPONG_VARIANTS.items()}
    for name, cfg in configs.items():
      fns[name] = jax.jit(lambda a, b, cfg=cfg: _mosaic(a, b, cfg))
      err = relative_error(fns[name](*inputs[0]), ref)
      print(f"  {name}: relerr {err:.1e} vs float32 HIGHEST", flush=True)
    _report_ratios(f"{m}x{n}x{k} {jnp.dtype(dtype).name}, {iterations} interleaved iterations",
                   _interleaved_ms(fns, inputs, iterations), 2 * m * n * k)


def _report_ratios(case: str, ms, flops: float, notes=None):
  """Prints the median TFLOP/s of ms["jnp.dot"] and, for every other entry, its median
  and 10th/90th percentile ratio to the jnp.dot call of the same iteration."""
  tflops = lambda t: flops / (t * 1e-3) / 1e12
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {case}:"
        f" jnp.dot {tflops(np.median(ms['jnp.dot'])):.1f} TFLOP/s (median)")
  for name in list(ms)[1:]:
    ratios = np.array(ms["jnp.dot"]) / np.array(ms[name])
    p10, p50, p90 = np.percentile(ratios, [10, 50, 90])
    note = f"  {notes[name]}" if notes else ""
    print(f"  {name:28s} {tflops(np.median(ms[name])):6.1f} TFLOP/s  vs the adjacent jnp.dot:"
          f" median {p50:.3f}x (10%: {p10:.3f}, 90%: {p90:.3f}){note}", flush=True)


def _interleaved_ms(fns, inputs, iterations):
  """{name: [ms per call]} with the functions called in turn, iteration by iteration."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # noqa: PLC0415 - GPU-only import
  ext = mosaic_gpu_lib._mosaic_gpu_ext
  kernels = {}  # the kernel names one call of each function launches
  for name, fn in fns.items():
    for args in inputs:
      jax.block_until_ready(fn(*args))
    ext._cupti_init()
    try:
      jax.block_until_ready(fn(*inputs[0]))
    finally:
      kernels[name] = [k for k, _ in ext._cupti_get_timings(True)]
  names = list(fns)
  order = lambda i: names[i % len(names):] + names[:i % len(names)]  # rotate: no fixed slot
  ext._cupti_init()
  try:
    previous = None
    for i in range(iterations):
      outs = [fns[name](*inputs[i % len(inputs)]) for name in order(i)]
      if previous is not None:  # one iteration queued ahead: the GPU never idles, and
        jax.block_until_ready(previous)  # at most two iterations' outputs are alive
      previous = outs
    jax.block_until_ready(previous)
  finally:
    timings = ext._cupti_get_timings(True)
  ms, pos = {name: [] for name in fns}, 0
  for i in range(iterations):
    for name in order(i):
      got = timings[pos:pos + len(kernels[name])]
      if [k for k, _ in got] != kernels[name]:
        raise RuntimeError(f"CUPTI order: expected {kernels[name]} for {name}, got {got}")
      ms[name].append(sum(t for _, t in got))
      pos += len(kernels[name])
  return ms


def probe_power(n: int = 8192, seconds: float = 4.0):
  """Clock and power while one GEMM runs back to back (bf16 n^3): jnp.dot, then mosaic.

  nvidia-smi samples the SM clock and board power every 50 ms during each ~`seconds` run;
  the median of each and the throughput by wall clock over the run are printed.
  """
  import subprocess  # noqa: PLC0415
  import time  # noqa: PLC0415
  inputs = _inputs((n, n), (n, n), jnp.bfloat16)
  fns = {"jnp.dot": jax.jit(jnp.dot), "mosaic (default)": jax.jit(_mosaic),
         "triton (default)": jax.jit(lambda a, b: gemm(a, b, backend="triton"))}
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {n}^3 bf16, ~{seconds} s each,"
        " back to back")
  for name, fn in fns.items():
    for args in inputs:
      fn(*args).block_until_ready()
    time.sleep(2.0)  # let the clock recover between functions
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
         "-lms", "50"], stdout=subprocess.PIPE, text=True)
    calls, start, previous = 0, time.perf_counter(), None
    while time.perf_counter() - start < seconds:
      out = fn(*inputs[calls % len(inputs)])
      if previous is not None:
        previous.block_until_ready()  # one call queued ahead
      previous, calls = out, calls + 1
    previous.block_until_ready()
    wall = time.perf_counter() - start
    smi.terminate()
    samples = [tuple(float(x) for x in line.split(",")) for line in smi.communicate()[0].split("\n")
               if line.count(",") == 1]
    clock, power = np.median(np.array(samples), axis=0) if samples else (float("nan"),) * 2
    print(f"  {name:18s} {2 * n**3 * calls / wall / 1e12:6.1f} TFLOP/s over {calls} calls;"
          f" median SM clock {clock:.0f} MHz, power {power:.0f} W ({len(samples)} samples)",
          flush=True)


def probe_triton():
  n = 4096
  inputs = _inputs((n, n), (n, n), jnp.bfloat16)
  tflops = lambda ms: 2 * n**3 / (ms * 1e-3) / 1e12
  dot = tflops(_ms(jnp.dot, inputs))
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {n}^3 bf16: jnp.dot {dot:.1f}")
  default = triton.default_config(n, n, n, jnp.bfloat16)
  variants = [default] + [dataclasses.replace(default, group_m=g) for g in (1, 4, 16, 32)] + [
      dataclasses.replace(default, num_stages=4, block_k=32),
      dataclasses.replace(default, num_stages=5, block_k=32),
      dataclasses.replace(default, block_k=128, num_stages=2)] + [
      # 16 warps: four warpgroups share the tile (smaller accumulators per thread), and
      # the 256x256 tile that needs them.
      dataclasses.replace(default, num_warps=16),
      dataclasses.replace(default, num_warps=16, num_stages=4),
      dataclasses.replace(default, block_m=256, block_n=128, num_warps=16),
      dataclasses.replace(default, block_m=256, block_n=256, num_warps=16),
      dataclasses.replace(default, block_m=256, block_n=256, num_warps=16, group_m=4)]
  for cfg in variants:
    fn = lambda a, b, cfg=cfg: gemm(a, b, backend="triton", config=cfg)
    try:
      t = tflops(_ms(fn, inputs))
    except Exception as e:  # noqa: BLE001
      print(f"  {cfg}: failed {type(e).__name__} {str(e)[:120]}", flush=True)
      continue
    print(f"  {t:6.1f} TFLOP/s {t / dot:.3f}x  {cfg}", flush=True)
  # anchors.md timed with the wall clock (back-to-back calls): the same ratio that way.
  wall = {name: _wall_ms(fn, inputs) for name, fn in (
      ("jnp.dot", jnp.dot), ("triton", lambda a, b: gemm(a, b, backend="triton")))}
  print(f"  wall clock (median of 5 x 30 back-to-back calls): jnp.dot {tflops(wall['jnp.dot']):.1f},"
        f" triton {tflops(wall['triton']):.1f} -> {wall['jnp.dot'] / wall['triton']:.3f}x")


def _wall_ms(fn, inputs, calls=30, repeats=5):
  import time  # noqa: PLC0415
  fn = jax.jit(fn)
  fn(*inputs[0]).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for i in range(calls):
      out = fn(*inputs[i % len(inputs)])
    out.block_until_ready()
    times.append((time.perf_counter() - start) / calls * 1e3)
  return float(np.median(times))


def probe_cuda_ab(*libs: str, iterations: int = 60):
  import ctypes  # noqa: PLC0415
  cases = [(4096, ta, tb) for ta in (False, True) for tb in (False, True)] + [(8192, False, False)]
  names = []
  for i, path in enumerate(libs):
    target = f"pallas_gemm_cuda_ab_{i}"
    jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(ctypes.CDLL(path).PallasGemmCudaSgemm), platform="CUDA")
    names.append((path.rsplit("/", 1)[-1].removesuffix(".so"), target))
  for n, ta, tb in cases:
    inputs = _inputs((n, n), (n, n), jnp.float32)
    a0, b0 = inputs[0]
    ref = jnp.dot(a0.T if ta else a0, b0.T if tb else b0, precision=HIGHEST)
    fns = {"jnp.dot": jax.jit(lambda a, b: jnp.dot(a.T if ta else a, b.T if tb else b,
                                                   precision=HIGHEST))}
    errors = {}
    default_target = cuda.TARGET_NAME
    for name, target in names:
      cuda.TARGET_NAME = target  # read when the function is traced (below)
      try:
        fns[name] = jax.jit(lambda a, b: _cuda(a, b, cuda.default_config(n, n, n, jnp.float32),
                                               ta, tb))
        errors[name] = f"relerr {relative_error(fns[name](a0, b0), ref):.1e}"
      except Exception as e:  # noqa: BLE001 - report the variant and go on
        print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        fns.pop(name, None)
      finally:
        cuda.TARGET_NAME = default_target
    _report_ratios(f"{n}^3 f32 ta={ta:d} tb={tb:d} (jnp.dot at HIGHEST)",
                   _interleaved_ms(fns, inputs, iterations if n <= 4096 else iterations // 2),
                   2 * n**3, errors)


SK_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (2048, 2048, 2048), (4097, 4097, 4097),
             (1024, 1024, 1024), (3000, 3000, 3000), (997, 1009, 1013), (2047, 8191, 1023),
             (256, 256, 16384), (16, 8192, 4096)]


def probe_cuda_sk(iterations: int = 40):
  """Stream-K on and off (cuda.Config.stream_k) for the 128x128 and 128x64 kernels, with
  jnp.dot HIGHEST called in turn (ratios to the adjacent jnp.dot call)."""
  for m, n, k in SK_SHAPES:
    inputs = _inputs((m, k), (k, n), jnp.float32)
    a0, b0 = inputs[0]
    ref = jnp.dot(a0, b0, precision=HIGHEST)
    fns = {"jnp.dot": jax.jit(lambda a, b: jnp.dot(a, b, precision=HIGHEST))}
    errors = {}
    default = cuda.default_config(m, n, k, jnp.float32)
    for config in (cuda.CONFIGS[1], cuda.CONFIGS[2]):
      for stream_k in (False, True):
        cfg = config.replace(stream_k=stream_k)
        name = f"{cfg.block_m}x{cfg.block_n} stream_k={stream_k:d}" + (
            " (default)" if cfg == default else "")
        fns[name] = jax.jit(lambda a, b, cfg=cfg: _cuda(a, b, cfg))
        errors[name] = f"relerr {relative_error(fns[name](a0, b0), ref):.1e}"
    flops = 2 * m * n * k
    _report_ratios(f"{m}x{n}x{k} f32 (jnp.dot at HIGHEST)",
                   _interleaved_ms(fns, inputs, iterations if flops < 2e11 else iterations // 2),
                   flops, errors)


MOSAIC_SK_SHAPES = [  # (m, n, k, dtype): rounds of default tiles over the H200's 132 SMs
    (4096, 4096, 4096, jnp.bfloat16),    # 3.88 rounds of 256x128 cluster tiles
    (8192, 8192, 8192, jnp.bfloat16),    # 15.5
    (8192, 8192, 8192, jnp.float16),     # 15.5
    (6144, 6144, 6144, jnp.bfloat16),    # 8.73
    (3072, 3072, 3072, jnp.bfloat16),    # 2.18
    (2048, 2048, 2048, jnp.bfloat16),    # 0.97
    (4097, 4097, 4097, jnp.bfloat16),    # 2.83 rounds of 256x192 tiles
]


def probe_mosaic_sk(iterations: int = 200):
  """The default mosaic config with stream-K on and off (Config.stream_k) vs jnp.dot,
  called in turn (CUPTI: ratios to the adjacent jnp.dot call); where the schedule's
  policy leaves stream-K off (it would save under _STREAM_K_MIN_SAVED_STEPS), also
  forced on. Then each function alone by wall clock over `iterations` queued calls."""
  import time  # noqa: PLC0415
  for m, n, k, dtype in MOSAIC_SK_SHAPES:
    inputs = _inputs((m, k), (k, n), dtype)
    a0, b0 = inputs[0]
    ref = jnp.dot(a0.astype(jnp.float32), b0.astype(jnp.float32), precision=HIGHEST)
    default = mosaic.default_config(m, n, k, dtype)
    fns = {"jnp.dot": jax.jit(jnp.dot)}
    notes, schedules = {}, []
    for name, cfg, min_saved in (("stream_k=1 (default)", default, None),
                                ("stream_k=0", default.replace(stream_k=False), None),
                                ("stream_k forced", default, 0)):
      fn, out, schedule = _traced_with_schedule(cfg, a0, b0, min_saved)
      schedules.append(schedule)
      if min_saved is not None and (schedule is None or schedules[0] is not None):
        continue  # forcing changes nothing here
      fns[name] = fn
      notes[name] = f"relerr {relative_error(out, ref):.1e}, stream-K {schedule}"
    flops = 2 * m * n * k
    ms = _interleaved_ms(fns, inputs, iterations if flops < 4e11 else iterations // 2)
    wall = {}
    for name, fn in fns.items():
      jax.block_until_ready([fn(*x) for x in inputs])
      start = time.perf_counter()
      jax.block_until_ready([fn(*inputs[i % len(inputs)]) for i in range(iterations)])
      wall[name] = (time.perf_counter() - start) / iterations
    for name in notes:
      notes[name] += f", wall clock {wall['jnp.dot'] / wall[name]:.3f}x jnp.dot"
    _report_ratios(f"{m}x{n}x{k} {jnp.dtype(dtype).name}, config {default}", ms, flops, notes)


def _traced_with_schedule(cfg, a, b, min_saved=None):
  """(jitted _mosaic with cfg, its output for a, b, the stream-K schedule it traced with);
  min_saved replaces mosaic._STREAM_K_MIN_SAVED_STEPS while it is traced."""
  seen, schedule, saved = [], mosaic.stream_k_schedule, mosaic._STREAM_K_MIN_SAVED_STEPS
  mosaic.stream_k_schedule = lambda *args: seen.append(schedule(*args)) or seen[-1]
  mosaic._STREAM_K_MIN_SAVED_STEPS = saved if min_saved is None else min_saved
  try:
    fn = jax.jit(lambda a, b: _mosaic(a, b, cfg))
    out = fn(a, b)
  finally:
    mosaic.stream_k_schedule, mosaic._STREAM_K_MIN_SAVED_STEPS = schedule, saved
  return fn, out, seen[-1]


def probe_once(what: str, n: int = 4096):
  import ctypes  # the driver's profiler switch: no CUDA toolkit needed
  dtype = jnp.float32 if what in ("cuda", "dot32") else jnp.bfloat16
  fn = {"cuda": lambda a, b: gemm(a, b, backend="cuda"),
        "dot32": lambda a, b: jnp.dot(a, b, precision=HIGHEST),
        "mosaic": lambda a, b: gemm(a, b, backend="mosaic"),
        "mosaic_nosk": lambda a, b: _mosaic(a, b, mosaic.default_config(
            n, n, n, jnp.bfloat16).replace(stream_k=False)),
        "dot16": jnp.dot}[what]
  (a, b), = _inputs((n, n), (n, n), dtype)[:1]
  f = jax.jit(fn)
  f(a, b).block_until_ready()
  libcuda = ctypes.CDLL("libcuda.so.1")
  libcuda.cuProfilerStart()
  f(a, b).block_until_ready()
  libcuda.cuProfilerStop()


def _gemm_calls(compiled_text: str) -> str:
  """The GEMM custom calls of an optimized HLO module: target[epilogue] x count."""
  calls = {}
  for line in compiled_text.splitlines():
    target = re.search(r'custom_call_target="([^"]+)"', line)
    if target is None or "fusion" in target.group(1):
      continue
    epi = re.search(r'"epilogue":"([A-Z_]+)"', line)
    key = target.group(1).replace("__cublas$lt$matmul", "cublasLt").replace("__cublas$gemm", "cublas")
    key += f"[{epi.group(1)}]" if epi else ""
    calls[key] = calls.get(key, 0) + 1
  return ", ".join(f"{k} x{v}" for k, v in sorted(calls.items()))


def probe_dense(m: int = 8192, d: int = 4096, hidden: int = 16384):
  """Which way of writing act(x @ w + bias) XLA compiles best inside a training step."""
  from benchmarks import mlp  # noqa: PLC0415
  from benchmarks.timing import pipelined_ms  # noqa: PLC0415
  from pallas_gemm import dense  # noqa: PLC0415
  bf16, f32 = jnp.bfloat16, jnp.float32
  params, x, y = mlp.problem(bf16, m, d, hidden)

  def layer(how):
    def f(x, w, b, act):
      if how == "stock":  # what a Flax model writes
        z = jnp.dot(x, w) + b
        return jax.nn.gelu(z) if act else z
      if how == "f32 dot":  # pallas_gemm's xla backend before session 9
        z = jnp.dot(x, w, preferred_element_type=f32) + b.astype(f32)
      elif how == "bf16 dot, f32 epilogue":
        z = jnp.dot(x, w).astype(f32) + b.astype(f32)
      return (jax.nn.gelu(z) if act else z).astype(bf16)
    return f

  variants = {how: layer(how) for how in ("stock", "f32 dot", "bf16 dot, f32 epilogue")}
  for backend in ("xla", "mosaic", "auto"):
    variants[f"dense {backend}"] = (
        lambda x, w, b, act, backend=backend: dense(x, w, b, "gelu" if act else None,
                                                    backend=backend))
  base = {}
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: bf16 MLP step "
        f"x {m}x{d}, hidden {hidden}, bias + GELU")
  for name, lay in variants.items():
    def forward(p, x, y, lay=lay):
      return lay(lay(x, p["w1"], p["b1"], True), p["w2"], p["b2"], False)
    for mode, fn in (("step", jax.value_and_grad(mlp.loss_of(forward))),
                     ("forward", lambda p, x, y, lay=lay: lay(x, p["w1"], p["b1"], True))):
      step = jax.jit(fn).lower(params, x, y).compile()
      ms = pipelined_ms(step, params, x, y, calls=20)
      base.setdefault(mode, ms)
      calls = _gemm_calls(step.as_text())
      print(f"{mode:7s} {name:24s} {ms:8.3f} ms {base[mode] / ms:6.3f}x stock  {calls}",
            flush=True)


def probe_step_gemms(m: int = 8192, d: int = 4096, hidden: int = 16384):
  bf16 = jnp.bfloat16
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: the bf16 MLP step's GEMMs "
        f"(x {m}x{d}, hidden {hidden}), CUPTI ms, median of 20, rotating inputs")
  # (label, a shape, b shape, transpose_a, transpose_b, bias length or 0, activation)
  cases = [("fwd1 x@W1+b1, gelu", (m, d), (d, hidden), False, False, hidden, "gelu"),
           ("fwd1 x@W1+b1 (z)", (m, d), (d, hidden), False, False, hidden, None),
           ("fwd2 h@W2+b2", (m, hidden), (hidden, d), False, False, d, None),
           ("dW2 h^T@g", (m, hidden), (m, d), True, False, 0, None),
           ("dh g@W2^T", (m, d), (hidden, d), False, True, 0, None),
           ("dW1 x^T@dz", (m, d), (m, hidden), True, False, 0, None)]
  for label, sa, sb, ta, tb, nb, act in cases:
    sets = _inputs(sa, sb, bf16)
    bias = jax.random.normal(jax.random.key(1), (nb,), bf16) if nb else None

    def expr(a, b):  # what a Flax model writes
      a = a.T if ta else a
      b = b.T if tb else b
      z = jnp.dot(a, b) if bias is None else jnp.dot(a, b) + bias
      return jax.nn.gelu(z) if act else z

    row = {"jnp.dot": _ms(expr, sets)}
    for backend in ("xla", "mosaic"):
      row[backend] = _ms(lambda a, b, backend=backend: gemm(
          a, b, transpose_a=ta, transpose_b=tb, bias=bias, activation=act, backend=backend),
          sets)
    print(f"{label:22s} " + "  ".join(f"{k} {v:.3f} ({row['jnp.dot'] / v:.3f}x)"
                                      for k, v in row.items()), flush=True)


def probe_gate(m: int = 8192, d: int = 4096, hidden: int = 16384):
  """The MLP step's hidden-gradient GEMM dz = g @ W2^T (m x hidden, K = d) with its epilogue
  variants on mosaic (plain; + C; * gelu'(C); * relu'(C)) and XLA's (cuBLAS + a fusion):
  what reading C costs against what the gate's arithmetic costs."""
  bf16 = jnp.bfloat16
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: dz = g @ W2^T, {m}x{hidden}x{d}"
        " bf16, CUPTI ms, median of 20, rotating g and W2")
  sets = _inputs((m, d), (hidden, d), bf16)
  z = jax.random.normal(jax.random.key(2), (m, hidden), bf16)
  config = tuning.resolve_config("mosaic", m, hidden, d, jnp.dtype(bf16), None,
                                 out_dtype=jnp.dtype(bf16), c_dtype=jnp.dtype(bf16))
  print(f"  mosaic config with C: {config}")

  def mos(c=None, gate=None):
    return lambda g, w: _mosaic(g, w, config, transpose_b=True, c=c, c_gate=gate)

  rows = {"jnp.dot": lambda g, w: g @ w.T,
          "jnp.dot * gelu'(z) (XLA)": lambda g, w: epilogue.apply(
              (g @ w.T).astype(jnp.float32), z, None, beta=0.0, activation=None,
              out_dtype=bf16, c_gate="gelu"),
          "mosaic": mos(), "mosaic + C": mos(z), "mosaic * relu'(C)": mos(z, "relu"),
          "mosaic * gelu'(C)": mos(z, "gelu")}
  base = _ms(rows["jnp.dot"], sets)
  for label, fn in rows.items():
    ms = base if label == "jnp.dot" else _ms(fn, sets)
    print(f"  {label:26s} {ms:7.3f} ms  {base / ms:6.3f}x jnp.dot", flush=True)


# Pingpong variants of a config (Config.pingpong): the two consumer warpgroups take whole
# tiles in turn, so one's epilogue runs beside the other's main loop.
PINGPONG_VARIANTS = {  # wgmma_wait=1: one warpgroup alone keeps the tensor cores fed
    "pp 128x128 cl_n2 s6": dict(block_m=128, block_n=128, stages=6, cluster_m=1, cluster_n=2),
    "pp 128x128 cl_m2 s6": dict(block_m=128, block_n=128, stages=6, cluster_m=2, cluster_n=1),
    "pp 64x256 cl_m2 s4": dict(block_m=64, block_n=256, stages=4, cluster_m=2, cluster_n=1),
    "pp 64x256 cl_n2 s4": dict(block_m=64, block_n=256, stages=4, cluster_m=1, cluster_n=2),
}


def _pingpong(config, fields):
  return config.replace(pingpong=True, stream_k=None, producer="warp", num_compute_wgs=2,
                        epi_block_m=64, epi_block_n=64, wgmma_wait=1, **fields)


def probe_step_tiles(m: int = 8192, d: int = 4096, hidden: int = 16384,
                     iterations: int = 40):
  """The five mosaic GEMMs of `pallas_gemm.mlp`'s bf16 step as the step runs them (layout,
  bias, keep_pre GELU, gelu'(C) gate), each with the shape's default config and pingpong
  variants, called in turn with the jnp.dot expression (CUPTI ms per call, ratios to the
  adjacent expression call)."""
  bf16 = jnp.bfloat16
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: mlp step GEMMs, x {m}x{d}, "
        f"hidden {hidden}, bf16, CUPTI, {iterations} interleaved iterations")
  key = iter(jax.random.split(jax.random.key(3), 8))
  b1 = jax.random.normal(next(key), (hidden,), jnp.float32)
  b2 = jax.random.normal(next(key), (d,), jnp.float32)
  z = jax.random.normal(next(key), (m, hidden), bf16)
  # (label, a shape, b shape, transpose_a, transpose_b, kwargs of mosaic.gemm, jnp expression)
  cases = [
      ("fwd1 x@W1+b1 gelu,z", (m, d), (d, hidden), False, False,
       dict(bias=b1, activation="gelu", keep_pre=True),
       lambda a, b: (lambda y: (jax.nn.gelu(y), y))(a @ b + b1.astype(bf16))),
      ("fwd2 h@W2+b2", (m, hidden), (hidden, d), False, False, dict(bias=b2),
       lambda a, b: a @ b + b2.astype(bf16)),
      ("dW2 h^T@g", (m, hidden), (m, d), True, False, {}, lambda a, b: a.T @ b),
      ("dh g@W2^T * gelu'(z)", (m, d), (hidden, d), False, True,
       dict(c=z[None], beta=1.0, c_gate="gelu"),
       lambda a, b: epilogue.apply((a @ b.T).astype(jnp.float32), z, None, beta=0.0,
                                   activation=None, out_dtype=bf16, c_gate="gelu")),
      ("dW1 x^T@dz", (m, d), (m, hidden), True, False, {}, lambda a, b: a.T @ b)]
  for label, sa, sb, ta, tb, kw, expr in cases:
    sets = _inputs(sa, sb, bf16)
    mm, nn = (sa[1] if ta else sa[0]), (sb[0] if tb else sb[1])
    kk = sa[0] if ta else sa[1]
    base = tuning.resolve_config("mosaic", mm, nn, kk, jnp.dtype(bf16), None,
                                 c_dtype=jnp.dtype(bf16) if "c" in kw else None)
    configs = {"default": base} | {
        name: _pingpong(base, fields) for name, fields in PINGPONG_VARIANTS.items()}
    fns = {"jnp.dot": jax.jit(expr)}  # the expression
    want = jax.tree.leaves(fns["jnp.dot"](*sets[0]))[0].astype(jnp.float32)
    print(f"{label:24s} {mm}x{nn}x{kk}; default {base}", flush=True)
    for name, cfg in configs.items():
      kwargs = {"c": None, "alpha": 1.0, "beta": 0.0} | kw

      def fn(a, b, cfg=cfg, kwargs=kwargs):
        return mosaic.gemm(a[None], b[None], transpose_a=ta, transpose_b=tb, precision=None,
                           out_dtype=bf16, config=cfg, interpret=False, **kwargs)
      try:
        got = jax.tree.leaves(jax.jit(fn)(*sets[0]))[0][0].astype(jnp.float32)
      except Exception as e:  # noqa: BLE001 - an invalid variant is reported, not fatal
        print(f"   {name:22s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        continue
      print(f"   {name:22s} relerr vs the expression {relative_error(got, want):.1e}",
            flush=True)
      fns[name] = jax.jit(fn)
    _report_ratios(label, _interleaved_ms(fns, sets, iterations), 2 * mm * nn * kk)


def probe_split_kernels(*sizes):
  """float32_accurate (mosaic, bf16 pieces split by an XLA pass): the kernels of one call at
  each n^3 (CUPTI, by name) and the fusions of the optimized HLO, to see whether XLA makes
  the split, the operand's transpose and the TMA padding one pass."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # noqa: PLC0415 - GPU-only import
  ext = mosaic_gpu_lib._mosaic_gpu_ext
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: float32_accurate kernels")
  for n in sizes or (4096, 4097):
    (a, b), = _inputs((n, n), (n, n), jnp.float32)[:1]
    f = jax.jit(lambda a, b: gemm(a, b, precision="float32_accurate", backend="mosaic"))
    compiled = f.lower(a, b).compile()
    fusions = [f"{name} {shape}" for name, shape in re.findall(
        r"^\s*(%\S+) = (\S+) fusion\(", compiled.as_text(), re.M)]
    jax.block_until_ready(f(a, b))
    ext._cupti_init()
    try:
      jax.block_until_ready([f(a, b) for _ in range(5)])
    finally:
      timings = ext._cupti_get_timings(True)
    by_name = {}
    for kernel, ms in timings:
      by_name[kernel] = by_name.get(kernel, 0.0) + ms / 5
    print(f"-- {n}^3: {sum(by_name.values()):.3f} ms per call; fusions in the HLO: {fusions}")
    for kernel, ms in sorted(by_name.items(), key=lambda kv: -kv[1]):
      print(f"   {ms:7.3f} ms  {kernel[:110]}", flush=True)
    if os.environ.get("OUT"):
      pathlib.Path(os.environ["OUT"], f"split_{n}.hlo.txt").write_text(compiled.as_text())
  _split_formulations()


def _split_formulations(n: int = 4096):
  """Ways to write the pieces pass alone (XLA, no kernel), for a K-major operand and for
  one transposed on the way: how many fusions XLA makes of each, and their CUPTI time."""
  from pallas_gemm import precision as precisions  # noqa: PLC0415

  def stacked(x, axis):
    return jnp.stack(precisions.split(x, 3), axis=axis).reshape(-1, *x.shape[1:])

  def selected(x):  # one elementwise expression over (batch, pieces, rows, cols)
    parts = precisions.split(x, 3)
    which = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], 3) + x.shape[1:], 1)
    out = jnp.broadcast_to(parts[2][:, None], which.shape)
    for i in (1, 0):
      out = jnp.where(which == i, parts[i][:, None], out)
    return out.reshape(-1, *x.shape[1:])

  def per_piece(x):  # three outputs, no stacking: a kernel could take three operands
    return tuple(precisions.split(x, 3))

  forms = {"stack axis 1 (now)": lambda x: stacked(x, 1), "stack axis 0": lambda x: stacked(x, 0),
           "select": selected, "three arrays": per_piece}
  x = jax.random.normal(jax.random.key(5), (1, n, n), jnp.float32)
  print(f"-- the pieces pass alone, f32 (1, {n}, {n}) -> 3 bf16 pieces (64 MB in, 96 MB out)")
  for label, form in forms.items():
    for layout, fn in (("K-major", form), ("transposed", lambda x, form=form: form(
        jnp.swapaxes(x, 1, 2)))):
      compiled = jax.jit(fn).lower(x).compile()
      # (a multi-output fusion's shape is a tuple with spaces: session 12's run 6 missed those)
      fusions = re.findall(r"^\s*%\S+ = [^=]*? fusion\(", compiled.as_text(), re.M)
      ms = _ms(fn, [(x,)])
      print(f"   {label:20s} {layout:10s} {len(fusions)} fusions  {ms:7.3f} ms", flush=True)


def probe_step_kernels(top: int = 14):
  """The kernels of one bf16 MLP step per `--mlp` variant (CUPTI, by name), then the
  mosaic GEMMs of `mlp`'s step one by one in launch order."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # noqa: PLC0415 - GPU-only import
  from benchmarks import mlp  # noqa: PLC0415
  ext = mosaic_gpu_lib._mosaic_gpu_ext
  params, x, y = mlp.problem(jnp.bfloat16)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: kernels of one bf16 MLP step")

  def kernels(forward, steps=5):  # [(kernel, ms)] of each of `steps` steps
    step = jax.jit(jax.value_and_grad(mlp.loss_of(forward)))
    jax.block_until_ready(step(params, x, y))
    ext._cupti_init()
    try:
      jax.block_until_ready([step(params, x, y) for _ in range(steps)])
    finally:
      timings = ext._cupti_get_timings(True)
    per_step = len(timings) // steps
    return [timings[i * per_step:(i + 1) * per_step] for i in range(steps)]

  forwards = mlp.variants(None)
  for name, forward in forwards.items():
    steps = kernels(forward)
    by_name = {}
    for kernel, ms in (t for one in steps for t in one):
      count, total = by_name.get(kernel, (0, 0.0))
      by_name[kernel] = (count + 1, total + ms / len(steps))
    total = sum(t for _, t in by_name.values())
    print(f"-- {name}: {total:.3f} ms per step in {len(steps[0])} kernels", flush=True)
    for kernel, (count, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
      print(f"   {ms:7.3f} ms  x{count // len(steps):<3d} {kernel[:110]}")

  steps = kernels(forwards["mlp mosaic"], steps=10)
  gemms = np.median(np.array([[ms for k, ms in one if "mosaic" in k] for one in steps]), axis=0)
  print(f"-- mlp mosaic: GEMMs in launch order (median of {len(steps)} steps) "
        + " ".join(f"{ms:.3f}" for ms in gemms) + f" = {gemms.sum():.3f} ms; step "
        f"{np.median([sum(ms for _, ms in one) for one in steps]):.3f} ms", flush=True)


def _schedule(compiled_text: str) -> str:
  """The entry computation's custom calls (G) and collectives, in scheduled order."""
  entry = compiled_text[compiled_text.index("ENTRY"):]
  short = {"custom-call": "G", "command_buffer": "CB", "call": "CALL",
           "all-reduce-start": "AR<", "all-reduce-done": "AR>", "all-reduce": "AR",
           "reduce-scatter": "RS", "all-gather-start": "AG<", "all-gather-done": "AG>",
           "all-gather": "AG"}
  ops = re.findall(r"\s(" + "|".join(map(re.escape, short)) + r")\(", entry)
  return " ".join(short[op] for op in ops)


def probe_ksplit(n: int = 16384):
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  from benchmarks.timing import pipelined_ms  # noqa: PLC0415
  devices = jax.devices()
  print(f"{devices[0].device_kind} x {len(devices)}, jax {jax.__version__}, bf16 {n}^3, K sharded")
  if len(devices) < 2:
    print("ksplit needs >= 2 devices")
    return
  d = len(devices)
  mesh = jax.make_mesh((d,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.jit(lambda: jax.random.normal(ka, (n, n), jnp.bfloat16),
              out_shardings=NamedSharding(mesh, P(None, "d")))()
  b = jax.jit(lambda: jax.random.normal(kb, (n, n), jnp.bfloat16),
              out_shardings=NamedSharding(mesh, P("d")))()
  flops = 2 * n**3
  ref = jax.jit(jnp.dot).lower(a, b).compile()
  base = pipelined_ms(ref, a, b)
  expect = jnp.dot(a, b, preferred_element_type=jnp.float32)
  print(f"jnp.dot                        {base:7.3f} ms {flops / base / 1e9:7.1f} TFLOP/s  "
        f"1.000x  [{_schedule(ref.as_text())}]", flush=True)
  sms = tuning.num_sms()

  def local(chunks, ctas, how):
    rows = n // chunks
    cfg = dataclasses.replace(mosaic.default_config(rows, n, n // d, jnp.bfloat16,
                                                    out_dtype=jnp.float32), num_sms=ctas)
    # On a CPU (checking the probe itself) XLA stands in: the interpreter's simulated GPU
    # state does not survive two devices.
    backend, cfg = ("mosaic", cfg) if jax.default_backend() == "gpu" else ("xla", None)

    def f(a, b):
      outs = []
      for i in range(chunks):
        part = gemm(a[i * rows:(i + 1) * rows], b, out_dtype=jnp.float32, backend=backend,
                    config=cfg)
        if outs:
          # XLA combines independent all-reduces into one (after the last GEMM): chaining
          # chunk i's collective input to chunk i-1's result keeps them apart, and leaves
          # chunk i-1's collective free to run during chunk i's GEMM.
          part, outs[-1] = jax.lax.optimization_barrier((part, outs[-1]))
        if how == "psum":
          outs.append(jax.lax.psum(part, "d").astype(jnp.bfloat16))
        elif how == "rs+ag":
          part = jax.lax.psum_scatter(part, "d", scatter_dimension=0, tiled=True)
          outs.append(jax.lax.all_gather(part.astype(jnp.bfloat16), "d", axis=0, tiled=True))
        else:  # no collective: the local GEMMs alone
          outs.append(part.astype(jnp.bfloat16))
      return jnp.concatenate(outs)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "d"), P("d")),
                                 out_specs=P(), check_vma=False)).lower(a, b).compile()

  variants = [(1, sms, "none"), (1, sms - 32, "none"), (1, sms, "psum"), (1, sms, "rs+ag"),
              (4, sms - 32, "psum"), (4, sms - 32, "rs+ag"), (8, sms - 32, "psum"),
              (8, sms - 32, "rs+ag"), (8, sms - 24, "rs+ag"), (4, sms - 16, "rs+ag")]
  dump = os.environ.get("OUT")
  for chunks, ctas, how in variants:
    fn = local(chunks, ctas, how)
    if dump and chunks == 4 and how == "psum":
      pathlib.Path(dump, f"ksplit_{chunks}x{ctas}_{how}.hlo.txt").write_text(fn.as_text())
    ms = pipelined_ms(fn, a, b)
    err = "" if how == "none" else f"err {relative_error(fn(a, b), expect):.1e}"
    print(f"{chunks} chunks {ctas:3d} CTAs {how:6s}     {ms:7.3f} ms {flops / ms / 1e9:7.1f} "
          f"TFLOP/s {base / ms:6.3f}x {err} [{_schedule(fn.as_text())}]",
          flush=True)


if __name__ == "__main__":
  what, *rest = sys.argv[1:] or ["cuda"]
  probes = {"cuda": probe_cuda, "ragged": probe_ragged, "mosaic": probe_mosaic,
            "ab": probe_ab, "power": probe_power, "triton": probe_triton,
            "cuda_sk": probe_cuda_sk, "mosaic_sk": probe_mosaic_sk, "dense": probe_dense,
            "step_gemms": probe_step_gemms, "step_kernels": probe_step_kernels,
            "step_tiles": probe_step_tiles, "split_kernels": probe_split_kernels,
            "ksplit": probe_ksplit, "gate": probe_gate}
  if what == "cuda_ab":
    probe_cuda_ab(*rest)
  elif what == "once":
    probe_once(rest[0], *(int(x) for x in rest[1:]))
  else:
    probes[what](*(x if "x" in x else int(x) for x in rest))
