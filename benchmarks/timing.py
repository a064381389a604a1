"""One timer for the whole run: CUPTI device time on a GPU, wall clock elsewhere.

CUPTI (via pallas_gemm.matmul.tuning.time_gpu_ms) measures only kernel execution, so the
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

from pallas_gemm.matmul import tuning


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
    return _summary(self.sample(fn, arg_sets, iterations))

  def sample(self, fn, arg_sets, calls: int) -> list[float]:
    """ms of each of `calls` calls of an already compiled fn, cycling the input sets."""
    if self._use_cupti:
      try:
        return tuning.time_gpu_ms(fn, arg_sets, calls, warmup=False)
      except Exception as e:  # noqa: BLE001 - any CUPTI failure: fall back, say so once
        self._use_cupti = False
        self.name = f"wallclock (block_until_ready; CUPTI failed: {type(e).__name__}: {e})"
        print(f"WARNING: CUPTI timing failed ({e}); using wall clock from here on", flush=True)
    times = []
    for i in range(calls):
      args = arg_sets[i % len(arg_sets)]
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append((time.perf_counter() - start) * 1e3)
    return times


class PipelinedTimer:
  """Wall clock of `calls` back-to-back calls (dispatch pipelined, one wait at the end),
  per call: what a jitted program costs with its launch gaps, which CUPTI's sum of kernel
  times leaves out. One figure per sample."""

  name = "wallclock (pipelined calls, one wait)"

  def sample(self, fn, arg_sets, calls: int) -> list[float]:
    start = time.perf_counter()
    jax.block_until_ready([fn(*arg_sets[i % len(arg_sets)]) for i in range(calls)])
    return [(time.perf_counter() - start) * 1e3 / calls]


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


def rounds_ms(timer: Timer | PipelinedTimer, fns: dict, arg_sets, rounds: int, calls: int) -> dict:
  """{name: [ms per round]}: each round times `calls` calls of every function (its median
  is the round's figure), the functions in an order rotated by one place each round.

  A power-capped GPU moves its clock by a few percent within seconds, and the function
  timed first after another's burst meets a different clock than the one timed last:
  rotating the order gives every function every slot, and comparing functions within one
  round (`ratio_stats`) cancels the drift between rounds. Compile and first-touch first.
  """
  for fn in fns.values():
    for args in arg_sets:
      jax.block_until_ready(fn(*args))
  names = list(fns)
  out = {name: [] for name in names}
  for r in range(rounds):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      out[name].append(statistics.median(timer.sample(fns[name], arg_sets, calls)))
  return out


@dataclasses.dataclass(frozen=True)
class Ratio:
  """Per-round ratios base / other (> 1: other is faster): median, quartiles, extremes.

  `spread` is half the interquartile range. For a dozen rounds that is about twice the
  standard error of the median, so |median - 1| < spread is reported as parity: the
  difference is not resolved by this run.
  """
  median: float
  p25: float
  p75: float
  low: float
  high: float
  rounds: int

  @property
  def spread(self) -> float:
    return (self.p75 - self.p25) / 2

  @property
  def verdict(self) -> str:
    if abs(self.median - 1.0) < self.spread:
      return "parity"
    return "faster" if self.median > 1.0 else "slower"


def ratio_stats(base_ms: list[float], other_ms: list[float]) -> Ratio:
  ratios = [b / o for b, o in zip(base_ms, other_ms, strict=True)]
  q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
  return Ratio(statistics.median(ratios), q[0], q[2], min(ratios), max(ratios), len(ratios))
