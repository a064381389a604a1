"""moe_mlp fp8 with the grouped fp8 kernel's default tiles vs 128x192 ones (patched
mosaic_ragged.default_config; each program compiled under its own default), beside bf16
moe_mlp; PipelinedTimer, rotated rounds. Args: configs modes stages,epi"""
import sys, json, dataclasses, jax, jax.numpy as jnp
from benchmarks import moe as bm
from benchmarks.timing import PipelinedTimer, rounds_ms, ratio_stats
from pallas_gemm.fp8 import mosaic_ragged as mr
from pallas_gemm.fp8.config import Config
from pallas_gemm.moe import moe_mlp
configs, modes = sys.argv[1].split(","), sys.argv[2].split(",")
stages, epi = map(int, sys.argv[3].split(","))
orig = mr.default_config
def wide(m, g, out_dtype):
  c = orig(m, g, out_dtype)
  return c if c.block_m == 64 else Config(block_m=128, block_n=192, stages=stages, epi_block_n=min(epi, c.epi_block_n))
fns, _ = bm.variants(True, ["moe_mlp", "moe_mlp/fp8", "moe_mlp/fp8-train-cached"])
rows = []
for name in configs:
  cfg = bm.CONFIGS[name]
  for mode in modes:
    fp8 = "moe_mlp/fp8" if mode == "fwd" else "moe_mlp/fp8-train-cached"
    base = bm.operands(cfg, mode, False)
    a8 = jax.block_until_ready(jax.jit(bm.PREPARE[fp8])(*base))
    progs, args = {}, {}
    progs["bf16"] = bm._program(fns["moe_mlp"], mode).lower(*base).compile(); args["bf16"] = base
    progs["fp8@128"] = bm._program(fns[fp8], mode).lower(*a8).compile(); args["fp8@128"] = a8
    jax.clear_caches(); mr.default_config = wide
    progs["fp8@192"] = bm._program(fns[fp8], mode).lower(*a8).compile(); args["fp8@192"] = a8
    jax.clear_caches(); mr.default_config = orig
    o128 = jax.block_until_ready(progs["fp8@128"](*a8)); o192 = jax.block_until_ready(progs["fp8@192"](*a8))
    same = all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(o128), jax.tree.leaves(o192)))
    del o128, o192
    calls = 1 if mode == "fwd+bwd" and cfg.weight_bytes() > 4 << 30 else 5
    t = rounds_ms(PipelinedTimer(), {n: (lambda p=p, a=args[n]: p(*a)) for n, p in progs.items()}, [()], 7, calls)
    med = {n: sorted(v)[3] for n, v in t.items()}
    r = {n: ratio_stats(t["bf16"], t[n]) for n in ("fp8@128", "fp8@192")}
    r2 = ratio_stats(t["fp8@128"], t["fp8@192"])
    print(f"{name} {mode}: " + ", ".join(f"{n} {m:.3f} ms" for n, m in med.items())
          + "; x bf16 " + ", ".join(f"{n} {x.median:.3f}±{x.spread:.3f}" for n, x in r.items())
          + f"; 192 over 128 {r2.median:.3f}±{r2.spread:.3f}; same {same}", flush=True)
    rows.append(dict(config=name, mode=mode, ms=med, rounds_ms=t, same=same, tiles=f"128x192/{stages}/epi{epi}",
                     x_bf16={n: [x.median, x.spread] for n, x in r.items()}, wide_over_default=[r2.median, r2.spread]))
    del progs, args, a8, base
print(json.dumps(rows))
