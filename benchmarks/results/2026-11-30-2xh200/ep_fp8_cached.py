"""Expert-parallel fp8 training on cached weights: one microbatch's forward+backward of
moe_mlp (gradients in x, router weights, both expert weights; random cotangent), weak
scaling (8192 tokens per device, experts split over an Explicit axis), variants in rotated
rounds: bf16, fp8 quantized in the call, fp8 on weights quantized before the call
(quantize_experts_for_training, split on E as the weights). Usage: CONFIGS COUNTS."""
import json, math, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from benchmarks.moe import CONFIGS
from benchmarks.timing import PipelinedTimer, rounds_ms, ratio_stats
from pallas_gemm import moe_mlp
from pallas_gemm.moe import quantize_experts_for_training, softmax_topk

out = {}
for name in sys.argv[1].split(","):
  cfg = CONFIGS.get(name) or CONFIGS["mixtral"].__class__("tiny", 64, 128, 128, 8, 2)
  for n in map(int, sys.argv[2].split(",")):
    mesh = jax.make_mesh((n,), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("expert")))
    t, d, f, e = cfg.tokens * n, cfg.d_model, cfg.d_ff, cfg.experts
    k = jax.random.split(jax.random.key(0), 5)
    x = put(jax.random.normal(k[0], (t, d), jnp.bfloat16))
    w, ids = softmax_topk(jax.random.normal(k[1], (t, e)), cfg.top_k)
    w, ids = put(w), put(ids)
    wgu = put((jax.random.normal(k[2], (e, d, 2 * f), jnp.float32) / math.sqrt(d)).astype(jnp.bfloat16))
    wd = put((jax.random.normal(k[3], (e, f, d), jnp.float32) / math.sqrt(f)).astype(jnp.bfloat16))
    ct = put(jax.random.normal(k[4], (t, d), jnp.bfloat16))
    cached = jax.block_until_ready(jax.jit(quantize_experts_for_training)(wgu, wd))

    def prog(prec, use_cache):
      def f(x, w, wgu, wd, c):
        o, vjp = jax.vjp(lambda x, w, a, b: moe_mlp(x, w, ids, a, b, precision=prec,
                                                    fp8_weights=c if use_cache else None),
                         x, w, wgu, wd)
        return (o,) + vjp(ct)
      return jax.jit(f)
    progs = {"bf16": prog(None, False), "fp8": prog("fp8", False), "fp8-cached": prog("fp8", True)}
    fns = {v: (lambda p=p: p(x, w, wgu, wd, cached)) for v, p in progs.items()}
    tm = rounds_ms(PipelinedTimer(), fns, [()], 5, 1)
    row = dict(devices=n, tokens=t, ms={v: sorted(s)[2] for v, s in tm.items()}, rounds_ms=tm)
    for v in ("fp8", "fp8-cached"):
      r = ratio_stats(tm["bf16"], tm[v])
      row[f"bf16_over_{v}"] = dict(median=r.median, spread=r.spread)
    out[f"{name}/{n}"] = row
    print(f"{name} n={n} tokens={t}: " + ", ".join(f"{v} {row['ms'][v]:.2f} ms" for v in tm)
          + f"; fp8 x bf16 {row['bf16_over_fp8']['median']:.3f} ±{row['bf16_over_fp8']['spread']:.3f}"
          + f", fp8-cached x bf16 {row['bf16_over_fp8-cached']['median']:.3f} ±{row['bf16_over_fp8-cached']['spread']:.3f}",
          flush=True)
    del x, w, ids, wgu, wd, ct, cached, progs, fns
print(json.dumps(out))
