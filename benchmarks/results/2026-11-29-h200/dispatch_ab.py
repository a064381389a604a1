"""The CUDA dispatch kernel (steps 1-2 of moe_mlp at decode in one launch) against the
XLA dispatch, same process: moe_mlp at the two decode configs compiled with and without
it (cuda_dispatch.unavailable_reason patched while tracing; the kernel count of each
variant shows which ran), ROUNDS x CALLS pipelined calls in turns (a round's first
launch is then under 2 us a call); the dispatch alone;
every kernel of each variant (CUPTI). Run from a checkout's root with PYTHONPATH=. ;
writes dispatch_ab.json under $OUT."""
import json, os, statistics
import jax, jax.numpy as jnp
from benchmarks import moe, probe
from benchmarks.timing import PipelinedTimer, ratio_stats, rounds_ms
from pallas_gemm import moe_mlp
from pallas_gemm.moe import cuda_dispatch, layer

ROUNDS = 11
CALLS = {"decode-qwen3": 200, "decode-deepseek-v3": 20}
out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
print("dispatch kernel:", cuda_dispatch.unavailable_reason(1024, 128) or "runs", flush=True)


def compiled(fn, args, kernel=True):
  saved = cuda_dispatch.unavailable_reason
  if not kernel:
    cuda_dispatch.unavailable_reason = lambda *_: "switched off"
  try:
    c = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    assert (cuda_dispatch.TARGET_NAME in c.as_text()) == kernel
    return c
  finally:
    cuda_dispatch.unavailable_reason = saved


def ab(label, fns, args, roof=None, calls=200):
  for f in fns.values():
    jax.block_until_ready(f(*args))
  t = rounds_ms(PipelinedTimer(), {k: (lambda f=f: f(*args)) for k, f in fns.items()}, [()],
                ROUNDS, calls)
  names = list(fns)
  row = {k: dict(ms=statistics.median(v), rounds=v) for k, v in t.items()}
  base = names[0]
  for k in names[1:]:
    r = ratio_stats(t[k], t[base])
    row[base]["speedup_over_" + k] = [r.median, r.spread]
  line = f"== {label}: " + ", ".join(f"{k} {row[k]['ms']:.4f} ms" for k in names)
  if roof:
    line += " | of roofline: " + ", ".join(f"{k} {roof / row[k]['ms']:.3f}" for k in names)
  for k in names[1:]:
    line += f"; {base} {row[base]['speedup_over_' + k][0]:.3f}x {k} (±{row[base]['speedup_over_' + k][1]:.3f})"
  print(line, flush=True)
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
  out[name + " roofline_ms"] = roof
  fns = {"kernel": compiled(moe_mlp, args), "xla": compiled(moe_mlp, args, False)}
  a, b = fns["kernel"](*args), fns["xla"](*args)
  assert bool(jnp.array_equal(a, b)), name
  ab(f"{name} bf16 layer, {CALLS[name]} calls a round", fns, args, roof, CALLS[name])

e = 128
for pairs in (1024,):
  x = jax.random.normal(jax.random.key(0), (pairs // 8, 2048), jnp.bfloat16)
  ids = jax.random.randint(jax.random.key(pairs), (pairs // 8, 8), 0, e, jnp.int32)
  go = lambda x, i: (lambda d: (d, d.rows if d.rows is not None else x[d.token]))(
      layer.dispatch(i, e, rows_of=x))
  fns = {"kernel": compiled(go, (x, ids)), "xla": compiled(go, (x, ids), False)}
  a, b = fns["kernel"](x, ids), fns["xla"](x, ids)
  assert all(bool(jnp.array_equal(p, q)) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  ab(f"dispatch and rows alone, {pairs} pairs, {e} experts, D 2048", fns, (x, ids))

if os.environ.get("OUT"):
  with open(os.path.join(os.environ["OUT"], "dispatch_ab.json"), "w") as fh:
    json.dump(out, fh, indent=1)
