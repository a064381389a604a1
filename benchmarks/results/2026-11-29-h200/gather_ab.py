"""moe_mlp with its row gathers as 4-byte words (layer.gather_rows) against plain x[index]
gathers, same process: layer.gather_rows patched while the baseline traces; forward and
forward+backward at Qwen3- and gpt-oss-like sizes, and the fp8 inference form forward;
9 rounds x 5 pipelined calls in turns; outputs compared bit for bit.
PYTHONPATH=. ; writes gather_ab.json under $OUT."""
import json, os, statistics
import jax, jax.numpy as jnp
from benchmarks import moe
from benchmarks.timing import PipelinedTimer, ratio_stats, rounds_ms
from pallas_gemm import moe_mlp
from pallas_gemm.moe import layer

out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
plain = lambda x, index: x[index]  # noqa: E731


def compiled(prog, args, words):
  saved = layer.gather_rows
  if not words:
    layer.gather_rows = plain
  try:
    return prog.lower(*args).compile()
  finally:
    layer.gather_rows = saved


for name in ("qwen3", "gpt-oss"):
  cfg = moe.CONFIGS[name]
  for mode, variant in (("fwd", "moe_mlp"), ("fwd+bwd", "moe_mlp"), ("fwd", "moe_mlp/fp8")):
    args = moe.operands(cfg, mode, False)
    if variant in moe.PREPARE:
      args = jax.block_until_ready(jax.jit(moe.PREPARE[variant])(*args))
    prog = moe._program(moe_mlp, mode)
    fns = {"words": compiled(prog, args, True), "plain": compiled(prog, args, False)}
    a, b = fns["words"](*args), fns["plain"](*args)
    same = all(bool(jnp.array_equal(p, q)) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    t = rounds_ms(PipelinedTimer(), {k: (lambda f=f: f(*args)) for k, f in fns.items()}, [()], 9, 5)
    r = ratio_stats(t["plain"], t["words"])
    label = f"{name} {variant} {mode}"
    out[label] = dict(words_ms=statistics.median(t["words"]), plain_ms=statistics.median(t["plain"]),
                      speedup=[r.median, r.spread], rounds=t, bit_for_bit=same)
    print(f"== {label}: words {statistics.median(t['words']):.3f} ms, plain"
          f" {statistics.median(t['plain']):.3f} ms: {r.median:.3f}x ±{r.spread:.3f}; equal: {same}",
          flush=True)
if os.environ.get("OUT"):
  json.dump(out, open(os.path.join(os.environ["OUT"], "gather_ab.json"), "w"), indent=1)
