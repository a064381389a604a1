"""Training steps and a GEMM epilogue in jax.jit programs: pallas_gemm vs XLA.

    python -m benchmarks --mlp [--kinds sgd,adamw,grad] [--rounds 15] [--steps 5]
                               [--timer cupti|wall] [--parts steps,epilogue] [--out DIR]

1. Training steps of a two-layer MLP, x (M, D) -> W1 (D, H) + b1 -> GELU (tanh) -> W2 (H, D)
   + b2, mean squared error against y. `sgd`: value_and_grad and an SGD update in one jit;
   `adamw`: the same with optax.adamw; `grad`: value_and_grad alone. Each written as
   stock jnp (jnp.dot + jax.nn.gelu: XLA's cuBLAS calls and fusions), with
   `pallas_gemm.mlp` (the hidden layer's epilogue stores z and GELU(z), the backward GEMM
   multiplies by GELU'(z)), and with `pallas_gemm.dot_general` where jnp.dot was (the
   drop-in a Flax layer takes). The stock step is timed twice, as two jitted functions
   ("stock again"): the A/A row, whose ratio should tie with 1 within its spread.
   bf16 at x 8192x4096, H 16384. float32 HIGHEST at x 4096x2048, H 8192: IEEE float32
   runs at ~1/15 of bf16's tensor-core rate, so the bf16 shape's step would take ~130 ms
   and its rounds most of the budget; at 1/8 of the FLOPs each GEMM (4096x8192x2048,
   137 GFLOP) still keeps every SM busy.
2. `gemm(a, b, c, alpha=0.5, beta=2.0)` vs the jnp expression `0.5 * (a @ b) + 2 * c`, bf16
   2048^3, 4096^3, 8192^3, inputs rotated beyond L2.

Method (`timing.rounds_ms`, `timing.ratio_stats`): `--rounds` rounds, the variants in an
order rotated by one place each round; per round and variant the median of `--steps`
steps. Timer `cupti` (the GPU's default): the device time of a step, the sum of its
kernels' CUPTI times (launch gaps excluded); `wall`: wall clock of `--steps` back-to-back
steps with one wait, per step (the CPU's timer, per call). Every ratio is taken between
variants of the same round, reported as the median over rounds with its interquartile
range and extremes; "parity" where |median - 1| < half the IQR. The first step's loss, and
the gradients (grad), of each variant are compared with stock's
(relative difference; the bound is reference.tolerance of the GEMMs, doubled for the
chain of two).
On a CPU every shape is tiny and the rounds few: a smoke run of the same code.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import pallas_gemm
from pallas_gemm import dot_general
from pallas_gemm.matmul import tuning
from pallas_gemm.testing.reference import relative_error, tolerance
from benchmarks.timing import PipelinedTimer, Timer, ratio_stats, rounds_ms

HIGHEST = jax.lax.Precision.HIGHEST
STOCK, AGAIN = "stock (XLA)", "stock again (A/A)"
# (label, dtype, precision, (M, D, H) on a GPU): see the module docstring for the f32 shape.
PROBLEMS = [("bf16", jnp.bfloat16, None, (8192, 4096, 16384)),
            ("f32-highest", jnp.float32, HIGHEST, (4096, 2048, 8192))]
TINY = (32, 16, 64)      # a CPU, and --quick
QUICK = (256, 128, 512)  # --quick on a GPU
KINDS = ("grad", "sgd", "adamw")
SGD_LR, ADAMW_LR = 1e-2, 1e-4


def forwards(precision, extra: bool = False) -> dict:
  """name -> forward(params, x): the stock MLP and the pallas_gemm ways of writing it."""
  def stock(params, x):
    h = jax.nn.gelu(jnp.dot(x, params["w1"], precision=precision) + params["b1"])
    return jnp.dot(h, params["w2"], precision=precision) + params["b2"]

  def dot(a, b):
    return dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), precision)

  def drop_in(params, x):  # stock, with pallas_gemm.dot_general where jnp.dot was
    h = jax.nn.gelu(dot(x, params["w1"]) + params["b1"])
    return dot(h, params["w2"]) + params["b2"]

  def mlp(params, x):
    return pallas_gemm.mlp(x, params["w1"], params["b1"], params["w2"], params["b2"], "gelu",
                           precision=precision)

  def dense(params, x):  # bias + GELU in the first layer's epilogue
    h = pallas_gemm.dense(x, params["w1"], params["b1"], "gelu", precision=precision)
    return pallas_gemm.dense(h, params["w2"], params["b2"], precision=precision)

  def gated(params, x):  # GELU as the second layer's input: its derivative in an epilogue
    z = pallas_gemm.dense(x, params["w1"], params["b1"], precision=precision)
    return pallas_gemm.dense(z, params["w2"], params["b2"], input_activation="gelu",
                             precision=precision)

  out = {STOCK: stock, AGAIN: stock, "pallas_gemm.mlp": mlp, "dot_general": drop_in}
  return out | ({"dense": dense, "gated": gated} if extra else {})


def problem(dtype, m: int, d: int, hidden: int):
  """(params, x, y) of the MLP: W1 (d, hidden), W2 (hidden, d), x and y (m, d)."""
  keys = jax.random.split(jax.random.key(0), 6)
  params = {"w1": jax.random.normal(keys[0], (d, hidden), dtype) / d**0.5,
            "b1": jax.random.normal(keys[1], (hidden,), dtype) * 0.1,
            "w2": jax.random.normal(keys[2], (hidden, d), dtype) / hidden**0.5,
            "b2": jax.random.normal(keys[3], (d,), dtype) * 0.1}
  x = jax.random.normal(keys[4], (m, d), dtype)
  y = jax.random.normal(keys[5], (m, d), dtype)
  return params, x, y


def loss_of(forward):
  """The mean squared error of forward(params, x) against y, in f32."""
  return lambda p, x, y: jnp.mean((forward(p, x).astype(jnp.float32)
                                   - y.astype(jnp.float32)) ** 2)


def train_step(forward, kind: str, params):
  """(a new jitted step(state, x, y) -> (state', loss), the initial state) of `kind`."""
  grad = jax.value_and_grad(loss_of(forward))
  if kind == "grad":
    return jax.jit(lambda p, x, y: grad(p, x, y)[::-1]), params
  if kind == "sgd":
    def sgd(p, x, y):
      loss, g = grad(p, x, y)
      return jax.tree.map(lambda w, dw: w - SGD_LR * dw, p, g), loss
    return jax.jit(sgd), params
  if kind == "adamw":
    import optax  # noqa: PLC0415 - optional (the flax extra)
    opt = optax.adamw(ADAMW_LR)

    def adamw(state, x, y):
      p, opt_state = state
      loss, g = grad(p, x, y)
      updates, opt_state = opt.update(g, opt_state, p)
      return (optax.apply_updates(p, updates), opt_state), loss
    return jax.jit(adamw), (params, opt.init(params))
  raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")


def _first_step_checks(steps: dict, states: dict, x, y, kind: str, params) -> dict:
  """{name: (loss relative difference, update relative difference or None)} vs stock."""
  outs = {name: step(states[name], x, y) for name, step in steps.items()}
  base_state, base_loss = outs[STOCK]
  checks = {}
  for name, (state, loss) in outs.items():
    loss_diff = abs(float(loss) - float(base_loss)) / abs(float(base_loss))
    update_diff = None
    # grad: the gradients themselves. Not the steps' parameter deltas (new - old): a
    # weight of ~1/sqrt(D) has an ulp (float32: ~2e-9) that is a large part of most of
    # lr * dw, so the delta's rounding, not the GEMMs, is what such a check would see
    # (float32 HIGHEST SGD deltas differed by 1.3e-4 from stock's while the loss agreed).
    if kind == "grad":
      update_diff = max(relative_error(state[k].astype(jnp.float32),
                                       base_state[k].astype(jnp.float32)) for k in ("w1", "w2"))
    checks[name] = (loss_diff, update_diff)
  return checks


def steps_part(kinds, rounds: int, calls: int, timer, shape=None, extra=False) -> list[dict]:
  on_gpu = jax.default_backend() == "gpu"
  rows = []
  for label, dtype, precision, full_shape in PROBLEMS:
    m, d, hidden = shape or (full_shape if on_gpu else TINY)
    params, x, y = problem(dtype, m, d, hidden)
    # Each of the two GEMM chains of a step is compared against stock: twice the bound.
    bound = 2 * tolerance(dtype, precision, hidden)
    for kind in kinds:
      steps, states = {}, {}
      for name, forward in forwards(precision, extra).items():
        steps[name], states[name] = train_step(forward, kind, params)
      checks = _first_step_checks(steps, states, x, y, kind, params)
      # One input set: a step reads W1, W2 and x, beyond L2 at the GPU shapes; each step
      # starts from the same state (the timed calls' outputs are not fed back).
      per_round = rounds_ms(timer, {n: _bind(steps[n], states[n]) for n in steps}, [(x, y)],
                            rounds, calls)
      for name in steps:
        r = ratio_stats(per_round[STOCK], per_round[name])
        loss_diff, update_diff = checks[name]
        ok = loss_diff <= bound and (update_diff is None or update_diff <= bound)
        row = dict(bench="mlp step", dtype=label, kind=kind, shape=[m, d, hidden], variant=name,
                   ms=float(np.median(per_round[name])), round_ms=per_round[name],
                   ratio=r.median, p25=r.p25, p75=r.p75, low=r.low, high=r.high,
                   spread=r.spread, verdict="" if name == STOCK else r.verdict,
                   loss_rel_diff=loss_diff, update_rel_diff=update_diff, bound=bound, ok=ok)
        rows.append(row)
        print(_line(row), flush=True)
      again = next(r for r in rows[-len(steps):] if r["variant"] == AGAIN)
      print(f"A/A {label} {kind}: stock vs stock again {again['ratio']:.4f}x, half IQR "
            f"{again['spread']:.4f}: " + ("ties" if again["verdict"] == "parity" else
                                          "DOES NOT TIE (the spread understates the noise)"),
            flush=True)
      del steps, states
  return rows


def _bind(step, state):
  """step(state, x, y) as a function of (x, y), its output a pytree the timer waits on."""
  return lambda x, y: step(state, x, y)


def _line(row: dict) -> str:
  head = f"{row['bench']:10s} {row['dtype']:11s} {row.get('kind', ''):6s} {row['variant']:20s}"
  text = (f"{head} {row['ms']:9.3f} ms  {row['ratio']:.4f}x (IQR {row['p25']:.4f}-"
          f"{row['p75']:.4f}, {row['low']:.4f}-{row['high']:.4f}) {row['verdict']}")
  if "loss_rel_diff" in row:
    update = "" if row["update_rel_diff"] is None else f", update {row['update_rel_diff']:.1e}"
    text += f"  vs stock: loss {row['loss_rel_diff']:.1e}{update}" + (
        "" if row["ok"] else f" OUTSIDE {row['bound']:.1e}")
  return text


def epilogue_part(rounds: int, calls: int, timer, sizes) -> list[dict]:
  on_gpu = jax.default_backend() == "gpu"
  rows = []
  for n in sizes:
    count = tuning.input_set_count(2 * 3 * n * n) if on_gpu else 2
    sets = tuning.random_inputs((n, n), (n, n), jnp.bfloat16, count)
    cs = jax.random.normal(jax.random.key(1), (count, n, n), jnp.bfloat16)
    sets = [(a, b, cs[i]) for i, (a, b) in enumerate(sets)]
    fns = {"jnp expression": jax.jit(lambda a, b, c: 0.5 * (a @ b) + 2.0 * c)}
    for backend in ("auto", "xla") + (("mosaic",) if on_gpu else ()):
      fns[f"gemm {backend}"] = jax.jit(lambda a, b, c, backend=backend: pallas_gemm.gemm(
          a, b, c, alpha=0.5, beta=2.0, backend=backend))
    per_round = rounds_ms(timer, fns, sets, rounds, calls)
    for name in fns:
      r = ratio_stats(per_round["jnp expression"], per_round[name])
      ms = float(np.median(per_round[name]))
      row = dict(bench=f"alpha/beta*C bf16 {n}^3", dtype="bf16", variant=name, ms=ms,
                 round_ms=per_round[name], tflops=2 * n**3 / ms / 1e9, ratio=r.median,
                 p25=r.p25, p75=r.p75, low=r.low, high=r.high, spread=r.spread,
                 verdict="" if name == "jnp expression" else r.verdict)
      rows.append(row)
      print(_line(row), flush=True)
  return rows


def markdown(meta: dict, rows: list[dict]) -> str:
  lines = [f"# pallas_gemm training steps: {meta['device']}", "",
           f"jax {meta['jax']}, timer: {meta['timer']}, {meta['rounds']} rounds x "
           f"{meta['steps']} steps, the variants in rotated order. `x stock`: the median over "
           "rounds of stock's time / the variant's in the same round (> 1: faster), with "
           "the interquartile range and the extremes; parity where |x - 1| < half the IQR. "
           "`stock again` is the A/A check: stock timed as a second function.", ""]
  steps = [r for r in rows if r["bench"] == "mlp step"]
  if steps:
    lines += ["| dtype | M, D, H | step | variant | median ms | x stock | IQR | min-max "
              "| verdict | vs stock: loss / update |",
              "|---|---|---|---|---:|---:|---|---|---|---|"]
    for r in steps:
      update = "-" if r["update_rel_diff"] is None else f"{r['update_rel_diff']:.1e}"
      lines.append(
          f"| {r['dtype']} | {', '.join(map(str, r['shape']))} | {r['kind']} | {r['variant']} "
          f"| {r['ms']:.3f} | **{r['ratio']:.4f}** | {r['p25']:.4f}-{r['p75']:.4f} "
          f"| {r['low']:.4f}-{r['high']:.4f} | {r['verdict']} "
          f"| {r['loss_rel_diff']:.1e} / {update}{'' if r['ok'] else ' OUTSIDE'} |")
  epi = [r for r in rows if r["bench"] != "mlp step"]
  if epi:
    lines += ["", "| problem | variant | median ms | TFLOP/s | x expression | IQR | min-max "
              "| verdict |", "|---|---|---:|---:|---:|---|---|---|"]
    for r in epi:
      lines.append(f"| {r['bench']} | {r['variant']} | {r['ms']:.4f} | {r['tflops']:.1f} "
                   f"| **{r['ratio']:.4f}** | {r['p25']:.4f}-{r['p75']:.4f} "
                   f"| {r['low']:.4f}-{r['high']:.4f} | {r['verdict']} |")
  if meta["platform"] != "gpu":
    lines += ["", "CPU: tiny shapes, a smoke run; the times measure this CPU."]
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path: pathlib.Path) -> bool:
  """The steps' ratios to stock: median, IQR (thick) and extremes (thin) per variant."""
  try:
    import matplotlib  # noqa: PLC0415 - optional (the bench extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return False
  steps = [r for r in rows if r["bench"] == "mlp step" and r["variant"] != STOCK]
  if not steps:
    return False
  fig, ax = plt.subplots(figsize=(8, 0.6 + 0.32 * len(steps)))
  for i, r in enumerate(steps[::-1]):
    ax.plot([r["low"], r["high"]], [i, i], color="k", lw=0.8)
    ax.plot([r["p25"], r["p75"]], [i, i], color="tab:blue", lw=5)
    ax.plot([r["ratio"]], [i], "o", color="white", mec="k")
  ax.axvline(1.0, color="k", ls=":")
  ax.set_yticks(range(len(steps)), [f"{r['dtype']} {r['kind']} {r['variant']}"
                                    for r in steps[::-1]], fontsize=7)
  ax.set_xlabel("speed vs stock (x): median (dot), IQR (bar), min-max (line), per round")
  ax.set_title(f"MLP training steps, {meta['device']} (jax {meta['jax']}, "
               f"{meta['timer'].split(' (')[0]})", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv=None) -> int:
  on_gpu = jax.default_backend() == "gpu"
  p = argparse.ArgumentParser(prog="python -m benchmarks --mlp", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="small shapes")
  p.add_argument("--parts", default="steps,epilogue", help="comma-separated: steps, epilogue")
  p.add_argument("--kinds", default="sgd,adamw", help="comma-separated: " + ", ".join(KINDS))
  p.add_argument("--rounds", type=int, default=15 if on_gpu else 3)
  p.add_argument("--steps", type=int, default=5 if on_gpu else 2,
                 help="timed steps (calls) per variant and round")
  p.add_argument("--timer", choices=("cupti", "wall"), default="cupti" if on_gpu else "wall")
  p.add_argument("--shape", help="M,D,H for every dtype (default: see --help's text)")
  p.add_argument("--all-variants", action="store_true",
                 help="also pallas_gemm.dense (fused bias + GELU) and the gated form")
  p.add_argument("--out", type=pathlib.Path)
  args = p.parse_args(argv)
  parts, kinds = args.parts.split(","), args.kinds.split(",")
  for kind in kinds:
    if kind not in KINDS:
      p.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
  if args.rounds < 1 or args.steps < 1:
    p.error("--rounds and --steps must be >= 1")
  shape = tuple(int(v) for v in args.shape.split(",")) if args.shape else (
      (QUICK if on_gpu else TINY) if args.quick else None)
  timer = Timer() if args.timer == "cupti" else PipelinedTimer()
  device = jax.devices()[0].device_kind
  print(f"device: {device}, jax {jax.__version__}; {args.rounds} rounds x {args.steps} steps, "
        f"timer {timer.name}", flush=True)
  rows = []
  if "steps" in parts:
    rows += steps_part(kinds, args.rounds, args.steps, timer, shape, args.all_variants)
  if "epilogue" in parts:
    sizes = ((256,) if args.quick else (2048, 4096, 8192)) if on_gpu else (64,)
    rows += epilogue_part(args.rounds, 2 * args.steps, timer, sizes)
  meta = dict(device=device, platform=jax.default_backend(), jax=jax.__version__,
              timer=timer.name, rounds=args.rounds, steps=args.steps, argv=argv)
  text = markdown(meta, rows)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mlp.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (args.out / "mlp.md").write_text(text)
    plot(rows, meta, args.out / "mlp.png")
  print(text, flush=True)
  return 0 if all(r.get("ok", True) for r in rows) else 1
