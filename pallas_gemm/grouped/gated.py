"""The first grouped GEMM of a gated MLP (SwiGLU / GeGLU experts) with its activation.

    a, h = gated_ragged_dot(lhs, rhs, group_sizes, activation="silu", write_h=True)

rhs (G, K, 2F) holds each group's [gate | up]; per group g, h = lhs[rows of g] @ rhs[g]
(M, 2F) and a = act(h[:, :F]) * h[:, F:] (M, F), both in lhs's dtype; rows in no group are
zeros (as `ragged_dot`'s). h is returned only with write_h (a backward pass needs it).

- "mosaic" (Hopper): one kernel (`mosaic_forward.gated_forward`). Each tile multiplies its
  lhs rows by the gate's and the up's columns into two accumulators and computes a from
  them in the epilogue: a never takes a separate pass over h, and h is written only when
  asked. a is computed from the f32 products, so it is more accurate than the XLA path's
  rounding of h first. F must be a multiple of 64.
- "xla": `ragged_dot` and one elementwise pass over h (a from h rounded to lhs's dtype).
- "auto": mosaic where `ragged_dot` would run its kernels and F allows, else xla.

A building block of `moe_mlp`, which differentiates around it (its own `custom_vjp`): it
has no differentiation rules of its own. Under jit with sharded operands the kernel runs
per shard (`partitioned`): rows split with no communication, the groups (experts) with
one all-reduce of the results' disjoint rows; K and 2F stay whole (a is not linear in
partial sums of h, and a gate column needs its up column on the same device).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_gemm.core import epilogue, primitive, sharding
from pallas_gemm.core.checks import dtype_of
from pallas_gemm.grouped import api
from pallas_gemm.mgpu import hw



def gated_mosaic_reason(lhs_dtype, rhs_shape, precision) -> str | None:
  """None when the gated kernel can compute this call here, else why not."""
  reason = api.mosaic_reason(lhs_dtype, lhs_dtype, precision, np.dtype(lhs_dtype))
  if reason is None and rhs_shape[-1] % 128:
    reason = (f"the gated kernel takes F a multiple of 64 (up's columns start on a TMA"
              f" tile); got rhs.shape={tuple(rhs_shape)}")
  return reason


def choose_backend(backend: str, lhs_dtype, rhs_shape, precision,
                   explicit_reason: str | None = None) -> str:
  """"xla" or "mosaic" for a call asking for `backend` (ValueError: "mosaic" asked where
  the kernel cannot compute the call). explicit_reason: `core.sharding.explicit_reason`
  of the operands (under Explicit mesh axes neither path runs: lax has no sharding rule
  for ragged_dot_general there, and a Pallas kernel takes no sharded operand)."""
  if backend not in api.BACKENDS:
    raise ValueError(f"backend must be one of {api.BACKENDS}; got {backend!r}")
  if backend == "xla":
    return "xla"
  reason = gated_mosaic_reason(lhs_dtype, rhs_shape, precision) or explicit_reason
  return api.pick_backend(backend, reason, "this gated call")


def gated_ragged_dot(lhs, rhs, group_sizes, *, activation: str = "silu",
                     write_h: bool = False, precision=None, backend: str = "auto",
                     config=None):
  """(a, h) of the module docstring; h is None unless write_h.

  lhs (M, K); rhs (G, K, 2F) of lhs's dtype; group_sizes (G,) integers (traced).
  precision: as `ragged_dot` takes it (the kernel: 16-bit products, f32 accumulation).
  config: the gated kernel's `grouped.config.Config` (two accumulators per warpgroup:
  None picks `default_config(..., gated=True)`); the xla path ignores it.
  """
  lhs_dtype, rhs_dtype = dtype_of(lhs, "lhs"), dtype_of(rhs, "rhs")
  if activation not in epilogue.GATES:
    raise ValueError(f"activation must be one of {epilogue.GATES}; got {activation!r}")
  if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1] or rhs.shape[2] % 2:
    raise ValueError(f"lhs must be (M, K) and rhs (G, K, 2F); got lhs.shape={lhs.shape},"
                     f" rhs.shape={rhs.shape}")
  if rhs_dtype != lhs_dtype:
    raise TypeError(f"rhs.dtype must be lhs's {lhs_dtype}; got {rhs_dtype}")
  api.check_group_sizes_type(group_sizes)
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(f"group_sizes must be (G,) = ({rhs.shape[0]},) for rhs.shape={rhs.shape};"
                     f" got group_sizes.shape={group_sizes.shape}")
  api.check_concrete_sizes(group_sizes)
  chosen = choose_backend(backend, lhs_dtype, rhs.shape, precision,
                          sharding.explicit_reason(lhs, rhs))
  if chosen == "xla":
    h = api.ragged_dot(lhs, rhs, group_sizes, precision, lhs_dtype, backend="xla")
    return epilogue.gated(h, activation), (h if write_h else None)
  from pallas_gemm.grouped import mosaic_forward  # noqa: PLC0415 (a GPU-only import chain)
  interpret = not hw.on_gpu()

  def local(lhs, rhs, sizes, offset):
    with primitive.kernel_x64(chosen):
      a, h = mosaic_forward.gated_forward(lhs, rhs, sizes, offset, activation=activation,
                                          write_h=write_h, config=config,
                                          interpret=interpret)
    return (a, h) if write_h else (a,)

  # A negative size (only possible traced) counts as 0, as in `ragged_dot`'s kernels: in
  # every layout, since the row windows of `partitioned` clamp them so too.
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  if sharding.unpartitioned(interpret):
    outs = local(lhs, rhs, sizes, None)
  else:
    outs = partitioned(local, lhs, rhs, sizes, outputs=2 if write_h else 1)
  return outs[0], (outs[1] if write_h else None)


def partitioned(local, lhs, rhs, group_sizes, *, outputs: int):
  """local(lhs, rhs, group_sizes >= 0, group_offset) -> `outputs` arrays of lhs's rows, run
  per shard under jit shardings (`core.sharding.partitioned`): M splits with no
  communication (each device's rows, the groups cut to its row window); G, rhs's groups,
  splits with group_offset (each device its groups' rows, zeros elsewhere) and one
  all-reduce that adds those disjoint rows; K, rhs's columns and group_sizes stay whole."""
  m, g = lhs.shape[0], rhs.shape[0]
  labels = ((("m", 1), None), (("g", 1), None, None), (None,))

  def shard(lhs, rhs, sizes, *, partial, start):
    if lhs.shape[0] != m:  # this device's rows: the groups cut to them
      sizes, _ = sharding.group_window(sizes, None, start("m"), lhs.shape[0])
    offset = start("g") if rhs.shape[0] != g else None
    # With the groups split, each device's rows of other groups are zeros: the sum of
    # the devices' results, in their own dtype, is exact.
    del partial
    return local(lhs, rhs, sizes, offset)

  call = sharding.partitioned(
      shard, [lhs.shape, rhs.shape, group_sizes.shape], labels,
      ((("m", 1), None),) * outputs, reduce=("g",), out_dtypes=(lhs.dtype,) * outputs)
  return call(lhs, rhs, group_sizes)
