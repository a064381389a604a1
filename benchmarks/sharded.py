"""gemm vs jnp.dot under jax.jit with NamedSharding inputs over all local devices.

    python -m benchmarks --sharded [--quick] [--out DIR]

For each case (dtype, shape, backend) and layout (a sharded on M; b on N; a batch of one
GEMM per device sharded on the batch; both on K), it times jnp.dot and gemm with the same inputs,
the same backend on one device, and lists the collectives in each compiled HLO. With K
split over two devices, mosaic is timed twice: with its pair kernels (the default) and
with NCCL's collectives ("mosaic/nccl", `op.PAIR_KERNELS = False`). Timing is wall clock
over back-to-back jitted calls (collectives included; CUPTI would time one device's
kernels only), median of `REPS` runs of `CALLS` calls, the variants of a layout timed in
turns (`timing.interleaved_ms`: a drifting clock reaches all alike). On one device it
says so and exits 0. --quick runs small shapes (what CI and a CPU can do in seconds).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_gemm
from pallas_gemm.matmul import op
from pallas_gemm.testing.reference import relative_error, tolerance
from benchmarks.timing import interleaved_ms

HIGHEST = jax.lax.Precision.HIGHEST
COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")
CALLS, REPS = 10, 5
# (label, dtype, precision, (m, n, k), backends besides jnp.dot). 16388 = 4 x 4097: the
# misaligned case (row strides of 16388 bf16, and of each device's 4097 or 8194 rows or
# columns, are not 16-byte multiples) that 2 and 4 devices divide (jax places no uneven
# shardings on jit inputs).
CASES = [
    ("bf16 16384^3", jnp.bfloat16, None, (16384, 16384, 16384), ("auto", "mosaic")),
    ("f32-highest 8192^3", jnp.float32, HIGHEST, (8192, 8192, 8192), ("auto", "cuda")),
    ("bf16 16388^3 (misaligned)", jnp.bfloat16, None, (16388, 16388, 16388), ("auto",)),
]
QUICK = [("f32-highest 256^3", jnp.float32, HIGHEST, (256, 256, 256), ("auto",))]
LAYOUTS = ("M", "N", "batch", "K")


def _inputs(layout, dtype, m, n, k, mesh, seed=0):
  """Operands and their shardings; 'batch' is one GEMM of M/devices rows per device
  (the same FLOPs)."""
  ka, kb = jax.random.split(jax.random.key(seed))
  g = mesh.size
  shape_a, shape_b = ((g, m // g, k), (g, k, n)) if layout == "batch" else ((m, k), (k, n))
  spec_a, spec_b = {"M": (P("d"), P()), "N": (P(), P(None, "d")), "batch": (P("d"), P("d")),
                    "K": (P(None, "d"), P("d")), "one": (None, None)}[layout]

  def make(key, shape, spec):
    sharding = NamedSharding(mesh if spec is not None else _one_device_mesh(), spec or P())
    return jax.jit(lambda: jax.random.normal(key, shape, dtype), out_shardings=sharding)()

  return make(ka, shape_a, spec_a), make(kb, shape_b, spec_b)


def _one_device_mesh():
  return jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])


def _collectives(f, a, b) -> str:
  compiled = f if isinstance(f, jax.stages.Compiled) else f.lower(a, b).compile()
  found = COLLECTIVES.findall(compiled.as_text())
  return ", ".join(f"{found.count(c)} {c}" for c in sorted(set(found))) or "none"


def run(cases, out_dir: pathlib.Path | None, layouts=LAYOUTS, num_devices=None) -> list[dict]:
  devices = jax.devices()[:num_devices]
  print(f"device: {devices[0].device_kind} x {len(devices)}, jax {jax.__version__}", flush=True)
  if len(devices) < 2:
    print(f"--sharded needs >= 2 devices; this process has {len(devices)}: nothing to measure")
    return []
  mesh = jax.make_mesh((len(devices),), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices)
  rows = []
  header = (f"{'case':28s} {'layout':6s} {'backend':11s} {'TFLOP/s':>8s} {'x 1 dev':>8s} "
            f"{'x dot':>6s} {'err':>8s}  collectives")
  print(header, flush=True)
  for label, dtype, precision, (m, n, k), backends in cases:
    flops = 2.0 * m * n * k
    fns = {"jnp.dot": jax.jit(lambda a, b, p=precision: jnp.matmul(a, b, precision=p))}
    for name in backends:
      fns[name] = jax.jit(lambda a, b, p=precision, name=name: pallas_gemm.gemm(
          a, b, precision=p, backend=name))
    a1, b1 = _inputs("one", dtype, m, n, k, mesh)
    single = interleaved_ms(fns, a1, b1, calls=CALLS, reps=REPS)
    ref = fns["jnp.dot"](a1, b1)
    del a1, b1
    for layout in layouts:
      split = {"M": m, "N": n, "batch": m, "K": k}[layout]
      if split % len(devices):
        print(f"{label:28s} {layout:6s} left out: {split} does not split over"
              f" {len(devices)} devices (jit places no uneven shardings on inputs)", flush=True)
        continue
      a, b = _inputs(layout, dtype, m, n, k, mesh)
      dot_ms = None
      variants = dict(fns)
      if layout == "K" and "mosaic" in fns and len(devices) == 2:
        # The same call with NCCL's collectives in place of the pair kernels' exchange.
        op.PAIR_KERNELS = False
        try:
          variants["mosaic/nccl"] = jax.jit(lambda a, b, p=precision: pallas_gemm.gemm(
              a, b, precision=p, backend="mosaic")).lower(a, b).compile()
        finally:
          op.PAIR_KERNELS = True
      timed = interleaved_ms(variants, a, b, calls=CALLS, reps=REPS)
      for name, f in variants.items():
        ms = timed[name]
        dot_ms = dot_ms or ms
        out = f(a, b)
        # Against jnp.dot in the same layout (the float64 reference of a 16384^3 product
        # would dominate the run): within the sum of both products' bounds.
        ref_l = fns["jnp.dot"](a, b)
        err = relative_error(out.astype(jnp.float32), ref_l.astype(jnp.float32))
        one = single[name.split("/")[0]]
        row = dict(case=label, layout=layout, backend=name, ms=ms, tflops=flops / ms / 1e9,
                   vs_one_device=one / ms, vs_dot=dot_ms / ms, rel_err_vs_dot=err,
                   err_ok=err <= 2 * tolerance(dtype, precision, k), collectives=_collectives(f, a, b),
                   out_sharding=str(out.sharding.spec), one_device_ms=one)
        rows.append(row)
        print(f"{label:28s} {layout:6s} {name:11s} {row['tflops']:8.1f} {row['vs_one_device']:8.2f} "
              f"{row['vs_dot']:6.3f} {err:8.1e}{'' if row['err_ok'] else '!'}  {row['collectives']}",
              flush=True)
        del out, ref_l
      del a, b
    del ref
  if out_dir is not None:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(device=devices[0].device_kind, devices=len(devices), jax=jax.__version__,
                timer=f"wall clock, median of {REPS} x {CALLS} pipelined calls, in turns")
    (out_dir / "sharded.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks --sharded")
  p.add_argument("--quick", action="store_true", help="small shapes only")
  p.add_argument("--out", type=pathlib.Path)
  p.add_argument("--cases", help="comma-separated substrings of case labels to run")
  p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of "
                 + ",".join(LAYOUTS))
  p.add_argument("--devices", type=int, default=None,
                 help="use the first N devices (default: all)")
  args = p.parse_args(argv)
  cases = QUICK if args.quick else CASES
  if args.cases:
    cases = [c for c in cases if any(t in c[0] for t in args.cases.split(","))]
  rows = run(cases, args.out, args.layouts.split(","), args.devices)
  return 1 if any(not r["err_ok"] for r in rows) else 0
