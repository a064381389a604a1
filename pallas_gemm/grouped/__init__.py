"""Grouped GEMM with `jax.lax.ragged_dot`'s semantics (Mixture-of-Experts layers).

    out = pallas_gemm.ragged_dot(lhs, rhs, group_sizes)    # (M, K) x (G, K, N) -> (M, N)

`api.py` is the front door (validation, backend choice, group_offset), `ops.py` the
primitive and its AD/vmap rules, `xla.py` the lax reference path, `mosaic_*.py` the
Hopper kernels, `gated.py` a gated MLP's first GEMM with its activation
(`gated_ragged_dot`); the named problem sizes shared by tests and benchmarks are
`pallas_gemm.testing.grouped_shapes`.
"""

from pallas_gemm.grouped.api import BACKENDS, ragged_dot, ragged_dot_general
from pallas_gemm.grouped.gated import gated_mosaic_reason, gated_ragged_dot

__all__ = ["BACKENDS", "gated_mosaic_reason", "gated_ragged_dot", "ragged_dot",
           "ragged_dot_general"]
