"""Decode A/B in one process (call 9): moe_mlp with the counted vs the sorted dispatch,
the fp8 inference form with the gated kernel's 64-row decode tiles vs 128-row ones, each
compiled with the module constant patched while it traces; the dispatch alone at several
pair counts; every kernel of each variant (CUPTI). Run from a checkout's root with
PYTHONPATH=. ; writes decode_ab.json under $OUT."""
import json, os, statistics
import jax, jax.numpy as jnp
from benchmarks import moe, probe
from benchmarks.timing import PipelinedTimer, ratio_stats, rounds_ms
from pallas_gemm import moe_mlp
from pallas_gemm.moe import layer
from pallas_gemm.fp8 import mosaic_gated

ROUNDS, CALLS = 9, 40
out = {}


def compiled(fn, args, patch=None):
  saved, patch = {}, patch or {}
  for (mod, name), value in patch.items():
    saved[(mod, name)] = getattr(mod, name); setattr(mod, name, value)
  try:
    return jax.jit(lambda *a: fn(*a)).lower(*args).compile()
  finally:
    for (mod, name), value in saved.items():
      setattr(mod, name, value)


def ab(label, fns, args):
  for f in fns.values():
    jax.block_until_ready(f(*args))
  t = rounds_ms(PipelinedTimer(), {k: (lambda f=f: f(*args)) for k, f in fns.items()}, [()],
                ROUNDS, CALLS)
  names = list(fns)
  row = {k: dict(ms=statistics.median(v), rounds=v) for k, v in t.items()}
  base = names[0]
  for k in names[1:]:
    r = ratio_stats(t[k], t[base])
    row[k]["speedup_of_" + base] = [r.median, r.spread]
  print(f"== {label}: " + ", ".join(f"{k} {row[k]['ms']:.4f} ms" for k in names)
        + "".join(f"; {base} {row[k]['speedup_of_' + base][0]:.3f}x {k} "
                  f"(±{row[k]['speedup_of_' + base][1]:.3f})" for k in names[1:]), flush=True)
  for k, f in fns.items():
    found = probe.ranked_kernels(f, args, 5)
    row[k]["kernel_ms"], row[k]["launches"] = found["kernel_ms"], found["launches"]
    row[k]["kernels"] = found["kernels"]
    probe.print_kernels(f"{label} {k}", found, top=40)
  out[label] = row


for name in ("decode-qwen3", "decode-deepseek-v3"):
  cfg = moe.CONFIGS[name]
  args = moe.operands(cfg, "fwd", False)
  roof = moe.roofline_ms(cfg, jax.devices()[0].device_kind)
  print(f"-- {name}: roofline {roof:.4f} ms", flush=True)
  fns = {"counted": compiled(moe_mlp, args),
         "sorted": compiled(moe_mlp, args, {(layer, "RANKED_MAX_PAIRS"): 0})}
  ab(f"{name} bf16 dispatch", fns, args)
  q = moe.PREPARE["moe_mlp/fp8"](*args)
  fns = {"tiles64": compiled(moe_mlp, q),
         "tiles128": compiled(moe_mlp, q, {(mosaic_gated, "tiles"): lambda m, g: (128, 5)})}
  ab(f"{name} fp8 gated tiles", fns, q)
  out[name + " roofline_ms"] = roof

# The dispatch alone.
e = 128
for pairs in (512, 1024, 2048, 4096):
  ids = jax.random.randint(jax.random.key(pairs), (pairs // 8, 8), 0, e, jnp.int32)
  fns = {"counted": compiled(lambda i: layer.dispatch(i, e), (ids,),
                             {(layer, "RANKED_MAX_PAIRS"): 1 << 30}),
         "sorted": compiled(lambda i: layer.dispatch(i, e), (ids,),
                            {(layer, "RANKED_MAX_PAIRS"): 0})}
  a, b = fns["counted"](ids), fns["sorted"](ids)
  assert all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  ab(f"dispatch alone, {pairs} pairs, {e} experts", fns, (ids,))

if os.environ.get("OUT"):
  with open(os.path.join(os.environ["OUT"], "decode_ab.json"), "w") as fh:
    json.dump(out, fh, indent=1)
