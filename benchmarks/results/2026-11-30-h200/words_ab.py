"""moe_mlp's row gathers as 4-byte words (layer.gather_rows) against plain gathers, same
process: each program traced under its gather, rounds of 10 pipelined calls in rotated
order (wall clock), and each program's kernels by name from a profiler trace."""
import glob, statistics, sys, tempfile, time, collections, json, os
import jax
from jax.profiler import ProfileData
from benchmarks import moe
from pallas_gemm.moe import layer

words = layer.gather_rows
plain = lambda x, index: x[index]
ROUNDS, CALLS = 9, 10
results = {}
for spec in sys.argv[1].split(","):
  name, mode, variant = spec.split(":")
  cfg = moe.CONFIGS[name]
  fns, _ = moe.variants(True, [variant])
  args = moe.operands(cfg, mode, False)
  if variant in moe.PREPARE:
    args = jax.block_until_ready(jax.jit(moe.PREPARE[variant])(*args))
  progs = {}
  for label, g in (("words", words), ("plain", plain)):
    layer.gather_rows = g
    try:
      progs[label] = moe._program(fns[variant], mode).lower(*args).compile()
    finally:
      layer.gather_rows = words
  outs = {k: jax.block_until_ready(p(*args)) for k, p in progs.items()}
  same = all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(outs["words"]), jax.tree.leaves(outs["plain"])))
  del outs
  for p in progs.values():
    for _ in range(2):
      jax.block_until_ready([p(*args) for _ in range(CALLS)])
  ms = collections.defaultdict(list)
  order = list(progs)
  for r in range(ROUNDS):
    for k in order[r % 2:] + order[:r % 2]:
      t0 = time.perf_counter(); jax.block_until_ready([progs[k](*args) for _ in range(CALLS)])
      ms[k].append((time.perf_counter() - t0) / CALLS * 1e3)
  ratios = sorted(p / w for w, p in zip(ms["words"], ms["plain"]))
  q1, med, q3 = statistics.quantiles(ratios, n=4)
  kern = {}
  for k, p in progs.items():
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
      jax.block_until_ready([p(*args) for _ in range(CALLS)])
    pd = ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
    busy = collections.Counter()
    for pl_ in pd.planes:
      if pl_.name.startswith("/device:GPU"):
        for l in pl_.lines:
          if l.name.startswith("Stream"):
            for e in l.events:
              busy[e.name[:50]] += e.duration_ns / 1e6 / CALLS
    kern[k] = busy
  top = [n for n, _ in (kern["plain"] + kern["words"]).most_common(7)]
  print(f"{spec}: words {statistics.median(ms['words']):.3f} ms, plain {statistics.median(ms['plain']):.3f} ms,"
        f" words x plain {med:.3f} (IQR/2 {(q3 - q1) / 2:.3f}); bit-equal {same};"
        f" kernels words {sum(kern['words'].values()):.3f} plain {sum(kern['plain'].values()):.3f}", flush=True)
  for n in top:
    print(f"    {kern['plain'][n]:.3f} -> {kern['words'][n]:.3f}  {n}")
  results[spec] = dict(words_ms=statistics.median(ms["words"]), plain_ms=statistics.median(ms["plain"]),
                       ratio=med, half_iqr=(q3 - q1) / 2, bit_equal=same,
                       kernels={k: dict(v.most_common(8)) for k, v in kern.items()})
if os.environ.get("OUT"):
  json.dump(results, open(os.path.join(os.environ["OUT"], "words_ab.json"), "w"), indent=1)
