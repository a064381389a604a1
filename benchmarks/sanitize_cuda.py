"""Small and ragged `backend="cuda"` GEMMs for compute-sanitizer (memcheck, racecheck).

Run as: compute-sanitizer --tool memcheck python3 benchmarks/sanitize_cuda.py
Exits non-zero if any result is wrong, so a clean sanitizer run also means a correct one.
"""

import sys

import jax
import numpy as np

from pallas_gemm.matmul import cuda
from pallas_gemm import gemm
from pallas_gemm.testing.reference import reference, relative_error, tolerance

# Edges in every direction, misaligned leading dims (odd N/K), transposes, batch, beta;
# then stream-K (tiles cut among blocks, summed through the scratch buffer), 2 batch entries
# each: 8 tiles of 128x128 cut 16 ways over 128 blocks, and 8 ragged tiles over 94 blocks.
# (initcheck would flag the finishers' reads of the edge elements no piece publishes: they
# are summed and never written, see cuda_sgemm.cu.)
CASES = [(1, 1, 1, None), (7, 129, 33, None), (129, 7, 65, None), (257, 130, 9, None),
         (64, 64, 64, None), (300, 520, 17, None),
         (256, 256, 4096, cuda.CONFIGS[1]), (200, 136, 3001, cuda.CONFIGS[1])]


def main():
  rng = np.random.default_rng(0)
  worst = 0.0
  for m, n, k, config in CASES:
    for ta, tb in ((False, False), (True, False), (False, True), (True, True)):
      a = rng.standard_normal((2,) + ((k, m) if ta else (m, k)), dtype=np.float32)
      b = rng.standard_normal((2,) + ((n, k) if tb else (k, n)), dtype=np.float32)
      c = rng.standard_normal((2, m, n), dtype=np.float32)
      out = gemm(a, b, c, alpha=0.5, beta=-1.5, transpose_a=ta, transpose_b=tb, backend="cuda",
                 config=config)
      err = relative_error(out, reference(a, b, c, alpha=0.5, beta=-1.5, transpose_a=ta,
                                          transpose_b=tb))
      worst = max(worst, err)
      if not err <= tolerance(np.float32, jax.lax.Precision.HIGHEST, k):
        print(f"WRONG {m}x{n}x{k} ta={ta} tb={tb}: relative error {err:.3g}")
        return 1
  print(f"{len(CASES) * 4} cases correct, worst relative error {worst:.3g}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
