"""Where a decode call's wall clock goes between its kernels: 40 pipelined calls of moe_mlp
(decode-qwen3) traced with jax.profiler, every GPU event (kernels, copies, on every
stream) of three calls in the middle listed with its start, length and the gap before it.
Variants: the dispatch kernel and the XLA dispatch. PYTHONPATH=. ; $OUT/timeline_*.txt"""
import glob, os, sys, tempfile
import jax, jax.numpy as jnp
from jax.profiler import ProfileData
from benchmarks import moe
from pallas_gemm import moe_mlp
from pallas_gemm.moe import cuda_dispatch

CALLS = 40
name = sys.argv[1] if len(sys.argv) > 1 else "decode-qwen3"
cfg = moe.CONFIGS[name]
args = moe.operands(cfg, "fwd", False)


def compiled(kernel):
  saved = cuda_dispatch.unavailable_reason
  if not kernel:
    cuda_dispatch.unavailable_reason = lambda *_: "off"
  try:
    return jax.jit(lambda *a: moe_mlp(*a)).lower(*args).compile()
  finally:
    cuda_dispatch.unavailable_reason = saved


for label, fn in (("kernel", compiled(True)), ("xla", compiled(False))):
  for _ in range(3):
    jax.block_until_ready([fn(*args) for _ in range(CALLS)])
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d):
    jax.block_until_ready([fn(*args) for _ in range(CALLS)])
  pd = ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
  events = []
  for plane in pd.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      for e in line.events:
        events.append((e.start_ns, e.duration_ns, line.name, e.name))
  names = sorted({e[2] for e in events})
  if any(n.startswith("Stream") for n in names):
    events = [e for e in events if e[2].startswith("Stream")]
  events.sort()
  lines = [f"{label}: {len(events)} GPU events over {CALLS} calls; lines: " + ", ".join(names)]
  firsts = [i for i, e in enumerate(events) if "gated" in e[3]]
  mid = firsts[len(firsts) // 2]
  lo, hi = firsts[len(firsts) // 2 - 1], firsts[min(len(firsts) - 1, len(firsts) // 2 + 2)]
  t0 = events[lo][0]
  prev_end = events[lo - 1][0] + events[lo - 1][1]
  for s, dur, ln, nm in events[lo:hi]:
    lines.append(f"{(s - t0) / 1e3:9.2f} us  len {dur / 1e3:7.2f}  gap {(s - prev_end) / 1e3:6.2f}"
                 f"  [{ln[:28]}] {nm[:70]}")
    prev_end = max(prev_end, s + dur)
  per = [(events[firsts[i + 1]][0] - events[firsts[i]][0]) / 1e3 for i in range(len(firsts) - 1)]
  busy = sum(e[1] for e in events) / 1e3 / CALLS
  lines.append(f"call period (gated kernel to gated kernel), median {sorted(per)[len(per)//2]:.2f} us;"
               f" events' length per call {busy:.2f} us")
  text = "\n".join(lines)
  print(text, flush=True)
  if os.environ.get("OUT"):
    open(os.path.join(os.environ["OUT"], f"timeline_{name}_{label}.txt"), "w").write(text)
