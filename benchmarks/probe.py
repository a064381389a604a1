"""Focused GPU probes behind the numbers in benchmarks/results (device-side CUPTI timing).

  python3 benchmarks/probe.py cuda [N]     every compiled cuda config x transpose case at N^3,
                                           the seeds' textbook kernel, jnp.dot HIGHEST
  python3 benchmarks/probe.py ragged [N]   where the time of a ragged (N+1)^3 bf16 mosaic GEMM
                                           goes: the padding copies vs the kernel
"""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import cuda, gemm, tuning
from pallas_gemm.reference import relative_error

HIGHEST = jax.lax.Precision.HIGHEST


def _inputs(shape_a, shape_b, dtype):
  set_bytes = np.dtype(dtype).itemsize * (math.prod(shape_a) + math.prod(shape_b))
  return tuning.random_inputs(shape_a, shape_b, dtype, tuning.input_set_count(set_bytes))


def _ms(fn, inputs):
  return float(np.median(tuning.time_gpu_ms(jax.jit(fn), inputs, iterations=20)))


def probe_cuda(n: int = 4096):
  inputs = _inputs((n, n), (n, n), jnp.float32)
  ref = jnp.dot(*inputs[0], precision=HIGHEST)
  tflops = lambda ms: 2 * n**3 / (ms * 1e-3) / 1e12
  base = tflops(_ms(lambda a, b: jnp.dot(a, b, precision=HIGHEST), inputs))
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {n}^3 f32: "
        f"jnp.dot HIGHEST {base:.1f} TFLOP/s")
  for fields in cuda.compiled_configs():
    config = cuda.Config(**dict(zip(cuda._CONFIG_FIELDS, fields)))
    for ta, tb in ((False, False), (True, False), (False, True), (True, True)):
      if config.is_textbook and (ta or tb):
        continue
      fn = lambda a, b: gemm(a, b, transpose_a=ta, transpose_b=tb, backend="cuda", config=config)
      a0, b0 = inputs[0]
      err = relative_error(fn(a0.T if ta else a0, b0.T if tb else b0), ref)
      t = tflops(_ms(fn, inputs))
      print(f"  {fields} ta={ta:d} tb={tb:d}: {t:6.1f} TFLOP/s  {t / base:.3f}x jnp.dot  "
            f"{t / 67.0:5.1%} of FP32 peak  relerr {err:.1e}", flush=True)


def probe_ragged(n: int = 4096):
  r = n + 1
  inputs = _inputs((r, r), (r, r), jnp.bfloat16)
  padded = _inputs((r + 7, r + 63), (r + 63, r + 63), jnp.bfloat16)
  aligned = _inputs((n + 64, n + 64), (n + 64, n + 64), jnp.bfloat16)
  rows = [
      (f"gemm mosaic {r}^3", lambda a, b: gemm(a, b, backend="mosaic"), inputs),
      (f"jnp.dot {r}^3", jnp.dot, inputs),
      ("pad A and B", lambda a, b: (jnp.pad(a, ((0, 7), (0, 63))), jnp.pad(b, ((0, 63), (0, 63)))), inputs),
      ("slice the output", lambda a, b: a[:r, :r] * 1, padded),
      (f"gemm mosaic {r + 7}x{r + 63}x{r + 63} (no padding)", lambda a, b: gemm(a, b, backend="mosaic"), padded),
      (f"gemm mosaic {n + 64}^3 aligned", lambda a, b: gemm(a, b, backend="mosaic"), aligned),
  ]
  for name, fn, args in rows:
    print(f"  {name:45s} {_ms(fn, args):.4f} ms", flush=True)


if __name__ == "__main__":
  what, *rest = sys.argv[1:] or ["cuda"]
  {"cuda": probe_cuda, "ragged": probe_ragged}[what](*(int(x) for x in rest))
