"""Where the wall clock goes between kernels: for each config and variant, host enqueue
time per call, wall per call at 10 pipelined calls, GPU span / busy per call of 20 traced
calls, and the largest gaps between GPU events with the events around them."""
import glob, statistics, sys, tempfile, time, collections
import jax
from jax.profiler import ProfileData
from benchmarks import moe

VARIANTS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["moe_mlp", "moe_mlp/fp8", "dense"]
for name in sys.argv[1].split(","):
  cfg = moe.CONFIGS[name]
  fns, _ = moe.variants(True, VARIANTS)
  for k in VARIANTS:
    args = moe.operands(cfg, "fwd", k == "dense")
    a = jax.block_until_ready(jax.jit(moe.PREPARE[k])(*args)) if k in moe.PREPARE else args
    fn = jax.jit(fns[k]).lower(*a).compile()
    for _ in range(3):
      jax.block_until_ready([fn(*a) for _ in range(10)])
    walls, enq = [], []
    for _ in range(5):
      t0 = time.perf_counter(); out = [fn(*a) for _ in range(10)]; t1 = time.perf_counter()
      jax.block_until_ready(out); t2 = time.perf_counter(); del out
      walls.append((t2 - t0) / 10 * 1e3); enq.append((t1 - t0) / 10 * 1e3)
    n = 20
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
      jax.block_until_ready([fn(*a) for _ in range(n)])
    pd = ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
    ev = []
    for p in pd.planes:
      if not p.name.startswith("/device:GPU"):
        continue
      for l in p.lines:
        if l.name.startswith("Stream") or l.name.startswith("Memcpy"):
          for e in l.events:
            ev.append((e.start_ns, e.start_ns + e.duration_ns, l.name, e.name))
    ev.sort()
    span = (ev[-1][1] - ev[0][0]) / n / 1e6
    busy = sum(b - s for s, b, *_ in ev) / n / 1e6
    print(f"{name} {k}: host enqueue {statistics.median(enq):.3f} ms/call, wall@10 "
          f"{statistics.median(walls):.3f}, GPU span {span:.3f}, busy {busy:.3f}, "
          f"{len(ev) / n:.1f} events/call; lines {sorted({e[2] for e in ev})}", flush=True)
    gaps = collections.Counter()
    end = ev[0][1]
    prev = ev[0][3]
    for s, b, ln, nm in ev[1:]:
      if s > end:
        gaps[(prev[:50], nm[:50])] += (s - end) / 1e6 / n
      if b > end:
        end, prev = b, nm
    for (before, after), ms in gaps.most_common(6):
      print(f"   gap {ms:.3f} ms/call  after [{before}]  before [{after}]")
    names = collections.Counter()
    for s, b, ln, nm in ev:
      names[nm[:60]] += (b - s) / 1e6 / n
    for nm, ms in names.most_common(8):
      print(f"   busy {ms:.3f} ms/call  {nm}")
