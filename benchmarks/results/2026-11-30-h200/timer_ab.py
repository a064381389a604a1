"""The MoE layer's bf16 and fp8 inference forms under several timers, one process:
rotated rounds of N pipelined calls (the benchmark's timer at N = 5), for N in 5, 20, 60,
and each form alone (60 calls after 20 warm)."""
import statistics, sys, time
import jax
from benchmarks import moe
from benchmarks.timing import PipelinedTimer, rounds_ms

for name in sys.argv[1].split(","):
  cfg = moe.CONFIGS[name]
  fns, _ = moe.variants(True, ["moe_mlp", "moe_mlp/fp8"])
  base = moe.operands(cfg, "fwd", False)
  bound = {}
  for k, f in fns.items():
    a = jax.block_until_ready(jax.jit(moe.PREPARE[k])(*base)) if k in moe.PREPARE else base
    p = jax.jit(f)
    jax.block_until_ready(p(*a))
    bound[k] = (lambda p=p, a=a: p(*a))
  for calls in (5, 20, 60):
    t = rounds_ms(PipelinedTimer(), bound, [()], 7, calls)
    med = {k: statistics.median(v) for k, v in t.items()}
    ratios = sorted(b / f for b, f in zip(t["moe_mlp"], t["moe_mlp/fp8"]))
    print(f"{name} rotated rounds of {calls:3d} calls: bf16 {med['moe_mlp']:.3f} ms, fp8"
          f" {med['moe_mlp/fp8']:.3f} ms, fp8 x bf16 {statistics.median(ratios):.3f}"
          f" (range {ratios[0]:.3f}-{ratios[-1]:.3f})", flush=True)
  for k, fn in bound.items():
    jax.block_until_ready([fn() for _ in range(20)])
    walls = []
    for _ in range(5):
      t0 = time.perf_counter(); jax.block_until_ready([fn() for _ in range(60)])
      walls.append((time.perf_counter() - t0) / 60 * 1e3)
    print(f"{name} {k} alone, 60 calls x 5: {statistics.median(walls):.3f} ms", flush=True)
