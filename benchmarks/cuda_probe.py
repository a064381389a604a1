"""The CUDA SGEMM in detail (GPU only): every compiled config x transpose case at one size,
the seeds' textbook kernel, and jnp.dot HIGHEST from the same run. Device-side CUPTI timing.

  python3 benchmarks/cuda_probe.py [N]        (default 4096)
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import cuda, gemm, tuning
from pallas_gemm.reference import relative_error

HIGHEST = jax.lax.Precision.HIGHEST


def main(n: int = 4096):
  flops = 2 * n**3
  sets = tuning.input_set_count(2 * 4 * n * n)
  inputs = [tuple(jax.random.normal(jax.random.key(i), (2, n, n), jnp.float32)) for i in range(sets)]
  ref = jnp.dot(*inputs[0], precision=HIGHEST)

  def tflops(fn):
    times = tuning.time_gpu_ms(jax.jit(fn), inputs, iterations=20)
    return flops / (np.median(times) * 1e-3) / 1e12

  base = tflops(lambda a, b: jnp.dot(a, b, precision=HIGHEST))
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {n}^3 f32: "
        f"jnp.dot HIGHEST {base:.1f} TFLOP/s")
  configs = [cuda.Config(**dict(zip(cuda._CONFIG_FIELDS, c))) for c in cuda.compiled_configs()]
  for config in configs:
    for ta, tb in ((False, False), (True, False), (False, True), (True, True)):
      if config.is_textbook() and (ta or tb):
        continue
      fn = lambda a, b: gemm(a, b, transpose_a=ta, transpose_b=tb, backend="cuda", config=config)
      a0, b0 = inputs[0]
      err = relative_error(fn(a0.T if ta else a0, b0.T if tb else b0), ref)
      t = tflops(fn)
      print(f"  {config.astuple()} ta={ta:d} tb={tb:d}: {t:6.1f} TFLOP/s  {t / base:.3f}x "
            f"jnp.dot  {t / 67.0:5.1%} of FP32 peak  relerr {err:.1e}", flush=True)


if __name__ == "__main__":
  main(*(int(x) for x in sys.argv[1:]))
