"""ragged_dot under jax.jit with shardings: the partitioning rule of
`pallas_gemm/grouped/ops.py`. Each layout's result equals the one-device call, keeps the
sharding the rule promises, and the compiled program moves no operand: splits of rows,
columns or output groups run with no collective; a split contraction (K, or the groups of
an expert-parallel rhs, or the rows of a weight gradient) with exactly one all-reduce of
the result.

On a CPU, conftest gives the process 8 host devices and the xla backend goes through the
same rule as the kernels (the rule does not depend on the backend; only the local call
does). On a machine with >= 2 GPUs the mosaic kernels run in the same tests. Mosaic GPU's
interpreter is not partitioned (ordered io_callbacks), as for gemm.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import ON_GPU
from pallas_gemm.core import epilogue
from pallas_gemm.grouped import ragged_dot, ragged_dot_general

HIGHEST = jax.lax.Precision.HIGHEST
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|"
                        r"reduce-scatter)(-start)?\(")
WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _mesh():
  n = 8 if len(jax.devices()) >= 8 else 4
  if len(jax.devices()) < n:
    pytest.skip(f"needs 4 devices (an n/2 x 2 mesh); this process has {len(jax.devices())}")
  return jax.make_mesh((n // 2, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:n])


def _setup():
  """(backend, dtype, kwargs) of the kernel that runs partitioned here."""
  if ON_GPU:
    return "mosaic", jnp.bfloat16, {}
  return "xla", jnp.float32, dict(precision=HIGHEST)


def _operands(rng, dtype, m=64, k=32, n=16, g=8):
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal((g, k, n)), dtype)
  # Uneven groups, one empty, rows left over past the last group (they must stay zero).
  sizes = rng.multinomial(m - 5, np.ones(g) / g).astype(np.int32)
  sizes[4] += sizes[3]
  sizes[3] = 0
  return lhs, rhs, jnp.asarray(sizes)


def _collectives(f, *args) -> list[str]:
  return sorted(m.group(1) for m in COLLECTIVE.finditer(jax.jit(f).lower(*args)
                                                         .compile().as_text()))


def _put(mesh, x, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


def _close(got, want, dtype):
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=tol, atol=tol * 10)


# layout: (lhs spec, rhs spec, result spec, the collectives the program may have)
FORWARD = {
    "rows": (P("x"), P(), P("x"), []),
    "columns": (P(), P(None, None, "y"), P(None, "y"), []),
    "rows and columns": (P("x"), P(None, None, "y"), P("x", "y"), []),
    "experts": (P(), P("x"), P(), ["all-reduce"]),
    "rows and experts": (P("x"), P("y"), P("x"), ["all-reduce"]),
    "contraction": (P(None, "y"), P(None, "y"), P(), ["all-reduce"]),
}


@pytest.mark.parametrize("layout", FORWARD)
@pytest.mark.parametrize("offset", [None, 2])
def test_forward(rng, layout, offset):
  mesh = _mesh()
  backend, dtype, kw = _setup()
  lhs, rhs, sizes = _operands(rng, dtype)
  if offset is not None:
    rhs = rhs[:4]  # this call's 4 groups are global groups 2..5

  def f(a, b, s):
    return ragged_dot(a, b, s, backend=backend,
                      group_offset=None if offset is None else jnp.int32(offset), **kw)

  want = f(lhs, rhs, sizes)
  sl, sr, so, allowed = FORWARD[layout]
  a, b = _put(mesh, lhs, sl), _put(mesh, rhs, sr)
  got = jax.jit(f)(a, b, sizes)
  _close(got, want, dtype)
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, so), 2), got.sharding
  assert _collectives(f, a, b, sizes) == allowed


# layout: (lhs spec, rhs spec, wanted result spec or None, result spec, collectives)
WEIGHT_GRADS = {
    "rows": (P("x"), P("x"), None, P(), ["all-reduce"]),
    "k and n": (P(None, "x"), P(None, "y"), None, P(None, "x", "y"), []),
    "groups wanted": (P(), P(), P("x"), P("x"), []),
}


@pytest.mark.parametrize("layout", WEIGHT_GRADS)
def test_weight_gradient(rng, layout):
  # lax's ragged-contracting form: out (G, K, N) = per group lhs^T @ rhs.
  mesh = _mesh()
  backend, dtype, kw = _setup()
  lhs, _, sizes = _operands(rng, dtype)
  rhs = jnp.asarray(rng.standard_normal((64, 16)), dtype)

  def f(a, b, s):
    return ragged_dot_general(a, b, s, WEIGHT_GRAD, backend=backend, **kw)

  want = f(lhs, rhs, sizes)
  sl, sr, wanted, so, allowed = WEIGHT_GRADS[layout]
  a, b = _put(mesh, lhs, sl), _put(mesh, rhs, sr)
  g = f if wanted is None else (
      lambda a, b, s: jax.lax.with_sharding_constraint(f(a, b, s), NamedSharding(mesh, wanted)))
  got = jax.jit(g)(a, b, sizes)
  _close(got, want, dtype)
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, so), 3), got.sharding
  assert _collectives(g, a, b, sizes) == allowed


def test_gradients_of_an_expert_parallel_call(rng):
  # rhs split over experts: the forward all-reduces its disjoint rows; the backward's
  # dlhs likewise; drhs stays split on its groups when the weights' sharding asks it.
  mesh = _mesh()
  backend, dtype, kw = _setup()
  lhs, rhs, sizes = _operands(rng, dtype)
  ct = jnp.asarray(rng.standard_normal((64, 16)), dtype)
  spec = NamedSharding(mesh, P("x"))

  def loss(a, b):
    out = ragged_dot(a, b, sizes, backend=backend, **kw).astype(jnp.float32)
    return jnp.sum(out * ct.astype(jnp.float32))

  def grads(a, b):
    da, db = jax.grad(loss, argnums=(0, 1))(a, b)
    return da, jax.lax.with_sharding_constraint(db, spec)

  want = grads(lhs, rhs)
  a, b = lhs, _put(mesh, rhs, P("x"))
  got = jax.jit(grads)(a, b)
  for g, w in zip(got, want):
    _close(g, w, dtype)
  assert got[1].sharding.is_equivalent_to(spec, 3)
  assert "all-gather" not in _collectives(grads, a, b)


def test_forward_with_rhs_transposed(rng):
  # rhs (G, N, K): columns split on its dim 1, the contraction on its dim 2.
  mesh = _mesh()
  backend, dtype, kw = _setup()
  lhs, rhs, sizes = _operands(rng, dtype)
  rhs_t = jnp.swapaxes(rhs, 1, 2)
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[0])

  def f(a, b, s):
    return ragged_dot_general(a, b, s, dims, backend=backend, **kw)

  want = f(lhs, rhs_t, sizes)
  for sl, sr, so, allowed in ((P(), P(None, "y"), P(None, "y"), []),
                              (P(None, "y"), P(None, None, "y"), P(), ["all-reduce"])):
    a, b = _put(mesh, lhs, sl), _put(mesh, rhs_t, sr)
    got = jax.jit(f)(a, b, sizes)
    _close(got, want, dtype)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, so), 2), got.sharding
    assert _collectives(f, a, b, sizes) == allowed


# The gated form's rule (`grouped.gated.partitioned`): layout -> (lhs spec, rhs spec, the
# results' spec, the collectives the program may have). K, 2F and group_sizes stay whole.
GATED = {
    "rows": (P("x"), P(), P("x"), []),
    "experts": (P(), P("x"), P(), ["all-reduce"]),
    "rows and experts": (P("x"), P("y"), P("x"), ["all-reduce"]),
    "columns asked": (P(), P(None, None, "y"), P(), ["all-gather"]),  # 2F: gathered
}


@pytest.mark.parametrize("layout", GATED)
@pytest.mark.parametrize("write_h", [False, True])
def test_gated_forward(rng, layout, write_h):
  # The kernel runs interpreted on a CPU, which is not partitioned: the shards here run
  # the gated op's XLA form with the same local signature (group_offset included).
  from pallas_gemm.grouped import gated  # noqa: PLC0415
  mesh = _mesh()
  lhs, rhs, sizes = _operands(rng, jnp.float32, n=32)

  def local(a, b, s, offset):
    h = ragged_dot(a, b, s, precision=HIGHEST, backend="xla", group_offset=offset)
    return (epilogue.gated(h, "silu"), h) if write_h else (epilogue.gated(h, "silu"),)

  def f(a, b, s):
    return gated.partitioned(local, a, b, s, outputs=2 if write_h else 1)

  want = local(lhs, rhs, sizes, None)
  sl, sr, so, allowed = GATED[layout]
  a, b = _put(mesh, lhs, sl), _put(mesh, rhs, sr)
  got = jax.jit(f)(a, b, sizes)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    _close(g, w, jnp.float32)
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, so), 2), g.sharding
  # (with h too, XLA sends both results' partial rows in one all-reduce)
  assert _collectives(f, a, b, sizes) == allowed


def test_gated_kernel_lowers_partitioned_for_the_gpu(as_on_a_gpu):
  # On a GPU the gated kernel runs through the partitioned call: lowered here for CUDA as
  # the GPU would, under jit with sharded operands (one partitioned custom call).
  from pallas_gemm.grouped import gated  # noqa: PLC0415
  mesh = _mesh()
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
  w = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("y")))
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(mesh, P()))
  f = lambda x, w, s: gated.gated_ragged_dot(x, w, s, write_h=True, backend="mosaic")  # noqa: E731
  text = jax.jit(f).trace(x, w, sizes).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("CustomSPMDPartitioning") == 1


def test_gated_kernel_refuses_explicitly_sharded_operands(rng):
  # A Pallas kernel takes no operand sharded over Explicit mesh axes: named, not a
  # failure inside Pallas.
  from pallas_gemm.grouped import gated  # noqa: PLC0415
  n = min(len(jax.devices()), 4)
  if n < 2:
    pytest.skip(f"needs 2 devices; this process has {n}")
  mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:n])
  lhs, rhs, sizes = _operands(rng, jnp.bfloat16, n=128)
  lhs = _put(mesh, lhs, P("x"))
  with pytest.raises(ValueError, match="backend='mosaic'.*Explicit mesh axes"):
    gated.gated_ragged_dot(lhs, rhs, sizes, backend="mosaic")


@pytest.mark.parametrize("lhs_spec, rhs_spec", [(P("x"), P()), (P(None, "y"), P()),
                                                (P(), P("x")), (P("x"), P("x"))])
def test_gradients_under_explicit_axes(rng, lhs_spec, rhs_spec):
  # Operands typed with Explicit mesh axes (jit, no mesh in context): ragged_dot's result
  # is whole on every device, and each cotangent comes back typed as its primal.
  n = 8 if len(jax.devices()) >= 8 else 4
  if len(jax.devices()) < n:
    pytest.skip(f"needs 4 devices; this process has {len(jax.devices())}")
  mesh = jax.make_mesh((n // 2, 2), ("x", "y"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                       devices=jax.devices()[:n])
  lhs, rhs, sizes = _operands(rng, jnp.float32)
  ct = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)

  def loss(a, b):
    return jnp.sum(ragged_dot(a, b, sizes, precision=HIGHEST) * ct)

  grads = jax.grad(loss, argnums=(0, 1))
  a, b = _put(mesh, lhs, lhs_spec), _put(mesh, rhs, rhs_spec)
  got = jax.jit(grads)(a, b)
  for g, w, primal in zip(got, grads(lhs, rhs), (a, b)):
    assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec
    _close(g, w, jnp.float32)
