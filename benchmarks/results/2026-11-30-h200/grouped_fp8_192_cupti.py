"""The grouped fp8 kernel: default (128x128, 5 stages) vs 128x192 variants, CUPTI
(benchmarks.timing.Timer), rounds rotated, routed group sizes (softmax top-k of random
logits), bit-for-bit check against the default. Args: M,K,N,G,k ..."""
import sys, json, numpy as np, jax, jax.numpy as jnp
from benchmarks.timing import Timer, rounds_ms, ratio_stats
from pallas_gemm.fp8 import mosaic_ragged as mr
from pallas_gemm.fp8.config import Config
from pallas_gemm import quantize
from pallas_gemm.moe import softmax_topk
SHAPES = sys.argv[1:] or ["16384,4096,28672,8,2", "16384,14336,4096,8,2",
                          "65536,2048,1536,128,8", "65536,768,2048,128,8",
                          "65536,7168,4096,256,8", "65536,2048,7168,256,8"]
CFGS = {"128x128/5": Config(block_m=128, block_n=128, stages=5, epi_block_n=64),
        "128x192/4": Config(block_m=128, block_n=192, stages=4, epi_block_n=64),
        "128x192/5": Config(block_m=128, block_n=192, stages=5, epi_block_n=64),
        "128x192/4e32": Config(block_m=128, block_n=192, stages=4, epi_block_n=32),
        "128x128/5e32": Config(block_m=128, block_n=128, stages=5, epi_block_n=32)}
import os
CFGS = {n: c for n, c in CFGS.items() if n in os.environ.get("CFGS", "128x128/5,128x192/4").split(",")}
rng = np.random.default_rng(0)
rows = []
for spec in SHAPES:
  M, K, N, G, k = map(int, spec.split(","))
  a8, sa = quantize(jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16))
  b8, sb = quantize(jnp.asarray(rng.standard_normal((G, N, K)) / 8, jnp.bfloat16), block_shape=(128, 128))
  _, ids = softmax_topk(jnp.asarray(rng.standard_normal((M // k, G)), jnp.float32), k)
  sizes = jnp.bincount(ids.reshape(-1), length=G).astype(jnp.int32)
  fns, outs, bad = {}, {}, {}
  for n_, c in CFGS.items():
    f = jax.jit(lambda *a, c=c: mr.ragged_gemm(*a, out_dtype=jnp.bfloat16, config=c))
    try:
      outs[n_] = jax.block_until_ready(f(a8, b8, sizes, sa, sb)); fns[n_] = f
    except Exception as e:
      bad[n_] = str(e).splitlines()[0][:150]
  same = {n_: bool(jnp.array_equal(o, outs["128x128/5"])) for n_, o in outs.items()}
  del outs
  t = rounds_ms(Timer(), {n_: (lambda f=f: f(a8, b8, sizes, sa, sb)) for n_, f in fns.items()}, [()], 7, 20)
  flops = 2 * M * N * K
  med = {n_: sorted(v)[3] for n_, v in t.items()}
  line = ", ".join(f"{n_} {m:.3f} ms {flops / m / 1e9:.0f} TF/s" for n_, m in med.items())
  rs = {n_: ratio_stats(t["128x128/5"], t[n_]) for n_ in t if n_ != "128x128/5"}
  print(f"{spec}: {line}; over default " + ", ".join(f"{n_} {r.median:.3f}±{r.spread:.3f}" for n_, r in rs.items())
        + f"; same {same}; failed {bad}", flush=True)
  rows.append(dict(shape=spec, ms=med, rounds_ms=t, same=same, failed=bad,
                   over_default={n_: [r.median, r.spread] for n_, r in rs.items()}))
print(json.dumps(rows))
