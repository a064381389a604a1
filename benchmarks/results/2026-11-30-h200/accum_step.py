"""A MoE layer's training step with gradient accumulation: n microbatches (lax.scan), each
forward+backward, the weight gradients summed in float32, then AdamW (optax) on the bf16
expert weights. Variants in rotated rounds (wall clock, one step a sample):
  bf16        moe_mlp
  fp8         moe_mlp(precision="fp8"): weights quantized in every microbatch's call
  fp8-cached  the same, weights quantized once per step (quantize_experts_for_training)
The input gradient of each microbatch is kept live (summed into an output), as a model's
earlier layers would read it. Also checks fp8 and fp8-cached give the same new weights."""
import json, math, sys, dataclasses
import jax, jax.numpy as jnp, optax
from benchmarks.timing import PipelinedTimer, rounds_ms, ratio_stats
from benchmarks.moe import CONFIGS
from pallas_gemm.moe import moe_mlp, quantize_experts_for_training, softmax_topk

def make(cfg, n):
  k = jax.random.split(jax.random.key(0), 5)
  t, d, f, e = cfg.tokens, cfg.d_model, cfg.d_ff, cfg.experts
  x = jax.random.normal(k[0], (n, t, d), jnp.bfloat16)
  w, ids = jax.vmap(lambda l: softmax_topk(l, cfg.top_k))(jax.random.normal(k[1], (n, t, e)))
  tgt = jax.random.normal(k[2], (n, t, d), jnp.bfloat16)
  wgu = (jax.random.normal(k[3], (e, d, 2 * f), jnp.float32) / math.sqrt(d)).astype(jnp.bfloat16)
  wd = (jax.random.normal(k[4], (e, f, d), jnp.float32) / math.sqrt(f)).astype(jnp.bfloat16)
  return (x, w, ids, tgt), (wgu, wd)

def step_fn(variant, opt):
  def step(params, state, batch):
    cached = quantize_experts_for_training(*params) if variant == "fp8-cached" else None
    prec = None if variant == "bf16" else "fp8"
    def micro(carry, mb):
      gsum, dxsum = carry
      x, w, ids, tgt = mb
      def loss(x, p):
        out = moe_mlp(x, w, ids, *p, precision=prec, fp8_weights=cached)
        return jnp.mean(jnp.square(out.astype(jnp.float32) - tgt.astype(jnp.float32)))
      l, (dx, g) = jax.value_and_grad(loss, argnums=(0, 1))(x, params)
      gsum = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), gsum, g)
      return (gsum, dxsum + jnp.sum(dx.astype(jnp.float32))), l
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (gsum, dxsum), losses = jax.lax.scan(micro, (zeros, jnp.float32(0)), batch)
    updates, state = opt.update(gsum, state, params)
    return optax.apply_updates(params, updates), state, jnp.mean(losses), dxsum
  return jax.jit(step, donate_argnums=())

out = {}
for spec in sys.argv[1].split(","):
  name, n = spec.split(":"); n = int(n)
  cfg = CONFIGS.get(name) or CONFIGS["mixtral"].__class__("tiny", 64, 128, 128, 8, 2)
  batch, params = make(cfg, n)
  opt = optax.adamw(1e-4)
  state = opt.init(params)
  steps = {v: step_fn(v, opt) for v in ("bf16", "fp8", "fp8-cached")}
  res = {v: jax.block_until_ready(s(params, state, batch)) for v, s in steps.items()}
  same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(res["fp8"][0]), jax.tree.leaves(res["fp8-cached"][0])))
  losses = {v: float(r[2]) for v, r in res.items()}
  del res
  t = rounds_ms(PipelinedTimer(), {v: (lambda s=s: s(params, state, batch)) for v, s in steps.items()}, [()], 7, 1)
  row = dict(microbatches=n, tokens_per_microbatch=cfg.tokens, same_weights_fp8_vs_cached=same, losses=losses,
             ms={v: sorted(x)[3] for v, x in t.items()}, rounds_ms=t)
  for v in ("fp8", "fp8-cached"):
    r = ratio_stats(t["bf16"], t[v])
    row[f"{v}_over_bf16"] = dict(median=r.median, spread=r.spread)
  out[name] = row
  print(f"{name} x{n}: " + ", ".join(f"{v} {row['ms'][v]:.1f} ms" for v in t) +
        f"; bf16/fp8 {row['fp8_over_bf16']['median']:.3f} ±{row['fp8_over_bf16']['spread']:.3f}"
        f", bf16/fp8-cached {row['fp8-cached_over_bf16']['median']:.3f} ±{row['fp8-cached_over_bf16']['spread']:.3f}"
        f"; same weights {same}; losses {losses}", flush=True)
  del batch, params, state, steps
print(json.dumps(out))
