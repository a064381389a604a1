"""fp8 scaled_matmul (1x128 / 128x128 block scales, and per tensor) against bf16 jnp.dot at
4096^3 and 8192^3 under bursts of different lengths: rotated rounds of N pipelined calls
(wall clock, one wait), N = 10, 100, 1000; and CUPTI kernel time (10 calls, the
benchmark's timer) for reference."""
import statistics, sys
import jax
from benchmarks import fp8 as bfp8
from benchmarks.timing import PipelinedTimer, Timer, rounds_ms

impls = bfp8.implementations("auto")
pick = [bfp8.BASE, "pallas blocks", "pallas per tensor"]
for size in (4096, 8192):
  d = bfp8.inputs(size, size, size, 0)
  bound = {}
  for label in pick:
    fn, names = impls[label]
    a = [d[n] for n in names]
    jax.block_until_ready(fn(*a))
    bound[label] = (lambda fn=fn, a=a: fn(*a))
  timers = [("cupti 10", Timer(), 10)] + [(f"wall {c}", PipelinedTimer(), c) for c in (10, 100, 1000)]
  if size == 8192:
    timers = timers[:-1]
  for tname, timer, calls in timers:
    t = rounds_ms(timer, bound, [()], 7, calls)
    base = t[bfp8.BASE]
    parts = []
    for label in pick[1:]:
      r = sorted(b / x for b, x in zip(base, t[label]))
      q = statistics.quantiles(r, n=4)
      parts.append(f"{label} {statistics.median(t[label]):.4f} ms {statistics.median(r):.3f}x"
                   f" +-{(q[2] - q[0]) / 2:.3f}")
    print(f"{size}^3 {tname:9s}: bf16 {statistics.median(base):.4f} ms ({2 * size**3 / statistics.median(base) / 1e9:.0f} TFLOP/s); "
          + "; ".join(parts), flush=True)
