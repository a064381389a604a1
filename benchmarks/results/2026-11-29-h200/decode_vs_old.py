"""Same process, rounds in turns (calls 11, 12): moe_mlp at decode from the package as of
934fae8 (pallas_gemm_old, a renamed copy) and as now, bf16 and the fp8 inference form;
with TILES=1 (call 11) also the bf16 decode grouped kernels' tiles (gated and down) by
CUPTI. The copy, from a checkout's root:
    mkdir -p build/ab/old && git archive 934fae8 pallas_gemm | tar -x -C build/ab/old
    mv build/ab/old/pallas_gemm build/ab/old/pallas_gemm_old
    grep -rl pallas_gemm build/ab/old/pallas_gemm_old | xargs sed -i -E \
        's/\bpallas_gemm\b(\.|\s|$|,)/pallas_gemm_old\1/g'
    PYTHONPATH=.:build/ab/old python decode_vs_old.py"""
import dataclasses, json, os, statistics
import jax, jax.numpy as jnp
import pallas_gemm, pallas_gemm_old
from benchmarks import moe, probe
from benchmarks.timing import PipelinedTimer, ratio_stats, rounds_ms
from pallas_gemm.grouped.config import Config, default_config
from pallas_gemm.grouped import gated_ragged_dot
from pallas_gemm.moe import layer as moe_layer, quantize_experts
from pallas_gemm_old.moe import quantize_experts as old_quantize_experts

ROUNDS, CALLS = 11, 40
out = {}


def ab(label, fns, args_of):
  for k, f in fns.items():
    jax.block_until_ready(f(*args_of[k]))
  t = rounds_ms(PipelinedTimer(), {k: (lambda f=f, k=k: f(*args_of[k])) for k, f in fns.items()},
                [()], ROUNDS, CALLS)
  names = list(fns)
  row = {k: dict(ms=statistics.median(v), rounds=v) for k, v in t.items()}
  for k in names[1:]:
    r = ratio_stats(t[k], t[names[0]])
    row[k]["x_" + names[0]] = [r.median, r.spread]
  print(f"== {label}: " + ", ".join(f"{k} {row[k]['ms']:.4f} ms" for k in names)
        + "".join(f"; {names[0]} {row[k]['x_' + names[0]][0]:.3f}x {k} "
                  f"(±{row[k]['x_' + names[0]][1]:.3f})" for k in names[1:]), flush=True)
  for k, f in fns.items():
    found = probe.ranked_kernels(f, args_of[k], 5)
    row[k].update(kernel_ms=found["kernel_ms"], launches=found["launches"])
    print(f"   {k}: kernels {found['kernel_ms']:.4f} ms in {found['launches']:.0f} launches",
          flush=True)
  out[label] = row


for name in ("decode-qwen3", "decode-deepseek-v3"):
  cfg = moe.CONFIGS[name]
  args = moe.operands(cfg, "fwd", False)
  roof = moe.roofline_ms(cfg, jax.devices()[0].device_kind)
  out[name + " roofline_ms"] = roof
  print(f"-- {name}: roofline {roof:.4f} ms", flush=True)
  new, old = jax.jit(pallas_gemm.moe_mlp), jax.jit(pallas_gemm_old.moe_mlp)
  a, b = new(*args), old(*args)
  print("bf16 equal:", bool(jnp.array_equal(a, b)), flush=True)
  ab(f"{name} bf16", {"new": new, "old": old}, {"new": args, "old": args})
  qn = quantize_experts(*args[3:])
  qo = old_quantize_experts(*args[3:])
  an, ao = (*args[:3], *qn), (*args[:3], *qo)
  a, b = new(*an), old(*ao)
  print("fp8 max |new - old|:", float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))),
        flush=True)
  ab(f"{name} fp8", {"new": new, "old": old}, {"new": an, "old": ao})

# The bf16 decode kernels' tiles: group sizes of a routed decode step (1024 rows).
for name in (("decode-qwen3", "decode-deepseek-v3") if os.environ.get("TILES") else ()):
  cfg = moe.CONFIGS[name]
  x, _, ids, wgu, wd = moe.operands(cfg, "fwd", False)
  d = moe_layer.dispatch(ids, cfg.experts)
  xs = x[d.token]
  m, e, dm, f = xs.shape[0], cfg.experts, cfg.d_model, cfg.d_ff
  a = jnp.ones((m, f), jnp.bfloat16) * 0.01
  base_g = default_config(m, f, dm, e, gated=True)
  base_d = default_config(m, dm, f, e)
  gated = {"default": base_g}
  def variant(table, label, base, **kw):
    try:
      table[label] = dataclasses.replace(base, **kw)
    except Exception as ex:  # noqa: BLE001
      print(f"   skip {label}: {ex}", flush=True)
  variant(gated, "bk128", base_g, block_k=128, stages=max(2, base_g.stages // 2))
  variant(gated, "stages-1", base_g, stages=base_g.stages - 1)
  down = {"default": base_d}
  variant(down, "bn128", base_d, block_n=128)
  variant(down, "bk128", base_d, block_k=128, stages=max(2, base_d.stages // 2))
  print(f"-- {name} gated default {base_g}\n   down default {base_d}", flush=True)
  fns, args_of = {}, {}
  for k, c in gated.items():
    fns["gated " + k] = jax.jit(lambda xs, w, s, c=c: gated_ragged_dot(
        xs, w, s, activation="silu", config=c, backend="mosaic")[0])
    args_of["gated " + k] = (xs, wgu, d.group_sizes)
  for k, c in down.items():
    fns["down " + k] = jax.jit(lambda a, w, s, c=c: pallas_gemm.ragged_dot(
        a, w, s, config=c, backend="mosaic"))
    args_of["down " + k] = (a, wd, d.group_sizes)
  ok = {}
  for k, f in fns.items():
    try:
      jax.block_until_ready(f(*args_of[k])); ok[k] = f
    except Exception as ex:
      print(f"   {k}: failed {type(ex).__name__}: {str(ex)[:200]}", flush=True)
  times = {k: [] for k in ok}
  for _ in range(7):
    for k, f in ok.items():
      found = probe.ranked_kernels(f, args_of[k], 20)
      times[k].append(found["kernels"][0]["ms"])
  for k in ok:
    v = times[k]
    print(f"   {k}: {statistics.median(v) * 1e3:.1f} us (min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f})",
          flush=True)
  out[name + " tiles"] = {k: v for k, v in times.items()}

if os.environ.get("OUT"):
  with open(os.path.join(os.environ["OUT"], "decode_vs_old.json"), "w") as fh:
    json.dump(out, fh, indent=1)
