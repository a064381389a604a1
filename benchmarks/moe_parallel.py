"""Expert-parallel `moe_mlp` over 1, 2, 4, ... devices: weak and strong scaling of the
MoE layer's training step, and the same layout on jax.lax.ragged_dot.

    python -m benchmarks --moe --expert-parallel            # every config, every count
    python -m benchmarks --moe --expert-parallel --configs mixtral --devices 1,2

For n devices (a mesh of the first n, one Explicit axis), the tokens are split over them
and the E experts too (E/n each); `moe_mlp` finds the axis in the weights' sharding:
  weak    tokens = per-device tokens x n: the same work per device at every n
  strong  tokens = per-device tokens: the same problem split n ways
The step: forward, backward with a random cotangent (gradients in x, the router weights,
w_gate_up and w_down) and an SGD update of both expert weights. Variants:
  moe_mlp         moe_mlp as called by default (exchange="auto")
  moe_mlp/padded  rows exchanged by a dense all_to_all (n x the bytes)
  moe_mlp/ragged  rows exchanged by jax.lax.ragged_all_to_all (exactly the rows routed;
                  GPUs only)
  moe_mlp/padded/2, moe_mlp/ragged/2, .../4  the same with each device's tokens in 2 (4)
                  chunks (exchange_chunks), each exchanged on its own so that one chunk's
                  exchanges can run under another's GEMMs (not in the default list)
  moe_mlp/lhs, moe_mlp/lhs/2, moe_mlp/lhs/4  the step compiled with XLA's latency-hiding
                  scheduler (jax.jit(compiler_options=
                  {"xla_gpu_enable_latency_hiding_scheduler": True}); off by default in
                  XLA:GPU), which may move a collective under independent compute: one
                  chunk, 2, 4 (not in the default list)
  lax             moe_mlp's layout and exchange with jax.lax.ragged_dot as the grouped
                  GEMM (backend="xla")
  moe_mlp/tp      tensor parallel instead: every device all the tokens and F/n of every
                  expert (w_gate_up as (E, D, 2, F) split on F, w_down on F), the partial
                  sums all-reduced; strong scaling only (not in the default list)
  infer           the forward alone (an inference step), bf16 weights (not in the default
                  list; its x one device is against its own one-device run)
  infer/fp8       the forward with `quantize_experts` weights (quantized once, outside the
                  step), rows exchanged as fp8 bytes; its speedup column is fp8's over
                  "infer" (not in the default list)
  .../all-slots   (after moe_mlp, infer or infer/fp8) step 4's per-pair passes over every
                  slot of the receive buffer (parallel.PAIR_HEADROOM unbounded): no
                  lax.cond, the layout before the pairs were capped
  .../cb          (after moe_mlp, infer or infer/fp8) compiled with XLA's command buffers
                  taking conditionals too (CUDA graph conditional nodes): XLA:GPU runs a
                  lax.cond by copying its predicate to the host and waiting for the
                  device, which drains the stream; in a graph the device branches itself
  .../p64, /p128, /p256, /p1024  (after moe_mlp, infer or infer/fp8) each ragged
                  exchange's slice per peer cut into that many pieces instead of
                  RAGGED_SLICES_PER_PEER: XLA's ragged-all-to-all kernel runs one block
                  of 128 threads per piece
On one device the variants are moe_mlp without an axis, "lax" and the inference ones.
Figures: ms per step (wall clock of back-to-back steps, rounds in rotated order, median),
per-device tokens per second, weak efficiency t(1) / t(n) and strong speedup t(1) / t(n)
(same per-device work for weak; the same problem for strong), moe_mlp's speedup over
the others (per-round ratios: median ± half the interquartile range).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import moe as layer_bench
from benchmarks.timing import PipelinedTimer, ratio_stats, rounds_ms
from pallas_gemm import moe_mlp

DTYPE = jnp.bfloat16
AXIS = "expert"
DEFAULT_VARIANTS = ("moe_mlp", "moe_mlp/padded", "moe_mlp/ragged", "lax")
INFERENCE = ("infer", "infer/fp8")
# Modifiers of moe_mlp and of the inference variants.
MODIFIED = ("all-slots", "cb", "p64", "p128", "p256", "p1024")
VARIANTS = DEFAULT_VARIANTS + ("moe_mlp/tp",) + tuple(
    f"moe_mlp/{e}/{c}" for c in (2, 4) for e in ("padded", "ragged")) + (
    "moe_mlp/lhs", "moe_mlp/lhs/2", "moe_mlp/lhs/4") + INFERENCE + tuple(
    f"{v}/{m}" for v in ("moe_mlp",) + INFERENCE for m in MODIFIED)
# The option of the "lhs" variants: XLA:GPU schedules collectives without it by default.
LATENCY_HIDING = {"xla_gpu_enable_latency_hiding_scheduler": True}
# The option of the "cb" variants: XLA's default command buffer kinds and conditionals.
COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer":
                   "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL"}


def unmodified(variant: str) -> str:
  """The variant without its modifier (`MODIFIED`)."""
  parts = variant.split("/")
  return "/".join(p for p in parts if p not in MODIFIED)


def baseline(variant: str) -> str | None:
  """The variant a variant's speedup is taken against: moe_mlp's training step for the
  training variants, "infer" for "infer/fp8" (reported as fp8's speedup), an inference
  variant for its modified forms, none for "infer" and moe_mlp itself."""
  if variant in ("moe_mlp", "infer"):
    return None
  if variant == "infer/fp8":
    return "infer"
  return unmodified(variant) if unmodified(variant) in INFERENCE else "moe_mlp"


def fp8_experts(variant: str) -> bool:
  """Whether the variant's step takes `quantize_experts` weights (`quantized`)."""
  return unmodified(variant) == "infer/fp8"


@dataclasses.dataclass(frozen=True)
class Config:
  name: str
  tokens_per_device: int
  d_model: int
  d_ff: int
  experts: int
  top_k: int
  # Why jax.lax.ragged_dot cannot run this config, if it cannot.
  no_lax: str = ""


CONFIGS = {c.name: c for c in (
    Config("mixtral", 8192, 4096, 14336, 8, 2),
    Config("qwen3", 8192, 2048, 768, 128, 8,
           no_lax="jax.lax.ragged_dot lowers through a dense (G, M, K) operand; at 32-128"
                  " experts XLA's autotuner runs out of memory (24-32 GiB asks) and the"
                  " call takes minutes to fail"),
)}
TINY = dict(tokens_per_device=32, d_model=128, d_ff=128, experts=8, top_k=2)  # fp8: 128s


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks --moe --expert-parallel",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--configs", default=",".join(CONFIGS), help=f"from {list(CONFIGS)}")
  p.add_argument("--devices", default=None,
                 help="comma-separated device counts (default 1, 2, 4, ... up to all)")
  p.add_argument("--scaling", default="weak,strong", help="weak, strong")
  p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=", ".join(VARIANTS))
  p.add_argument("--rounds", type=int, default=None, help="rounds (GPU 5, CPU 2)")
  p.add_argument("--calls", type=int, default=None, help="steps per round (GPU 3, CPU 1)")
  p.add_argument("--breakdown", action="store_true",
                 help="instead: the forward's parts at each count (exchange, experts, the"
                      " whole layer) with the padded and the ragged exchange")
  p.add_argument("--kernels", action="store_true",
                 help="GPU: the kernels of each variant's step (weak scaling's problem) by"
                      " name (CUPTI), per device, beside the step's wall clock")
  p.add_argument("--out", type=pathlib.Path, default=None)
  return p.parse_args(argv)


def _counts(spec: str | None) -> list[int]:
  """The device counts asked for (default 1, 2, 4, ... up to all), those beyond the
  devices there are left out with a line that says so."""
  available = len(jax.devices())
  asked = [int(c) for c in spec.split(",")] if spec else [1, 2, 4, 8, 16]
  beyond = [n for n in asked if n > available]
  if spec and beyond:
    print(f"left out: {beyond} devices ({available} available)", flush=True)
  return [n for n in asked if n <= available]


def problem(cfg: Config, tokens: int, mesh):
  """(params, x, topk_weights, topk_ids, cotangent): the one-device benchmark's operands
  (`moe.operands`) for `tokens` tokens, made split over the mesh (or on one device when
  mesh is None)."""
  shape = layer_bench.Config(cfg.name, tokens, cfg.d_model, cfg.d_ff, cfg.experts, cfg.top_k)
  split = None if mesh is None else NamedSharding(mesh, P(AXIS))
  x, weights, ids, wgu, wd, ct = jax.jit(
      lambda: layer_bench.operands(shape, "fwd+bwd", is_dense=False), out_shardings=split)()
  return (wgu, wd), x, weights, ids, ct


def tensor_parallel(args, n: int):
  """The step's operands on a mesh of n devices with one axis "model": the weights split
  on F (w_gate_up as (E, D, 2, F)), the tokens and the cotangent whole on every device."""
  mesh = jax.make_mesh((n,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:n])
  (wgu, wd), *rest = args
  e, d, width = wgu.shape
  gate_up = jax.device_put(wgu.reshape(e, d, 2, width // 2),
                           NamedSharding(mesh, P(None, None, None, "model")))
  down = jax.device_put(wd, NamedSharding(mesh, P(None, "model")))
  return ((gate_up, down), *(jax.device_put(a, NamedSharding(mesh, P())) for a in rest))


def _with_constant(name: str, value, layer, *args):
  """layer traced with `parallel.<name>` set to value (module constants are read while
  the layer traces)."""
  from pallas_gemm.moe import parallel  # noqa: PLC0415 - an A/B of a module constant
  kept = getattr(parallel, name)
  setattr(parallel, name, value)
  try:
    return layer(*args)
  finally:
    setattr(parallel, name, kept)


def _modified(layer, parts):
  """layer under the all-slots or pieces modifier among parts (or layer itself)."""
  if "all-slots" in parts:  # step 4's pair capacity unbounded
    return functools.partial(_with_constant, "PAIR_HEADROOM", float(2 ** 40), layer)
  for p in parts:
    if p in MODIFIED and p.startswith("p"):
      return functools.partial(_with_constant, "RAGGED_SLICES_PER_PEER", int(p[1:]), layer)
  return layer


def quantized(args, mesh):
  """args with the expert weights as `quantize_experts` pairs, split as the weights were."""
  from pallas_gemm.moe import quantize_experts  # noqa: PLC0415
  params, *rest = args
  pairs = jax.jit(quantize_experts)(*params)
  if mesh is not None:
    pairs = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS))), pairs)
  return (pairs, *rest)


def step_fn(variant: str):
  """One training step of the layer: value, gradients, SGD on the expert weights. The
  inference variants: the forward alone."""
  parts = variant.split("/")[1:]  # moe_mlp[/exchange][/lhs][/chunks][/modifier]
  options = (LATENCY_HIDING if "lhs" in parts else COMMAND_BUFFERS if "cb" in parts else
             None)
  if unmodified(variant) in INFERENCE:
    layer = _modified(moe_mlp, parts)
    return jax.jit(lambda params, x, weights, ids, ct: layer(x, weights, ids, *params),
                   compiler_options=options)
  backend = "xla" if variant == "lax" else "auto"
  exchange = next((p for p in parts if p in ("padded", "ragged")), "auto")
  chunks = next((int(p) for p in parts if p.isdigit()), 1)
  layer = functools.partial(moe_mlp, backend=backend, exchange=exchange,
                            exchange_chunks=chunks)
  layer = _modified(layer, parts)

  def step(params, x, weights, ids, ct):
    def loss(params, x, weights):
      out = layer(x, weights, ids, *params)
      return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    value, (g, dx, dw) = jax.value_and_grad(loss, argnums=(0, 1, 2))(params, x, weights)
    params = jax.tree.map(lambda p, gp: (p - 1e-3 * gp).astype(p.dtype), params, g)
    return params, value, dx, dw

  return jax.jit(step, compiler_options=options)


def _reason(e: Exception) -> str:
  return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def run_point(cfg: Config, n: int, tokens: int, variants: list[str], rounds: int,
              calls: int) -> dict:
  """{variant: row} for one config, device count and token count."""
  mesh = None
  if n > 1:
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])
  args = problem(cfg, tokens, mesh)
  programs, failed, variants = {}, {}, list(variants)
  operands = {v: args for v in variants}
  if "moe_mlp/tp" in variants and n > 1:
    if tokens != cfg.tokens_per_device:
      variants.remove("moe_mlp/tp")
      failed["moe_mlp/tp"] = "left out: every device runs all the tokens (strong scaling only)"
    else:
      operands["moe_mlp/tp"] = tensor_parallel(args, n)
  fp8 = [v for v in variants if fp8_experts(v)]
  if fp8:  # quantized once for every fp8 variant
    try:
      operands.update(dict.fromkeys(fp8, quantized(args, mesh)))
    except Exception as e:  # noqa: BLE001 - reported as the variants' failure
      for v in fp8:
        variants.remove(v)
        failed[v] = _reason(e)
  if n == 1:  # one device: no exchange, one program (no branch either)
    variants = [v for v in variants if not v.startswith("moe_mlp/") and v == unmodified(v)]
  elif jax.default_backend() != "gpu":
    for v in [v for v in variants if v.startswith("moe_mlp/ragged")]:
      variants.remove(v)
      failed[v] = "left out: XLA:CPU does not implement ragged-all-to-all"
  if cfg.no_lax and "lax" in variants:
    variants = [v for v in variants if v != "lax"]
    failed["lax"] = f"left out: {cfg.no_lax}"
  for v in variants:
    try:
      prog = step_fn(v)
      jax.block_until_ready(prog(*operands[v]))
      programs[v] = prog
    except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported
      failed[v] = _reason(e)
  bound = {v: (lambda p=p, a=operands[v]: p(*a)) for v, p in programs.items()}
  times = rounds_ms(PipelinedTimer(), bound, [()], rounds, calls) if bound else {}
  out = {v: dict(status="failed", reason=why) for v, why in failed.items()}
  for v, t in times.items():
    out[v] = dict(status="ok", ms=statistics.median(t), rounds_ms=t,
                  tokens_per_s_per_device=tokens / n / statistics.median(t) * 1e3)
    base = baseline(v)
    if v == "infer/fp8" and base in times:
      r = ratio_stats(times[base], t)  # > 1: fp8 is faster
      out[v]["fp8_speedup"] = dict(median=r.median, spread=r.spread, verdict=r.verdict)
    elif base is not None and base in times:
      r = ratio_stats(t, times[base])  # > 1: moe_mlp is faster
      out[v]["moe_mlp_speedup"] = dict(median=r.median, spread=r.spread, verdict=r.verdict)
  return out


def breakdown(cfg: Config, n: int, rounds: int, calls: int) -> dict:
  """ms of the expert-parallel forward and of its parts, weak scaling's problem at n
  devices: the layer; one exchange of the rows (each kind); the experts' FFN on a
  receive buffer of n * R rows holding R; the same FFN on R rows (no buffer)."""
  from pallas_gemm.moe import layer, parallel  # noqa: PLC0415 - diagnostics only
  mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:n])
  tokens = cfg.tokens_per_device * n
  (wgu, wd), x, weights, ids, _ = problem(cfg, tokens, mesh)
  r = cfg.tokens_per_device * cfg.top_k
  plan = layer.Plan(activation="swiglu", precision=None, out_dtype=DTYPE, backend="auto")
  local_experts = cfg.experts // n
  sizes = jnp.full((local_experts,), r // local_experts, jnp.int32).at[0].add(
      r % local_experts)

  def rows_only(exchange):  # `parallel.local`'s steps 1-3, the rows only
    def body(x, ids):
      wanted, d = parallel.destinations(ids, n, local_experts)
      rows = layer.pair_rows(x, d, n)
      counts = jax.lax.all_gather(d.group_sizes, AXIS)
      kind, off = parallel.exchange_plan(counts, jax.lax.axis_index(AXIS), n, exchange)
      t = x.shape[0]
      buf = jax.lax.pcast(jnp.zeros((n * t, x.shape[1]), x.dtype), AXIS, to="varying")
      return parallel.move(kind, capacity=t)(rows, buf, *off[:4], axis_name=AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))

  def ffn(rows):
    def body(wgu, wd):
      xs = jnp.ones((rows, cfg.d_model), DTYPE)
      return layer.experts_forward(plan, xs, wgu, wd, sizes, write_h=False)[0]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))

  fns = {
      "layer fwd (padded)": (jax.jit(functools.partial(moe_mlp, exchange="padded")),
                             (x, weights, ids, wgu, wd)),
      "layer fwd (ragged)": (jax.jit(functools.partial(moe_mlp, exchange="ragged")),
                             (x, weights, ids, wgu, wd)),
      "dispatch+exchange (padded)": (rows_only("padded"), (x, ids)),
      "dispatch+exchange (ragged)": (rows_only("ragged"), (x, ids)),
      "experts, n*R-row buffer": (ffn(n * r), (wgu, wd)),
      "experts, R rows": (ffn(r), (wgu, wd)),
  }
  if jax.default_backend() != "gpu":  # XLA:CPU has no ragged-all-to-all
    fns = {k: v for k, v in fns.items() if "ragged" not in k}
  bound = {k: (lambda f=f, a=a: f(*a)) for k, (f, a) in fns.items()}
  times = rounds_ms(PipelinedTimer(), bound, [()], rounds, calls)
  return {k: statistics.median(t) for k, t in times.items()}


def kernels(cfg: Config, n: int, calls: int, variant: str = "moe_mlp", top: int = 18) -> dict:
  """Kernel time per step and device of a variant's step (weak scaling's problem at n
  devices), by kernel name, from CUPTI; the gap to the wall clock is time no kernel ran
  (launch, host, a device waiting with nothing queued)."""
  from benchmarks.probe import print_kernels, ranked_kernels  # noqa: PLC0415 - GPU only
  mesh = None if n == 1 else jax.make_mesh(
      (n,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:n])
  args = problem(cfg, cfg.tokens_per_device * n, mesh)
  if fp8_experts(variant):
    args = quantized(args, mesh)
  step = step_fn(variant)
  wall = statistics.median(rounds_ms(PipelinedTimer(), {"s": lambda: step(*args)}, [()], 3,
                                     calls)["s"])
  found = ranked_kernels(step, args, calls, devices=n)  # per step and device
  print_kernels(f"{cfg.name}, {n} device(s), weak problem, {variant}: step {wall:.3f} ms"
                " wall; kernels per device", found, top)
  return dict(wall_ms=wall, kernel_ms=found["kernel_ms"], kernels=found["kernels"])


def main(args=None) -> int:
  opts = parse_args(list(args or [])) if not isinstance(args, argparse.Namespace) else args
  on_gpu = jax.default_backend() == "gpu"
  rounds = opts.rounds or (5 if on_gpu else 2)
  calls = opts.calls or (3 if on_gpu else 1)
  names = [c for c in opts.configs.split(",") if c]
  scalings = [s for s in opts.scaling.split(",") if s]
  variants = [v for v in opts.variants.split(",") if v]
  if (any(c not in CONFIGS for c in names) or any(s not in ("weak", "strong") for s in scalings)
      or any(v not in VARIANTS for v in variants)):
    print(f"choose configs from {list(CONFIGS)}, scaling from weak/strong, variants from"
          f" {VARIANTS}", file=sys.stderr)
    return 2
  if opts.kernels and "moe_mlp/tp" in variants:
    print("--kernels times the weak problem; moe_mlp/tp runs strong scaling only",
          file=sys.stderr)
    return 2
  configs = [CONFIGS[c] for c in names]
  if not on_gpu:
    configs = [dataclasses.replace(configs[0], **TINY)]
  counts = _counts(opts.devices)
  kind = jax.devices()[0].device_kind
  if opts.kernels:
    found = {f"{cfg.name} n={n} {v}": kernels(cfg, n, calls, v)
             for cfg in configs for n in counts if cfg.experts % n == 0 for v in variants}
    if opts.out is not None:
      opts.out.mkdir(parents=True, exist_ok=True)
      (opts.out / "moe_parallel_kernels.json").write_text(json.dumps(found, indent=1))
    return 0
  if opts.breakdown:
    parts = {}
    for cfg in configs:
      for n in [c for c in counts if c > 1 and cfg.experts % c == 0]:
        parts[f"{cfg.name} n={n}"] = ms = breakdown(cfg, n, rounds, calls)
        print(f"{cfg.name} over {n} devices (weak: {cfg.tokens_per_device} tokens each),"
              " forward, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()), flush=True)
    if opts.out is not None:
      opts.out.mkdir(parents=True, exist_ok=True)
      (opts.out / "moe_parallel_breakdown.json").write_text(json.dumps(parts, indent=1))
    return 0
  print(f"device: {kind} x {len(jax.devices())}, jax {jax.__version__}, wall clock of"
        f" pipelined steps, {rounds} rounds x {calls} steps"
        + ("" if on_gpu else "; no GPU: one tiny config"), flush=True)
  results = []
  for cfg in configs:
    ns = [n for n in counts if cfg.experts % n == 0]
    one = None
    for scaling in scalings:
      for n in ns:
        if n == 1 and one is not None:
          row = dict(one, scaling=scaling)   # one device: weak and strong are one problem
        else:
          tokens = cfg.tokens_per_device * (n if scaling == "weak" else 1)
          row = dict(config=dataclasses.asdict(cfg), scaling=scaling, devices=n,
                     tokens=tokens, variants=run_point(cfg, n, tokens, variants, rounds,
                                                       calls))
          if n == 1:
            one = row
        if one is not None:
          for v, r in row["variants"].items():
            base = one["variants"].get(
                v if v == "lax" else unmodified(v) if unmodified(v) in INFERENCE else
                "moe_mlp", {})
            if r["status"] == "ok" and base.get("status") == "ok":
              r["vs_one_device"] = base["ms"] / r["ms"]  # weak: efficiency; strong: speedup
        results.append(row)
        print(markdown([row], header=len(results) == 1), flush=True)
  text = markdown(results)
  if opts.out is not None:
    opts.out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=kind, devices=len(jax.devices()), jax=jax.__version__,
                timer="wall clock, pipelined steps, rotated rounds", rounds=rounds,
                calls=calls)
    (opts.out / "moe_parallel.json").write_text(json.dumps(dict(meta=meta, results=results),
                                                           indent=1))
    (opts.out / "moe_parallel.md").write_text(text + "\n")
    print(f"wrote {opts.out}/moe_parallel.json, moe_parallel.md", flush=True)
  print(text, flush=True)
  return 0


def markdown(results: list[dict], header: bool = True) -> str:
  lines = []
  if header:
    lines += ["| config | scaling | devices | tokens | variant | ms/step | tokens/s/device |"
              " x one device | moe_mlp speedup |", "|---|---|---:|---:|---|---:|---:|---:|---:|"]
  for row in results:
    c = row["config"]
    label = f"{c['name']} (D {c['d_model']}, F {c['d_ff']}, E {c['experts']}, k {c['top_k']})"
    for v, r in row["variants"].items():
      if r["status"] != "ok":
        lines.append(f"| {label} | {row['scaling']} | {row['devices']} | {row['tokens']} |"
                     f" {v} | failed: {r['reason']} | | | |")
        continue
      sp = r.get("moe_mlp_speedup")
      fp8 = r.get("fp8_speedup")
      speedup = ("" if sp is None and fp8 is None else
                 f"{sp['median']:.2f} ± {sp['spread']:.2f}" if sp is not None else
                 f"fp8 {fp8['median']:.2f}x ± {fp8['spread']:.2f}")
      lines.append(
          f"| {label} | {row['scaling']} | {row['devices']} | {row['tokens']} | {v} |"
          f" {r['ms']:.3f} | {r['tokens_per_s_per_device']:.3g} |"
          f" {r.get('vs_one_device', float('nan')):.2f} |"
          f" {speedup} |")
  return "\n".join(lines)
