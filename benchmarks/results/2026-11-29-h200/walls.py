"""Wall clock per call of moe_mlp at decode against the number of pipelined calls timed
together, the host's enqueue time per call, and the GPU span of traced calls: where a
round's wall clock goes besides its kernels. PYTHONPATH=. ; prints a table."""
import glob, statistics, sys, tempfile, time
import jax
from jax.profiler import ProfileData
from benchmarks import moe
from pallas_gemm import moe_mlp

name = sys.argv[1] if len(sys.argv) > 1 else "decode-qwen3"
cfg = moe.CONFIGS[name]
args = moe.operands(cfg, "fwd", False)
roof = moe.roofline_ms(cfg, jax.devices()[0].device_kind)
fn = jax.jit(lambda *a: moe_mlp(*a)).lower(*args).compile()
for _ in range(5):
  jax.block_until_ready([fn(*args) for _ in range(40)])
print(f"{name}: roofline {roof * 1e3:.1f} us", flush=True)
for n in (10, 40, 160, 640, 40, 10):
  walls, enq = [], []
  for _ in range(5):
    t0 = time.perf_counter()
    out = [fn(*args) for _ in range(n)]
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    walls.append((t2 - t0) / n * 1e6); enq.append((t1 - t0) / n * 1e6)
    del out
  w = statistics.median(walls)
  print(f"  {n:4d} calls: wall {w:7.1f} us/call ({roof * 1e3 / w:.3f} of roofline), host enqueue"
        f" {statistics.median(enq):6.1f} us/call, rounds {[round(x, 1) for x in walls]}", flush=True)
for n in (40, 160):
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d):
    t0 = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(n)])
    wall = (time.perf_counter() - t0) / n * 1e6
  pd = ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
  ev = sorted((e.start_ns, e.start_ns + e.duration_ns) for p in pd.planes
              if p.name.startswith("/device:GPU") for l in p.lines if l.name.startswith("Stream")
              for e in l.events)
  busy = sum(b - a for a, b in ev) / n / 1e3
  span = (ev[-1][1] - ev[0][0]) / n / 1e3
  print(f"  traced {n} calls: wall {wall:.1f} us/call, GPU span first-to-last event {span:.1f}"
        f" us/call ({roof * 1e3 / span:.3f} of roofline), kernels busy {busy:.1f} us/call", flush=True)
