"""Named grouped-GEMM problems and group-size generators, shared by tests and benchmarks.

For a grouped GEMM the distribution of rows over groups is part of the problem: a
skewed one leaves most groups a few rows (ragged tiles) and one group most of the work.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SIZE_KINDS = ("uniform", "pareto", "zeros", "one", "ones", "partial")


@dataclasses.dataclass(frozen=True)
class Problem:
  """lhs (m, k) in g groups (sizes from `group_sizes(sizes, g, m)`), rhs (g, k, n)."""
  name: str
  g: int
  m: int
  k: int
  n: int
  sizes: str = "uniform"

  def flops(self) -> int:
    """2 * M * K * N: the forward's; forward + backward is three times this."""
    return 2 * self.m * self.k * self.n


PROBLEMS = {p.name: p for p in (
    Problem("mixtral", 8, 16384, 4096, 14336),
    Problem("deepseek", 32, 32768, 7168, 2048),
    Problem("qwen3_moe", 128, 65536, 2048, 768),
    Problem("skewed", 64, 32768, 4096, 1536, sizes="pareto"),
    Problem("decode", 8, 256, 4096, 14336),
)}


def group_sizes(kind: str, g: int, m: int, rng: np.random.Generator) -> np.ndarray:
  """int32 (g,) sizes of one of SIZE_KINDS:

  uniform: m rows, each to a group drawn uniformly (a multinomial: sizes near m / g);
  pareto: m rows drawn with Pareto(1.2) weights per group (a few large groups, many
    small or empty ones: the top-k router of a model early in training);
  zeros: uniform over a random half of the groups, the others empty;
  one: every row in one random group;
  ones: a size of 1 per group (g <= m), the rest of the rows in no group;
  partial: uniform over 3/4 of the rows, sum < m (rows past the sum are zeros).
  """
  if kind not in SIZE_KINDS:
    raise ValueError(f"kind must be one of {SIZE_KINDS}; got {kind!r}")
  if kind == "uniform":
    sizes = rng.multinomial(m, np.full(g, 1.0 / g))
  elif kind == "pareto":
    weights = rng.pareto(1.2, g) + 1e-3
    sizes = rng.multinomial(m, weights / weights.sum())
  elif kind == "zeros":
    chosen = rng.permutation(g)[:max(g // 2, 1)]
    sizes = np.zeros(g, np.int64)
    sizes[chosen] = rng.multinomial(m, np.full(len(chosen), 1.0 / len(chosen)))
  elif kind == "one":
    sizes = np.zeros(g, np.int64)
    sizes[rng.integers(g)] = m
  elif kind == "ones":
    if g > m:
      raise ValueError(f"sizes of 1 need g <= m; got g={g}, m={m}")
    sizes = np.ones(g, np.int64)
  else:
    sizes = rng.multinomial(m - m // 4, np.full(g, 1.0 / g))
  return sizes.astype(np.int32)
