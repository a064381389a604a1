"""Host time per call against GPU time per call, moe_mlp's decode forms: for each variant,
the host's enqueue time of 10 back-to-back calls (no backpressure at 10), the wall clock
per call at 10 and at ~200 calls, the GPU span per call of 100 traced calls and its
kernels' busy time; and one grouped-GEMM kernel alone, and a 12-fusion XLA program, for
the host cost of a launch. PYTHONPATH=. ; prints a table."""
import glob, statistics, sys, tempfile, time
import jax, jax.numpy as jnp
from jax.profiler import ProfileData
from benchmarks import moe
from pallas_gemm import ragged_dot

name = sys.argv[1] if len(sys.argv) > 1 else "decode-qwen3"
cfg = moe.CONFIGS[name]
args = moe.operands(cfg, "fwd", False)
fns, _ = moe.variants(True, ["moe_mlp", "moe_mlp/fp8", "moe_mlp/fp8-3pass", "unfused/pallas_gemm"])
progs = {}
for k, f in fns.items():
  a = jax.block_until_ready(jax.jit(moe.PREPARE[k])(*args)) if k in moe.PREPARE else args
  progs[k] = (jax.jit(f).lower(*a).compile(), a)
x, w = args[0], args[3]
rows = jnp.tile(x, (8, 1))
sizes = jnp.full((cfg.experts,), rows.shape[0] // cfg.experts, jnp.int32)
progs["one grouped kernel"] = (jax.jit(lambda r, w, s: ragged_dot(r, w, s)).lower(rows, w, sizes).compile(), (rows, w, sizes))
def xla_only(v):
  for i in range(12):
    v = jnp.cumsum(v * 1.0001, axis=0) if i % 3 == 0 else jnp.sin(v) + i
  return v
small = jnp.ones((256, 256), jnp.float32)
progs["XLA, ~12 fusions"] = (jax.jit(xla_only).lower(small).compile(), (small,))


def gpu_span(fn, a, n=100):
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d):
    jax.block_until_ready([fn(*a) for _ in range(n)])
  pd = ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
  ev = sorted((e.start_ns, e.start_ns + e.duration_ns) for p in pd.planes
              if p.name.startswith("/device:GPU") for l in p.lines if l.name.startswith("Stream")
              for e in l.events)
  return (ev[-1][1] - ev[0][0]) / n / 1e3, sum(b - a for a, b in ev) / n / 1e3, len(ev) / n


print(f"{name}: roofline {moe.roofline_ms(cfg, jax.devices()[0].device_kind) * 1e3:.1f} us")
print(f"{'variant':24s} {'host us/call':>12s} {'wall@10':>8s} {'wall@200':>9s} {'GPU span':>9s} {'busy':>7s} {'kernels':>7s}")
for k, (fn, a) in progs.items():
  for _ in range(3):
    jax.block_until_ready([fn(*a) for _ in range(20)])
  res = {}
  for n in (10, 200):
    walls, enq = [], []
    for _ in range(5):
      t0 = time.perf_counter(); out = [fn(*a) for _ in range(n)]; t1 = time.perf_counter()
      jax.block_until_ready(out); t2 = time.perf_counter(); del out
      walls.append((t2 - t0) / n * 1e6); enq.append((t1 - t0) / n * 1e6)
    res[n] = (statistics.median(enq), statistics.median(walls))
  span, busy, count = gpu_span(fn, a)
  print(f"{k:24s} {res[10][0]:12.1f} {res[10][1]:8.1f} {res[200][1]:9.1f} {span:9.1f} {busy:7.1f} {count:7.1f}", flush=True)
