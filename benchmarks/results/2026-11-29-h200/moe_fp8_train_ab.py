"""A/B: moe_mlp(precision="fp8") forward+backward, weights quantized as stored (new) vs
transposed in bf16 first (old), beside the bf16 layer; benchmarks.moe's timer and rounds."""
import functools, importlib.util, json, os, sys
import jax
from benchmarks import moe as bm
from benchmarks.timing import PipelinedTimer
import pallas_gemm
from pallas_gemm.moe import fp8 as fp8mod

spec = importlib.util.spec_from_file_location("old_moe_fp8", "build/ab/old_moe_fp8.py")
old = importlib.util.module_from_spec(spec); sys.modules[spec.name] = old; spec.loader.exec_module(old)

def old_layer(*a):
  saved = fp8mod.TRAIN
  fp8mod.TRAIN = old.TRAIN
  try:
    return pallas_gemm.moe_mlp(*a, precision="fp8", backend="auto")
  finally:
    fp8mod.TRAIN = saved

fns = {"moe_mlp": functools.partial(pallas_gemm.moe_mlp, backend="auto"),
       "moe_mlp/fp8-train": functools.partial(pallas_gemm.moe_mlp, backend="auto",
                                              precision="fp8"),
       "fp8-train/old": old_layer}
configs = os.environ.get("AB_CONFIGS", "mixtral,deepseek-v3").split(",")
res = {}
for name in configs:
  cfg = bm.CONFIGS[name] if name != "tiny" else bm.Config("tiny", 64, 128, 128, 8, 2)
  row = bm.run_config(cfg, "fwd+bwd", fns, PipelinedTimer(), rounds=int(os.environ.get("AB_ROUNDS", 5)),
                      calls=int(os.environ.get("AB_CALLS", 3)),
                      kernels=os.environ.get("AB_KERNELS") == "1")
  res[name] = row
  b = row["moe_mlp"]
  for v in fns:
    r = row[v]
    if r["status"] != "ok":
      print(name, v, r); continue
    sp = r.get("moe_mlp_speedup", {})
    print(f"{name:12s} {v:20s} {r['ms']:8.2f} ms  bf16/this {1/sp['median'] if sp else 1:.3f}"
          f" (+-{sp.get('spread', 0):.3f})  temp {r['temp_bytes']/2**30 if r['temp_bytes'] else 0:.1f} GiB")
  import statistics
  n, o = row["moe_mlp/fp8-train"], row["fp8-train/old"]
  if n["status"] == o["status"] == "ok":
    rr = sorted(a / b for a, b in zip(o["rounds_ms"], n["rounds_ms"]))
    print(f"{name}: new over old {statistics.median(rr):.3f}x ({rr[0]:.3f}-{rr[-1]:.3f})")
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/moe_fp8_train_ab.json", "w"), default=str)
