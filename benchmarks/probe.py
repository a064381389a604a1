"""GPU probes for tuning the kernels: device-side (CUPTI) timing of one question at a time.

  python -m benchmarks.probe configs [N|MxNxK ..]   mosaic configs (tiles, clusters, tile
                         order) vs jnp.dot and JAX's hopper_matmul_mgpu at its best; default
                         bf16 4096^3, 8192^3, 4097^3 and f16 8192^3
  python -m benchmarks.probe ab N|MxNxK FIELD=V[,FIELD=V] ..  the shape's default mosaic
                         config with the given fields replaced, each variant called in turn
                         with jnp.dot (bf16; ratios to the adjacent jnp.dot call), e.g.
                         `ab 8192 wgmma_wait=1 grid_tile_width=16 stream_k=False`
  python -m benchmarks.probe cuda [N]      every compiled cuda config x transpose case at N^3
                         (and the untiled textbook kernel) vs jnp.dot HIGHEST
  python -m benchmarks.probe cuda_ab LIB..  builds of cuda_sgemm.cu (e.g. with different -D
                         switches, see device_run.sh's cuda_ab stage) vs jnp.dot HIGHEST, called
                         in turn, each under its own FFI target: NN/TN/NT/TT 4096^3, NN 8192^3
  python -m benchmarks.probe kernels step   the kernels of one bf16 MLP SGD step (the shape
                         of `benchmarks --mlp`) per variant, by name, CUPTI time per step
  python -m benchmarks.probe kernels accurate [N ..]  float32_accurate's kernels (the split
                         pass and the GEMM) and the fusions of its optimized HLO
  python -m benchmarks.probe pad [N]       where the time of a misaligned (N+1)^3 bf16 mosaic
                         GEMM goes: padding copies, output slice, kernel
  python -m benchmarks.probe power [N]     SM clock and board power while jnp.dot / mosaic /
                         triton run back to back (bf16 N^3, nvidia-smi)
  python -m benchmarks.probe once WHAT [N]  one compiled, warmed-up GEMM between
                         cuProfilerStart / Stop, for `ncu --profile-from-start off` (WHAT:
                         cuda, dot32 = jnp.dot HIGHEST f32, mosaic, dot16 = jnp.dot bf16), so
                         that XLA's autotuning launches are not captured

Inputs are standard normal, rotated over enough sets to overflow L2. Every probe prints
the device and jax version first.
"""

import ast
import math
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.matmul import cuda, mosaic, tuning
from pallas_gemm import gemm
from pallas_gemm.testing.reference import relative_error

HIGHEST = jax.lax.Precision.HIGHEST


def _header(what: str):
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {what}", flush=True)


def _shape(spec) -> tuple[int, int, int]:
  """'4096' -> (4096,) * 3; '256x512x1024' -> (256, 512, 1024) as M, N, K."""
  spec = str(spec)
  return tuple(map(int, spec.split("x"))) if "x" in spec else (int(spec),) * 3


def _inputs(shape_a, shape_b, dtype):
  set_bytes = np.dtype(dtype).itemsize * (math.prod(shape_a) + math.prod(shape_b))
  return tuning.random_inputs(shape_a, shape_b, dtype, tuning.input_set_count(set_bytes))


def _ms(fn, inputs):
  return float(np.median(tuning.time_gpu_ms(jax.jit(fn), inputs, iterations=20)))


def _mosaic(config):
  return lambda a, b: gemm(a, b, backend="mosaic", config=config)


# ----------------------------------------------------------------------------- configs, ab


def _hopper_best(inputs):
  """JAX's hopper_matmul_mgpu: the best median over a small sweep of its own configs."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # noqa: PLC0415
  dim = hm.MatmulDimension
  best = (math.inf, None)
  for wg, cluster, width in ((dim.N, None, 4), (dim.N, dim.M, 4), (dim.N, dim.N, 4),
                             (dim.M, None, 4), (dim.M, dim.N, 4), (dim.N, None, 8)):
    cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                          grid_minor_dim=dim.N, grid_tile_width=width, wg_dimension=wg,
                          cluster_dimension=cluster)
    try:
      best = min(best, (_ms(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg), inputs), str(cfg)))
    except Exception as e:  # noqa: BLE001 - a config its rules refuse
      print(f"    hopper {cfg}: {type(e).__name__} {str(e)[:80]}")
  return best


def probe_configs(*sizes):
  """Mosaic configs vs jnp.dot (and hopper_matmul_mgpu on shapes it takes)."""
  Cfg = mosaic.Config
  tall = dict(block_m=256, block_n=128, wg_split="m")
  configs = {
      "default": None,
      "256x128 cluster_n2": Cfg(**tall, cluster_n=2),
      "256x128 cluster_n2 wait1": Cfg(**tall, cluster_n=2, wgmma_wait=1),
      "256x128 cluster_n2 grid m": Cfg(**tall, cluster_n=2, grid_minor_dim="m"),
      "256x128 cluster_n2 width 4": Cfg(**tall, cluster_n=2, grid_tile_width=4),
      "256x128 cluster_n2 width 16": Cfg(**tall, cluster_n=2, grid_tile_width=16),
      "128x256": Cfg(block_m=128, block_n=256, wg_split="n"),
      "128x256 cluster_m2": Cfg(block_m=128, block_n=256, cluster_m=2),
      "256x128": Cfg(**tall),
      "256x192 s3": Cfg(block_m=256, block_n=192, wg_split="m", stages=3),
  }
  cases = ([(_shape(s), jnp.bfloat16) for s in sizes] if sizes else
           [((n,) * 3, dt) for n, dt in ((4096, jnp.bfloat16), (8192, jnp.bfloat16),
                                        (8192, jnp.float16), (4097, jnp.bfloat16))])
  for (m, n, k), dtype in cases:
    inputs = _inputs((m, k), (k, n), dtype)
    ref = jnp.dot(*inputs[0], preferred_element_type=jnp.float32)
    tflops = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e12  # noqa: E731
    dot = tflops(_ms(jnp.dot, inputs))
    line = f"{m}x{n}x{k} {jnp.dtype(dtype).name}: jnp.dot {dot:.1f} TFLOP/s"
    if m % 256 == 0 and n % 256 == 0 and k % 64 == 0:
      hop_ms, hop_cfg = _hopper_best(inputs)
      line += f", hopper_matmul_mgpu best {tflops(hop_ms):.1f} ({hop_cfg})"
    _header(line)
    for name, cfg in configs.items():
      cfg = cfg or mosaic.default_config(m, n, k, dtype)
      try:
        err = relative_error(jax.jit(_mosaic(cfg))(*inputs[0]), ref)
        t = tflops(_ms(_mosaic(cfg), inputs))
      except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  {name:38s} failed: {type(e).__name__} {str(e)[:150]}", flush=True)
        continue
      print(f"  {name:38s} {t:6.1f} TFLOP/s  {t / dot:.3f}x jnp.dot  relerr {err:.1e}", flush=True)


def _fields(spec: str) -> dict:
  """'wgmma_wait=1,stream_k=False' -> {'wgmma_wait': 1, 'stream_k': False}."""
  out = {}
  for item in spec.split(","):
    name, _, value = item.partition("=")
    try:
      out[name] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[name] = value  # a bare word: "m", "n"
  return out


def probe_ab(size, *variants, iterations: int = 200):
  """Differences of ~1% between mosaic variants and jnp.dot, measured call by call.

  A power-capped GPU moves its clock within milliseconds, so separately timed runs of
  20-30 calls disagree by several percent. Here every iteration calls jnp.dot and each
  variant back to back (one CUPTI capture, the order rotated per iteration), each
  variant's time is compared with the jnp.dot call of its iteration, and the median and
  10th/90th percentiles of those ratios are reported.
  """
  m, n, k = _shape(size)
  dtype = jnp.bfloat16
  inputs = _inputs((m, k), (k, n), dtype)
  ref = jnp.dot(*(x.astype(jnp.float32) for x in inputs[0]), precision=HIGHEST)
  base = mosaic.default_config(m, n, k, dtype)
  fns, notes = {"jnp.dot": jax.jit(jnp.dot)}, {}
  for name in ("default",) + variants:
    cfg = base if name == "default" else base.replace(**_fields(name))
    fns[name] = jax.jit(_mosaic(cfg))
    notes[name] = f"relerr {relative_error(fns[name](*inputs[0]), ref):.1e}"
  _report_ratios(f"{m}x{n}x{k} bf16, default {base}, {iterations} interleaved iterations",
                 _interleaved_ms(fns, inputs, iterations), 2 * m * n * k, notes)


def _report_ratios(case: str, ms, flops: float, notes=None):
  """Prints the median TFLOP/s of ms["jnp.dot"] and, for every other entry, its median
  and 10th/90th percentile ratio to the jnp.dot call of the same iteration."""
  tflops = lambda t: flops / (t * 1e-3) / 1e12  # noqa: E731
  _header(f"{case}: jnp.dot {tflops(np.median(ms['jnp.dot'])):.1f} TFLOP/s (median)")
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
  order = lambda i: names[i % len(names):] + names[:i % len(names)]  # noqa: E731 - no fixed slot
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


# ----------------------------------------------------------------------------- cuda


def probe_cuda(n: int = 4096):
  inputs = _inputs((n, n), (n, n), jnp.float32)
  ref = jnp.dot(*inputs[0], precision=HIGHEST)
  tflops = lambda ms: 2 * n**3 / (ms * 1e-3) / 1e12  # noqa: E731
  base = tflops(_ms(lambda a, b: jnp.dot(a, b, precision=HIGHEST), inputs))
  _header(f"{n}^3 f32: jnp.dot HIGHEST {base:.1f} TFLOP/s")
  default = cuda.default_config(n, n, n, jnp.float32)
  t = tflops(_ms(lambda a, b: gemm(a, b, backend="cuda"), inputs))
  print(f"  gemm(backend='cuda') default {default.astuple()}: {t:6.1f} TFLOP/s  {t / base:.3f}x jnp.dot")
  for fields in cuda.compiled_configs():
    config = cuda.Config(**dict(zip(cuda._CONFIG_FIELDS, fields)))
    for ta, tb in ((False, False), (True, False), (False, True), (True, True)):
      if config.is_textbook and (ta or tb):
        continue
      fn = lambda a, b: gemm(a, b, transpose_a=ta, transpose_b=tb, backend="cuda", config=config)  # noqa: E731
      a0, b0 = inputs[0]
      err = relative_error(fn(a0.T if ta else a0, b0.T if tb else b0), ref)
      t = tflops(_ms(fn, inputs))
      print(f"  {fields} ta={ta:d} tb={tb:d}: {t:6.1f} TFLOP/s  {t / base:.3f}x jnp.dot  "
            f"{t / 67.0:5.1%} of FP32 peak  relerr {err:.1e}", flush=True)


def _cuda(a, b, config, transpose_a=False, transpose_b=False):
  """cuda.gemm itself (IEEE f32), without gemm()'s per-plan caches (which would also keep
  the FFI target of the first trace: probe_cuda_ab swaps it)."""
  return cuda.gemm(a[None], b[None], None, alpha=1.0, beta=0.0, transpose_a=transpose_a,
                   transpose_b=transpose_b, precision=HIGHEST, out_dtype=jnp.float32,
                   config=config, interpret=False)[0]


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


# ----------------------------------------------------------------------------- kernels


def _kernel_times(fn, args, calls: int) -> list[list[tuple[str, float]]]:
  """[(kernel name, ms)] of each of `calls` calls of a compiled, warmed-up fn (CUPTI)."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # noqa: PLC0415 - GPU-only import
  ext = mosaic_gpu_lib._mosaic_gpu_ext
  jax.block_until_ready(fn(*args))
  ext._cupti_init()
  try:
    jax.block_until_ready([fn(*args) for _ in range(calls)])
  finally:
    timings = ext._cupti_get_timings(True)
  per_call = len(timings) // calls
  return [timings[i * per_call:(i + 1) * per_call] for i in range(calls)]


def kernels_by_name(calls, devices: int = 1) -> dict[str, tuple[float, float]]:
  """{kernel name: (launches, ms)} per call and device of `_kernel_times`' calls (CUPTI
  sees every device's kernels: `devices` divides them)."""
  totals = {}
  for kernel, ms in (t for one in calls for t in one):
    count, total = totals.get(kernel, (0, 0.0))
    totals[kernel] = (count + 1, total + ms)
  per = len(calls) * devices
  return {k: (count / per, total / per) for k, (count, total) in totals.items()}


def ranked_kernels(fn, args, calls: int, devices: int = 1, top: int | None = None) -> dict:
  """A compiled fn's kernels by name, most time first, per call and device:
  dict(kernel_ms, launches, kernels=[dict(name, count, ms)]) (the first `top`)."""
  by_name = kernels_by_name(_kernel_times(fn, args, calls), devices)
  ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
  return dict(kernel_ms=sum(ms for _, ms in by_name.values()),
              launches=sum(c for c, _ in by_name.values()),
              kernels=[dict(name=k, count=c, ms=ms) for k, (c, ms) in ranked[:top]])


def print_kernels(label: str, found: dict, top: int = 14):
  """`ranked_kernels`' result, one line a kernel."""
  print(f"-- {label}: {found['kernel_ms']:.3f} ms per call in {found['launches']:.0f}"
        " kernels", flush=True)
  for k in found["kernels"][:top]:
    print(f"   {k['ms']:7.3f} ms  x{k['count']:<5.1f} {k['name'][:110]}", flush=True)


def probe_kernels(what: str = "step", *sizes):
  if what == "step":
    from benchmarks import mlp  # noqa: PLC0415
    _header("kernels of one bf16 MLP SGD step per variant (CUPTI)")
    _, dtype, precision, shape = mlp.PROBLEMS[0]
    params, x, y = mlp.problem(dtype, *shape)
    for name, forward in mlp.forwards(precision, extra=True).items():
      if name == mlp.AGAIN:
        continue
      step, state = mlp.train_step(forward, "sgd", params)
      print_kernels(name, ranked_kernels(jax.jit(lambda x, y: step(state, x, y)), (x, y), 5))
  elif what == "accurate":
    _header("float32_accurate: its kernels and the fusions of its optimized HLO")
    for n in [int(s) for s in sizes] or (4096, 4097):
      (a, b), = _inputs((n, n), (n, n), jnp.float32)[:1]
      f = jax.jit(lambda a, b: gemm(a, b, precision="float32_accurate", backend="mosaic"))
      compiled = f.lower(a, b).compile()
      fusions = [f"{name} {shape}" for name, shape in re.findall(
          r"^\s*(%\S+) = (\S+) fusion\(", compiled.as_text(), re.M)]
      print_kernels(f"{n}^3; fusions in the HLO: {fusions}", ranked_kernels(f, (a, b), 5))
      if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], f"accurate_{n}.hlo.txt").write_text(compiled.as_text())
  else:
    raise SystemExit(f"kernels: WHAT is step or accurate, not {what!r}")


# ----------------------------------------------------------------------------- pad, power, once


def probe_pad(n: int = 4096):
  r = n + 1
  _header(f"where the time of a bf16 {r}^3 mosaic GEMM goes (CUPTI)")
  inputs = _inputs((r, r), (r, r), jnp.bfloat16)
  padded = _inputs((r + 7, r + 63), (r + 63, r + 63), jnp.bfloat16)
  aligned = _inputs((n + 64, n + 64), (n + 64, n + 64), jnp.bfloat16)
  mosaic_gemm = lambda a, b: gemm(a, b, backend="mosaic")  # noqa: E731
  rows = [
      (f"gemm mosaic {r}^3", mosaic_gemm, inputs),
      (f"jnp.dot {r}^3", jnp.dot, inputs),
      ("pad A and B", lambda a, b: (jnp.pad(a, ((0, 7), (0, 63))), jnp.pad(b, ((0, 63), (0, 63)))), inputs),
      ("slice the output", lambda a, b: a[:r, :r] * 1, padded),
      (f"gemm mosaic {r + 7}x{r + 63}x{r + 63} (no padding)", mosaic_gemm, padded),
      (f"gemm mosaic {n + 64}^3 aligned", mosaic_gemm, aligned),
  ]
  for name, fn, args in rows:
    print(f"  {name:45s} {_ms(fn, args):.4f} ms", flush=True)


def probe_power(n: int = 8192, seconds: float = 4.0):
  """Clock and power while one GEMM runs back to back (bf16 n^3): jnp.dot, mosaic, triton.

  nvidia-smi samples the SM clock and board power every 50 ms during each ~`seconds` run;
  the median of each and the throughput by wall clock over the run are printed.
  """
  import subprocess  # noqa: PLC0415
  import time  # noqa: PLC0415
  inputs = _inputs((n, n), (n, n), jnp.bfloat16)
  fns = {"jnp.dot": jax.jit(jnp.dot),
         "mosaic (default)": jax.jit(lambda a, b: gemm(a, b, backend="mosaic")),
         "triton (default)": jax.jit(lambda a, b: gemm(a, b, backend="triton"))}
  _header(f"{n}^3 bf16, ~{seconds} s each, back to back")
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


def probe_once(what: str, n: int = 4096):
  import ctypes  # noqa: PLC0415 - the driver's profiler switch: no CUDA toolkit needed
  dtype = jnp.float32 if what in ("cuda", "dot32") else jnp.bfloat16
  fn = {"cuda": lambda a, b: gemm(a, b, backend="cuda"),
        "dot32": lambda a, b: jnp.dot(a, b, precision=HIGHEST),
        "mosaic": lambda a, b: gemm(a, b, backend="mosaic"),
        "dot16": jnp.dot}[what]
  (a, b), = _inputs((n, n), (n, n), dtype)[:1]
  f = jax.jit(fn)
  f(a, b).block_until_ready()
  libcuda = ctypes.CDLL("libcuda.so.1")
  libcuda.cuProfilerStart()
  f(a, b).block_until_ready()
  libcuda.cuProfilerStop()


PROBES = {"configs": probe_configs, "cuda": probe_cuda, "pad": probe_pad, "power": probe_power}


def main(argv: list[str]) -> int:
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0
  what, *rest = argv
  if what == "ab":
    probe_ab(*rest)
  elif what == "cuda_ab":
    probe_cuda_ab(*rest)
  elif what == "kernels":
    probe_kernels(*rest)
  elif what == "once":
    probe_once(rest[0], *(int(x) for x in rest[1:]))
  elif what in PROBES:
    PROBES[what](*(x if "x" in x else int(x) for x in rest))
  else:
    print(f"unknown probe {what!r}; see --help", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
