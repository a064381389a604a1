"""One timer for the whole run: CUPTI device time on a GPU, wall clock elsewhere.

CUPTI (via pallas_gemm.tuning.time_gpu_ms) measures only kernel execution, so the
numbers are comparable across backends whatever their Python/dispatch overhead. If it
fails once (no Mosaic GPU bindings, another profiler attached), the run switches to
wall clock for every later measurement and says so: mixing timers in one table would
make ratios meaningless.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax

from pallas_gemm import tuning


@dataclasses.dataclass(frozen=True)
class Timing:
  median_ms: float
  min_ms: float
  max_ms: float
  runs: int


class Timer:
  def __init__(self):
    self.on_gpu = jax.default_backend() == "gpu"
    self.name = "cupti" if self.on_gpu else "wallclock (block_until_ready; no GPU)"
    self._use_cupti = self.on_gpu

  def measure(self, fn, arg_sets, iterations: int) -> Timing:
    """Warm up (compile) on every input set, then time `iterations` calls cycling the sets."""
    for args in arg_sets:
      jax.block_until_ready(fn(*args))  # errors of fn itself surface here, not as timer errors
    if self._use_cupti:
      try:
        times = tuning.time_gpu_ms(fn, arg_sets, iterations, warmup=False)
        return _summary(times)
      except Exception as e:  # noqa: BLE001 - any CUPTI failure: fall back, say so once
        self._use_cupti = False
        self.name = f"wallclock (block_until_ready; CUPTI failed: {type(e).__name__}: {e})"
        print(f"WARNING: CUPTI timing failed ({e}); using wall clock from here on", flush=True)
    times = []
    for i in range(iterations):
      args = arg_sets[i % len(arg_sets)]
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append((time.perf_counter() - start) * 1e3)
    return _summary(times)


def _summary(times: list[float]) -> Timing:
  return Timing(statistics.median(times), min(times), max(times), len(times))


def pipelined_ms(f, *args, calls: int = 10, reps: int = 5) -> float:
  """Wall clock per call of `calls` back-to-back calls (dispatch pipelined, one wait at the
  end), median of `reps`, after one warm-up call: the time a jitted program sees, with its
  elementwise kernels and collectives (what CUPTI kernel time of one GEMM leaves out)."""
  return interleaved_ms({"f": f}, *args, calls=calls, reps=reps)["f"]


def interleaved_ms(fns: dict, *args, calls: int = 10, reps: int = 7) -> dict:
  """`pipelined_ms` of several functions of the same arguments, taken in turns: every
  rep times `calls` back-to-back calls of each function in order, so a drift of the GPU's
  clock or temperature during the run reaches all of them alike (timed one after the
  other, the same jnp.dot step measured 8.23 and 8.55 ms in two runs on one H100).
  Median per function."""
  for f in fns.values():
    jax.block_until_ready(f(*args))
  runs = {name: [] for name in fns}
  for _ in range(reps):
    for name, f in fns.items():
      start = time.perf_counter()
      out = [f(*args) for _ in range(calls)]
      jax.block_until_ready(out)
      runs[name].append((time.perf_counter() - start) * 1e3 / calls)
      del out
  return {name: statistics.median(t) for name, t in runs.items()}
