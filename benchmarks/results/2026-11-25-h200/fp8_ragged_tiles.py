"""scaled_ragged_dot's tiles and its dense ceilings on the MoE problems, one process,
rounds in rotated order (CUPTI), x the bf16 grouped kernel of the same call.

    PYTHONPATH=. python benchmarks/results/2026-11-25-h200/fp8_ragged_tiles.py PROBLEMS ROUNDS

Beside the grouped kernels: bf16 jnp.dot and the block-scaled fp8 scaled_matmul of the same
M, N, K (every row against one expert's weight): what each grouped kernel would reach
without groups.
"""
import sys, statistics
import jax, jax.numpy as jnp, numpy as np
import pallas_gemm
from benchmarks.timing import Timer, ratio_stats, rounds_ms
from benchmarks.fp8_ragged import inputs
from pallas_gemm.grouped import shapes
from pallas_gemm.fp8 import ragged_mosaic as rm
print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
specs = {"128x128s5": {}, "128x128s5w4": dict(grid_tile_width=4), "128x128s5w16": dict(grid_tile_width=16), "128x128s4": dict(stages=4), "128x128s5gm": dict(grid_minor_dim="m")}
timer = Timer()
for name in sys.argv[1].split(","):
  p = shapes.PROBLEMS[name]
  sets = [inputs(p, s) for s in (1, 2)]
  for d in sets:  # the dense fp8 GEMM of the same FLOPs: all rows against group 0's weight
    d["w0"], d["sw0"] = d["w8"][:1], d["sw"][:1]
  fns = {"bf16 kernel": (jax.jit(lambda x, w, s: pallas_gemm.ragged_dot(x, w, s)), ("x", "w", "sizes")),
         "dense bf16 jnp.dot (M,K)x(K,N)": (jax.jit(lambda x, w: x @ w[0]), ("x", "w")),
         "dense fp8 scaled_matmul same M,N,K": (jax.jit(lambda a, b, sa, sb: pallas_gemm.scaled_matmul(a[None], b, sa[None], sb, jnp.bfloat16)), ("x8", "w0", "sx", "sw0"))}
  for spec, kw in specs.items():
    c = rm.default_config(jnp.bfloat16).replace(**kw)
    fns[spec] = (jax.jit(lambda a, b, s, sa, sb, c=c: pallas_gemm.scaled_ragged_dot(a, b, s, sa, sb, jnp.bfloat16, config=c)), ("x8", "w8", "sizes", "sx", "sw"))
  calls = {nm: (lambda i, f=f, names=names: f(*(sets[i][x] for x in names))) for nm, (f, names) in fns.items()}
  t = rounds_ms(timer, calls, [(0,), (1,)], int(sys.argv[2]), 10)
  for nm in fns:
    r = ratio_stats(t["bf16 kernel"], t[nm]); ms = statistics.median(t[nm])
    print(f"| {name} | {nm} | {ms:.3f} | {r.median:.3f} +- {r.spread:.3f} |", flush=True)
