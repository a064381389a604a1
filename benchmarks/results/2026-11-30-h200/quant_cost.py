"""The cost of quantize_experts_for_training (what an optimizer step pays once for every
microbatch) at the MoE configs' sizes: wall clock of pipelined calls, 7 rounds."""
import json, math, sys
import jax, jax.numpy as jnp
from benchmarks.timing import PipelinedTimer, rounds_ms
from benchmarks.moe import CONFIGS
from pallas_gemm.moe import quantize_experts_for_training
out = {}
for name in sys.argv[1].split(","):
  c = CONFIGS[name]
  k = jax.random.split(jax.random.key(0), 2)
  wgu = (jax.random.normal(k[0], (c.experts, c.d_model, 2 * c.d_ff), jnp.float32) / 64).astype(jnp.bfloat16)
  wd = (jax.random.normal(k[1], (c.experts, c.d_ff, c.d_model), jnp.float32) / 64).astype(jnp.bfloat16)
  f = jax.jit(quantize_experts_for_training)
  t = rounds_ms(PipelinedTimer(), {"q": lambda: f(wgu, wd)}, [()], 7, 3)["q"]
  gb = (wgu.size + wd.size) * 2 / 1e9
  ms = sorted(t)[3]
  out[name] = dict(ms=ms, rounds_ms=t, bf16_gb=gb, read_plus_write_tb_s=gb * 2 / ms)
  print(f"{name}: quantize_experts_for_training {ms:.2f} ms (rounds {min(t):.2f}-{max(t):.2f})"
        f" for {gb:.1f} GB of bf16 weights: {gb*2/ms:.2f} TB/s read + 2 fp8 copies written", flush=True)
  del wgu, wd
print(json.dumps(out))
