"""The measurement loop: for each (shape, dtype), jnp.dot first, then every backend.

Per (shape, dtype): one set of random-normal inputs per L2-overflowing rotation slot,
one IEEE-f32 reference from the first set, then for each backend: build the call,
check it against the reference (--correctness), time it. jnp.dot with the same
precision and output dtype runs first in the same process, so every row's ratio
compares against a baseline measured minutes, not days, apart.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time

import jax
import jax.numpy as jnp

import pallas_gemm
from pallas_gemm.testing import reference as ref_lib
from pallas_gemm.matmul import tuning

from benchmarks import shapes as shapes_lib
from benchmarks.timing import Timer

DOT = "jnp.dot"
HOPPER = "jax-hopper"  # jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu, for comparison
AUTO = "auto"  # gemm(backend="auto"): what a user gets by default
BACKEND_ALIASES = {"dot": DOT, "jnp": DOT, "hopper": HOPPER}


class NotApplicable(Exception):
  """This backend does not handle this problem (reported as "n/a", not as a failure)."""


def available_backends() -> dict[str, str | None]:
  status = {AUTO: None, **pallas_gemm.backends()}
  status[HOPPER] = _hopper_reason()
  return status


def _hopper_reason() -> str | None:
  if jax.default_backend() != "gpu":
    return "needs an sm_90 GPU"
  device = jax.devices()[0]
  cc = str(getattr(device, "compute_capability", ""))
  if not (cc.startswith("9.0") or tuning.device_family(device.device_kind) == "sm_90"):
    return f"needs sm_90, device has {cc or device.device_kind}"
  try:
    importlib.import_module("jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu")
  except Exception as e:  # noqa: BLE001 - any import problem means "not here"
    return f"import failed: {e}"
  return None


def _hopper_call(shape, dt):
  """JAX's own Hopper matmul with a config its divisibility rules accept, or NotApplicable.

  Its kernel needs M % (CTA tile M), N % (CTA tile N), K % tile_k == 0, 16-bit inputs,
  2-D operands; the two consumer warpgroups double the tile along wg_dimension.
  """
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # noqa: PLC0415
  if dt.dtype.itemsize != 2:
    raise NotApplicable("16-bit inputs only")
  if shape.batch != 1:
    raise NotApplicable("2-D operands only")
  dim = hm.MatmulDimension
  for wg in (dim.N, dim.M):
    cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                          grid_minor_dim=dim.N, grid_tile_width=4, wg_dimension=wg)
    cta_m, cta_n = 128 * (1 + (wg == dim.M)), 128 * (1 + (wg == dim.N))
    if shape.m % cta_m == 0 and shape.n % cta_n == 0 and shape.k % 64 == 0:
      return jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg)), cfg
  raise NotApplicable("M, N must be multiples of 128/256 and K of 64")


def _call_for(backend, shape, dt, use_tuned):
  """(jitted fn(a, b), config or None) for one backend; raises NotApplicable."""
  if backend == DOT:
    return jax.jit(lambda a, b: jnp.matmul(a, b, precision=dt.precision,
                                           preferred_element_type=dt.dtype)), None
  if backend == HOPPER:
    return _hopper_call(shape, dt)
  if backend == AUTO:  # the config column names the backend auto chose
    leading = (shape.k, shape.n, shape.n)
    chosen = pallas_gemm.matmul.auto.auto_backend(dt.dtype, dt.precision, shape.m, shape.n, shape.k, leading)
    return jax.jit(lambda a, b: pallas_gemm.gemm(a, b, precision=dt.precision)), {"chose": chosen}
  module = pallas_gemm.matmul.auto.backend_module(backend)
  reason = module.supports(dt.dtype, dt.precision)
  if reason:
    raise NotApplicable(reason)
  if use_tuned:
    config = tuning.resolve_config(backend, shape.m, shape.n, shape.k, dt.dtype, dt.precision)
  else:
    config = module.default_config(shape.m, shape.n, shape.k, dt.dtype)
  return jax.jit(lambda a, b: pallas_gemm.gemm(a, b, precision=dt.precision, backend=backend,
                                               config=config)), config


def _config_json(config):
  if config is None or isinstance(config, dict):
    return config
  return tuning.config_to_json(config)


@dataclasses.dataclass
class Options:
  iterations: int = 10
  correctness: bool = True
  use_tuned: bool = True
  budget_s: float | None = None   # stop starting measurements after this many seconds
  interpret_iterations: int = 3   # Pallas interpreter on CPU: each call takes seconds


def run(pairs, backends: list[str], opts: Options, log=print) -> tuple[list[dict], dict]:
  """Measures every (shape, dtype) pair with jnp.dot + `backends`. Returns (rows, run info)."""
  timer = Timer()
  on_gpu = timer.on_gpu
  rows: list[dict] = []
  start = time.perf_counter()
  skipped = 0
  total = count_planned(pairs, backends, on_gpu)
  done = 0
  for shape, dt in pairs:
    todo = _todo(shape, backends, on_gpu)
    if opts.budget_s is not None and time.perf_counter() - start > opts.budget_s:
      skipped += len(todo)
      continue
    a_shape = (shape.m, shape.k) if shape.batch == 1 else (shape.batch, shape.m, shape.k)
    b_shape = (shape.k, shape.n) if shape.batch == 1 else (shape.batch, shape.k, shape.n)
    set_bytes = dt.dtype.itemsize * shape.batch * (shape.m * shape.k + shape.k * shape.n
                                                   + shape.m * shape.n)
    n_sets = tuning.input_set_count(set_bytes) if on_gpu else 2
    arg_sets = tuning.random_inputs(a_shape, b_shape, dt.dtype, n_sets)
    reference = ref_lib.reference(*arg_sets[0]) if opts.correctness else None
    tol = ref_lib.tolerance(dt.dtype, dt.precision, shape.k)
    dot_ms = None
    for backend in todo:
      done += 1
      row = dict(backend=backend, config=None, category=shape.category, shape=shape.label,
                 batch=shape.batch, m=shape.m, n=shape.n, k=shape.k, dtype=dt.dtype.name,
                 variant=dt.name, precision=None if dt.precision is None else dt.precision.name,
                 median_ms=None, min_ms=None, max_ms=None, runs=0, tflops=None,
                 ratio_vs_dot=None, rel_err=None, tol=tol, correct=None, status="ok",
                 timer=timer.name, input_sets=n_sets)
      try:
        fn, config = _call_for(backend, shape, dt, opts.use_tuned)
        row["config"] = _config_json(config)
        if reference is not None:
          err = ref_lib.relative_error(fn(*arg_sets[0]), reference)
          row["rel_err"], row["correct"] = err, bool(err <= tol)
          if not row["correct"]:
            row["status"] = "WRONG"
        iters = opts.iterations
        if not on_gpu and backend not in (DOT, "xla"):
          iters = min(iters, opts.interpret_iterations)
        t = timer.measure(fn, arg_sets, iters)
        row.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms, runs=t.runs,
                   tflops=shape.flops / (t.median_ms * 1e-3) / 1e12, timer=timer.name)
        if backend == DOT:
          dot_ms = t.median_ms
        if dot_ms:
          row["ratio_vs_dot"] = dot_ms / t.median_ms
      except NotApplicable as e:
        row["status"] = f"n/a: {e}"
      except Exception as e:  # noqa: BLE001 - one failing backend must not end the sweep
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
      rows.append(row)
      log(progress_line(done, total, row), flush=True)
    del arg_sets, reference
  info = dict(timer=timer.name, skipped_for_budget=skipped,
              elapsed_s=round(time.perf_counter() - start, 1),
              interpret_max_flops=None if on_gpu else shapes_lib.INTERPRET_MAX_FLOPS)
  return rows, info


def progress_line(i, total, row) -> str:
  head = (f"[{i:>4}/{total}] {row['backend']:<10} {row['variant']:<11} "
          f"{row['category']:<9} {row['shape']:<18}")
  if row["median_ms"] is None:
    return f"{head} {row['status']}"
  ratio = "" if row["ratio_vs_dot"] is None else f" x{row['ratio_vs_dot']:.2f} vs jnp.dot"
  check = "" if row["correct"] is None else (
      f" ({'ok' if row['correct'] else 'WRONG'}, err {row['rel_err']:.1e})")
  return f"{head} {row['median_ms']:9.4f} ms {row['tflops']:8.2f} TFLOP/s{ratio}{check}"


# ----------------------------------------------------------------------------- autotune mode

# The shapes users hit most, one per regime. ~20 candidates x 1-3 s compile per backend
# each: 3 shapes x 2-3 backends take about 4 minutes (--budget-s); --shapes picks others.
AUTOTUNE_SHAPES = [
    (shapes_lib.Shape("square", 4096, 4096, 4096), "bf16"),
    (shapes_lib.Shape("square", 4096, 4096, 4096), "f32-default"),
    (shapes_lib.Shape("skinny", 64, 8192, 8192), "bf16"),
]


def run_autotune(pairs, backends: list[str], iterations: int, budget_s: float | None = None,
                 log=print) -> list[dict]:
  """For each (shape, dtype, backend): time default_config, autotune, report the gain."""
  timer = Timer()
  rows = []
  start = time.perf_counter()
  for shape, dt in pairs:
    for backend in backends:
      if backend in ("xla", DOT, HOPPER):
        continue  # nothing to tune
      module = pallas_gemm.matmul.auto.backend_module(backend)
      if module.supports(dt.dtype, dt.precision):
        continue
      row = dict(backend=backend, shape=shape.label, variant=dt.name, default_ms=None,
                 tuned_ms=None, gain=None, default_config=None, tuned_config=None, status="ok")
      if budget_s is not None and time.perf_counter() - start > budget_s:
        row["status"] = "skipped: --budget-s exhausted"
        rows.append(row)
        continue
      try:
        default = module.default_config(shape.m, shape.n, shape.k, dt.dtype)
        log(f"autotune {backend} {dt.name} {shape.label} ...", flush=True)
        tuned = tuning.autotune(shape.m, shape.n, shape.k, dt.dtype, backend=backend,
                                precision=dt.precision, batch=shape.batch,
                                iterations=iterations, verbose=True)
        a_shape, b_shape = (shape.batch, shape.m, shape.k), (shape.batch, shape.k, shape.n)
        set_bytes = dt.dtype.itemsize * shape.batch * (shape.m * shape.k + shape.k * shape.n
                                                       + shape.m * shape.n)
        arg_sets = tuning.random_inputs(a_shape, b_shape, dt.dtype,
                                        tuning.input_set_count(set_bytes), seed=2)
        times = {}
        for name, cfg in (("default", default), ("tuned", tuned)):
          fn = jax.jit(lambda a, b, cfg=cfg: pallas_gemm.gemm(
              a, b, precision=dt.precision, backend=backend, config=cfg))
          times[name] = timer.measure(fn, arg_sets, iterations).median_ms
        row.update(default_ms=times["default"], tuned_ms=times["tuned"],
                   gain=times["default"] / times["tuned"],
                   default_config=tuning.config_to_json(default),
                   tuned_config=tuning.config_to_json(tuned))
        log(f"  -> default {times['default']:.4f} ms, tuned {times['tuned']:.4f} ms, "
            f"gain x{row['gain']:.3f}", flush=True)
      except Exception as e:  # noqa: BLE001
        row["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        log(f"  -> {row['status']}", flush=True)
      rows.append(row)
  return rows


# Seconds a measured row costs besides its calls (compile, correctness check, timing), read
# off the elapsed times of sweeps on each platform. A GPU compiles every backend in about the
# same time and its calls are short. On a CPU, XLA's rows take a fraction of a second plus
# their calls at the CPU's rate, the jnp.dot row also draws the inputs and computes the
# float64 reference, and the Pallas interpreter (tiny shapes only) steps through the kernel's
# grid: mosaic, which emulates its warpgroups and barriers, is the slowest. Rows a backend
# does not support cost nothing.
_GPU_ROW_S = 1.0
_CPU_ROW_S = {DOT: 0.4, "triton": 0.7, "mosaic": 2.7}
_CPU_XLA_ROW_S = 0.05
_CPU_FLOP_PER_S = 2e11  # a few cores; a bigger machine finishes sooner than estimated
# Start-up (importing jax, finding the backends) and writing the report and plots.
_FIXED_S = 5.0


def estimate_seconds(pairs, backends: list[str], on_gpu: bool, iterations: int = 10,
                     budget_s: float | None = None) -> float:
  """Wall time of run(pairs, backends): the rows this platform will time, at its cost per row,
  capped by the budget (a started shape finishes, so the cap is approximate)."""
  seconds = 0.0
  for shape, dt in pairs:
    for backend in _todo(shape, backends, on_gpu):
      if not _supported(backend, dt):
        continue
      if on_gpu:
        seconds += _GPU_ROW_S
        continue
      # One correctness call, one warm-up per input set (2 on a CPU), the timed calls; the
      # float64 reference costs about two more.
      calls = iterations + 3 + (2 if backend == DOT else 0)
      seconds += _CPU_ROW_S.get(backend, _CPU_XLA_ROW_S) + calls * shape.flops / _CPU_FLOP_PER_S
  if budget_s is not None:
    seconds = min(seconds, budget_s)
  return seconds + _FIXED_S


def _supported(backend: str, dt) -> bool:
  """False where _call_for will answer NotApplicable from the backend's supports()."""
  if backend in (DOT, AUTO, HOPPER):
    return True
  return not pallas_gemm.matmul.auto.backend_module(backend).supports(dt.dtype, dt.precision)


def _todo(shape, backends, on_gpu: bool) -> list[str]:
  """jnp.dot first (the ratio's baseline); Pallas interpreter runs only tiny shapes on CPU."""
  return [b for b in [DOT] + backends
          if on_gpu or b in (DOT, "xla", AUTO) or shape.flops <= shapes_lib.INTERPRET_MAX_FLOPS]


def count_planned(pairs, backends, on_gpu: bool) -> int:
  return sum(len(_todo(s, backends, on_gpu)) for s, _ in pairs)


def geomean(xs):
  xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
  return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None

