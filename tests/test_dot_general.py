"""`pallas_gemm.dot_general` (pallas_gemm/matmul/lax_dot.py) against `jax.lax.dot_general`.

A generated grid of dimension numbers (batch and contracting dims anywhere, several
contracting dims, pairs listed in any order) runs on the "xla" backend, which is cheap on a
CPU; a few tiny cases run each Pallas backend (interpret mode here). Results are compared
with a float64 einsum built from the dimension numbers, independent of the module's layout
code; `FALLBACKS` shows whether gemm or lax.dot_general ran.
"""

import functools
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random, skip_reason
from pallas_gemm.matmul import auto
from pallas_gemm.testing.reference import relative_error, tolerance

from pallas_gemm.matmul import lax_dot as dg

HIGHEST = jax.lax.Precision.HIGHEST
BF16 = jnp.bfloat16
# The kernel backends (Pallas ones in interpret mode on a CPU): a few tiny cases each.
PALLAS = [name for name in auto.BACKENDS if name != "xla"]


def _grid(count, seed=0):
  """`count` (lhs shape, rhs shape, dimension numbers) with ranks 2-4, from a fixed seed."""
  rs = np.random.RandomState(seed)
  cases = []
  while len(cases) < count:
    n_batch, n_contract = rs.randint(0, 3), rs.randint(1, 4)
    lhs_rank = n_batch + n_contract + rs.randint(0, 3)
    rhs_rank = n_batch + n_contract + rs.randint(0, 3)
    if not (2 <= lhs_rank <= 4 and 2 <= rhs_rank <= 4):
      continue
    lhs_dims, rhs_dims = rs.permutation(lhs_rank), rs.permutation(rhs_rank)
    pairs = rs.permutation(n_batch + n_contract)  # the order the pairs are listed in
    batch = [(int(lhs_dims[i]), int(rhs_dims[i])) for i in pairs if i < n_batch]
    contract = [(int(lhs_dims[i]), int(rhs_dims[i])) for i in pairs if i >= n_batch]
    sizes = rs.randint(1, 6, size=n_batch + n_contract)
    lhs_shape = [int(s) for s in rs.randint(1, 7, size=lhs_rank)]
    rhs_shape = [int(s) for s in rs.randint(1, 7, size=rhs_rank)]
    for i in range(n_batch + n_contract):  # paired dims have equal sizes
      lhs_shape[lhs_dims[i]] = rhs_shape[rhs_dims[i]] = int(sizes[i])
    dims = ((tuple(l for l, _ in contract), tuple(r for _, r in contract)),
            (tuple(l for l, _ in batch), tuple(r for _, r in batch)))
    cases.append((tuple(lhs_shape), tuple(rhs_shape), dims))
  return cases


GRID = _grid(16)
# Named layouts: the plain, transposed and several-dim forms Flax and einsum produce.
NAMED = {
    "matmul": ((5, 7), (7, 3), (((1,), (0,)), ((), ()))),
    "a^T b": ((7, 5), (7, 3), (((0,), (0,)), ((), ()))),
    "a b^T": ((5, 7), (3, 7), (((1,), (1,)), ((), ()))),
    "dense-3d": ((2, 4, 6), (6, 5), (((2,), (0,)), ((), ()))),
    "dense-general": ((2, 3, 4, 5), (4, 5, 6), (((2, 3), (0, 1)), ((), ()))),
    "batch-last": ((4, 6, 3), (6, 5, 3), (((1,), (0,)), ((2,), (2,)))),
    "matvec": ((5, 7), (7,), (((1,), (0,)), ((), ()))),
    "zero-size": ((0, 4), (4, 3), (((1,), (0,)), ((), ()))),
    "zero-k": ((2, 0), (0, 3), (((1,), (0,)), ((), ()))),
}
BATCHED = ((3, 5, 4), (3, 6, 4), (((2,), (2,)), ((0,), (0,))))  # "bik,bjk->bij"
CASES = GRID + list(NAMED.values())
CASE_IDS = [f"grid{i}" for i in range(len(GRID))] + list(NAMED)
# (lhs dtype, rhs dtype, precision, preferred_element_type); all go through gemm.
DTYPES = {
    "f32-highest": (np.float32, np.float32, HIGHEST, None),
    "bf16": (BF16, BF16, None, None),
    "f16": (np.float16, np.float16, None, None),
    "bf16xf32": (BF16, np.float32, HIGHEST, None),
    "bf16-to-f32": (BF16, BF16, None, np.float32),
    "f32-to-bf16": (np.float32, np.float32, HIGHEST, BF16),
}


def _reference(lhs, rhs, dimension_numbers):
  """lax.dot_general's result in float64, as one np.einsum over named dims."""
  (lc, rc), (lb, rb) = dimension_numbers
  names = iter(string.ascii_letters)
  lhs_names, rhs_names = [None] * lhs.ndim, [None] * rhs.ndim
  for i, j in zip(lb + lc, rb + rc):
    lhs_names[i] = rhs_names[j] = next(names)
  lhs_free = [i for i in range(lhs.ndim) if lhs_names[i] is None]
  rhs_free = [j for j in range(rhs.ndim) if rhs_names[j] is None]
  for i in lhs_free:
    lhs_names[i] = next(names)
  for j in rhs_free:
    rhs_names[j] = next(names)
  out = [lhs_names[i] for i in lb + tuple(lhs_free)] + [rhs_names[j] for j in rhs_free]
  eqn = f"{''.join(lhs_names)},{''.join(rhs_names)}->{''.join(out)}"
  return np.einsum(eqn, np.asarray(lhs, np.float64), np.asarray(rhs, np.float64))


def _fallbacks() -> int:
  return sum(dg.FALLBACKS.values())


def _check(lhs, rhs, dims, precision=None, preferred=None, *, fn=None, backend="xla"):
  """dot_general (or `fn`) through gemm: lax's shape and dtype, the reference's values."""
  fn = fn or functools.partial(dg.dot_general, backend=backend)
  before = _fallbacks()
  out = fn(jnp.asarray(lhs), jnp.asarray(rhs), dims, precision, preferred)
  assert _fallbacks() == before, f"fell back to lax.dot_general: {dict(dg.FALLBACKS)}"
  expected = jax.eval_shape(
      lambda x, y: jax.lax.dot_general(x, y, dims, precision, preferred), lhs, rhs)
  assert (out.shape, out.dtype) == (expected.shape, expected.dtype)
  k = int(np.prod([lhs.shape[d] for d in dims[0][0]]))
  in_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
  tol = tolerance(in_dtype, precision, k, out.dtype)
  ref = _reference(lhs, rhs, dims)
  err = relative_error(out, ref)
  # The table bounds errors relative to a typical result, |ref| ~ sqrt(K) |a||b|. A grid
  # case with a handful of outputs can cancel far below that (a 60-term dot product came
  # out 10x smaller on the H100): measure it against sqrt(K) * the sum of |a||b| then.
  magnitude = np.linalg.norm(_reference(np.abs(np.float64(lhs)), np.abs(np.float64(rhs)), dims))
  if magnitude > 0 and np.linalg.norm(ref) > 0:
    err *= np.linalg.norm(ref) / max(np.linalg.norm(ref), magnitude / np.sqrt(k))
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g} ({dims}, {lhs.dtype} x {rhs.dtype})"
  return out


@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("lhs_shape,rhs_shape,dims", CASES, ids=CASE_IDS)
def test_matches_lax(lhs_shape, rhs_shape, dims, dtypes, rng):
  lhs_dtype, rhs_dtype, precision, preferred = dtypes
  _check(random(rng, lhs_shape, lhs_dtype), random(rng, rhs_shape, rhs_dtype), dims,
         precision, preferred)


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims", [NAMED["dense-general"], NAMED["batch-last"],
                                                      GRID[0], GRID[3]])
@pytest.mark.parametrize("pallas_backend", PALLAS)
def test_pallas_backends(pallas_backend, lhs_shape, rhs_shape, dims, rng):
  dtype = BF16 if not skip_reason(pallas_backend, BF16) else np.float32
  reason = skip_reason(pallas_backend, dtype)
  if reason:
    pytest.skip(reason)
  _check(random(rng, lhs_shape, dtype), random(rng, rhs_shape, dtype), dims,
         backend=pallas_backend)


@pytest.mark.parametrize("name", ["matmul", "a^T b", "a b^T", "dense-3d", "dense-general",
                                  "batched"])
def test_no_transpose_when_dims_allow(name):
  """Operands already in a GEMM layout reach gemm through reshapes only (no copy)."""
  lhs_shape, rhs_shape, dims = {**NAMED, "batched": BATCHED}[name]
  jaxpr = jax.make_jaxpr(functools.partial(dg.dot_general, dimension_numbers=dims,
                                           backend="xla"))(
      jnp.zeros(lhs_shape), jnp.zeros(rhs_shape))
  assert "transpose" not in {e.primitive.name for e in jaxpr.eqns}, jaxpr


def test_contracting_pairs_in_any_order(rng):
  """Listing the contracting pairs (2, 0), (0, 1) is the same as (0, 1), (2, 0)."""
  lhs, rhs = random(rng, (3, 4, 5), np.float32), random(rng, (5, 3, 2), np.float32)
  for dims in ((((2, 0), (0, 1)), ((), ())), (((0, 2), (1, 0)), ((), ()))):
    _check(lhs, rhs, dims, HIGHEST)


# ----------------------------------------------------------------------------- fallbacks


def _expect_fallback(reason, lhs, rhs, dims, precision=None, preferred=None):
  before = dg.FALLBACKS[reason]
  out = dg.dot_general(lhs, rhs, dims, precision, preferred)
  assert dg.FALLBACKS[reason] == before + 1, dict(dg.FALLBACKS)
  expected = jax.lax.dot_general(lhs, rhs, dims, precision, preferred)
  assert out.dtype == expected.dtype
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims", [NAMED["dense-general"], GRID[1]])
def test_int32_falls_back(lhs_shape, rhs_shape, dims, rng):
  lhs = jnp.asarray(rng.integers(-5, 5, lhs_shape), jnp.int32)
  rhs = jnp.asarray(rng.integers(-5, 5, rhs_shape), jnp.int32)
  _expect_fallback("input dtype", lhs, rhs, dims)
  _expect_fallback("input dtype", lhs.astype(BF16), rhs, dims)  # lax: bf16 x int32 -> bf16


def test_float64_output_falls_back(rng):
  with jax.enable_x64(True):
    lhs, rhs = random(rng, (4, 5), np.float32), random(rng, (5, 3), np.float32)
    _expect_fallback("output dtype", jnp.asarray(lhs), jnp.asarray(rhs),
                     NAMED["matmul"][2], None, np.float64)


@pytest.mark.parametrize("precision", [
    jax.lax.DotAlgorithm(np.float32, np.float32, np.float32),  # a custom algorithm
    jax.lax.DotAlgorithmPreset.F16_F16_F32,                    # float32 inputs: not its types
])
def test_dot_algorithm_falls_back(precision, rng):
  # Traced only: XLA's CPU backend runs neither algorithm.
  lhs, rhs = random(rng, (4, 5), np.float32), random(rng, (5, 3), np.float32)
  before = dg.FALLBACKS["precision"]
  jaxpr = jax.make_jaxpr(lambda x, y: dg.dot_general(x, y, NAMED["matmul"][2], precision))(
      lhs, rhs)
  assert dg.FALLBACKS["precision"] == before + 1
  assert [e.primitive.name for e in jaxpr.eqns] == ["dot_general"]


@pytest.mark.parametrize("precision,expected", [
    (None, (True, None)),
    ("highest", (True, HIGHEST)),
    (jax.lax.Precision.HIGH, (True, jax.lax.Precision.HIGH)),
    (("default", "default"), (True, jax.lax.Precision.DEFAULT)),
    ((jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST), (True, HIGHEST)),
    ((jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT), (True, HIGHEST)),
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6, (True, jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6)),
    ("BF16_BF16_F32_X3", (True, jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3)),
    (jax.lax.DotAlgorithmPreset.DEFAULT, (True, None)),
])
def test_gemm_precision(precision, expected):
  assert dg._gemm_precision(precision) == expected


@pytest.mark.parametrize("precision,default,expected", [
    (None, "highest", HIGHEST),  # None means jax_default_matmul_precision, as for lax
    (None, None, None),
    ((jax.lax.Precision.HIGH, HIGHEST), None, HIGHEST),
    (("default", "default"), "highest", jax.lax.Precision.DEFAULT),
])
def test_precision_reaches_gemm(precision, default, expected):
  x = jnp.zeros((4, 4))
  with jax.default_matmul_precision(default):
    jaxpr = jax.make_jaxpr(
        lambda x: dg.dot_general(x, x, NAMED["matmul"][2], precision, backend="xla"))(x)
  plans = [e.params["plan"] for e in jaxpr.eqns if "plan" in e.params]
  assert [p.precision for p in plans] == [expected]


@pytest.mark.parametrize("dims", [
    (((1,), (1,)), ((), ())),           # contracting sizes differ
    (((2,), (0,)), ((), ())),           # out of range
    (((1,), (0,)), ((0,), (1,))),       # a dim both batch and contracting
])
def test_bad_dimension_numbers_raise_as_lax(dims):
  lhs, rhs = jnp.zeros((3, 4)), jnp.zeros((4, 5))
  with pytest.raises(TypeError) as lax_error:
    jax.lax.dot_general(lhs, rhs, dims)
  with pytest.raises(TypeError) as ours:
    dg.dot_general(lhs, rhs, dims)
  assert str(ours.value).splitlines()[0] == str(lax_error.value).splitlines()[0]


# ----------------------------------------------------------------------------- einsum, jit, grad


@pytest.mark.parametrize("eqn,shapes", [
    ("ij,jk->ik", ((5, 6), (6, 4))),
    ("bij,bjk->bik", ((2, 5, 6), (2, 6, 4))),
    ("bqhd,bkhd->bhqk", ((2, 5, 3, 4), (2, 6, 3, 4))),   # attention logits
    ("bhqk,bkhd->bqhd", ((2, 3, 5, 6), (2, 6, 3, 4))),   # attention values
    ("abc,cbd->ad", ((3, 4, 5), (5, 4, 2))),
    ("ij,kj->ki", ((5, 6), (4, 6))),
])
@pytest.mark.parametrize("dtype,precision", [(np.float32, HIGHEST), (BF16, None)],
                         ids=["f32-highest", "bf16"])
def test_einsum(eqn, shapes, dtype, precision, rng):
  x, y = (random(rng, s, dtype) for s in shapes)
  einsum = functools.partial(jnp.einsum, eqn, precision=precision,
                             _dot_general=functools.partial(dg.dot_general, backend="xla"))
  before = _fallbacks()
  assert str(jax.make_jaxpr(einsum)(x, y)).count("pallas_gemm[") == 1  # the kernel path
  out = einsum(x, y)
  assert _fallbacks() == before, dict(dg.FALLBACKS)
  expected = jnp.einsum(eqn, x, y, precision=HIGHEST)
  ref = np.einsum(eqn, np.asarray(x, np.float64), np.asarray(y, np.float64))
  inputs, output = eqn.split("->")
  sizes = {c: n for names, shape in zip(inputs.split(","), shapes) for c, n in zip(names, shape)}
  k = int(np.prod([sizes[c] for c in set(inputs) - set(output) - {","}]))
  assert (out.shape, out.dtype) == (expected.shape, expected.dtype)
  assert relative_error(out, ref) <= tolerance(dtype, precision, k)


def test_einsum_int32_falls_back(rng):
  """einsum always passes preferred_element_type: int32 here, which gemm cannot produce."""
  x = jnp.asarray(rng.integers(-5, 5, (2, 5, 6)), jnp.int32)
  y = jnp.asarray(rng.integers(-5, 5, (2, 6, 4)), jnp.int32)
  before = dg.FALLBACKS["input dtype"]
  # A fresh partial: einsum's jit cache is keyed on it, so this call traces (and counts).
  out = jnp.einsum("bij,bjk->bik", x, y, _dot_general=functools.partial(dg.dot_general))
  assert dg.FALLBACKS["input dtype"] == before + 1
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.einsum("bij,bjk->bik", x, y)))


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims", [NAMED["dense-general"], NAMED["batch-last"],
                                                      GRID[2], GRID[5]])
def test_jit(lhs_shape, rhs_shape, dims, rng):
  lhs, rhs = random(rng, lhs_shape, np.float32), random(rng, rhs_shape, np.float32)
  fn = jax.jit(functools.partial(dg.dot_general, backend="xla"), static_argnums=(2, 3, 4))
  out = _check(lhs, rhs, dims, HIGHEST, fn=fn)
  eager = dg.dot_general(jnp.asarray(lhs), jnp.asarray(rhs), dims, HIGHEST, backend="xla")
  # Not bit-equal on a GPU: jit and eager may run different cuBLAS kernels.
  k = int(np.prod([lhs_shape[d] for d in dims[0][0]]))
  assert relative_error(out, np.asarray(eager, np.float64)) <= tolerance(np.float32, HIGHEST, k)


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims", [NAMED["dense-general"], GRID[2]])
def test_vmap(lhs_shape, rhs_shape, dims, rng):
  """vmap over a new leading axis of lhs only, then of both operands."""
  lhs = random(rng, (3,) + lhs_shape, np.float32)
  rhs = random(rng, rhs_shape, np.float32)
  ours = functools.partial(dg.dot_general, dimension_numbers=dims, precision=HIGHEST,
                           backend="xla")
  theirs = functools.partial(jax.lax.dot_general, dimension_numbers=dims, precision=HIGHEST)
  k = int(np.prod([lhs_shape[d] for d in dims[0][0]]))
  for rhs_axis in (None, 0):
    r = rhs if rhs_axis is None else random(rng, (3,) + rhs_shape, np.float32)
    out = jax.vmap(ours, in_axes=(0, rhs_axis))(lhs, r)
    with jax.enable_x64(True):
      ref = jax.vmap(theirs, in_axes=(0, rhs_axis))(lhs.astype(np.float64), r.astype(np.float64))
      assert ref.dtype == np.float64
    assert relative_error(out, ref) <= tolerance(np.float32, HIGHEST, k), rhs_axis


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims", [NAMED["dense-general"], NAMED["batch-last"],
                                                      GRID[2], GRID[7]])
@pytest.mark.parametrize("dtype,precision", [(np.float32, HIGHEST), (BF16, None)],
                         ids=["f32-highest", "bf16"])
def test_grad(lhs_shape, rhs_shape, dims, dtype, precision, rng):
  lhs, rhs = jnp.asarray(random(rng, lhs_shape, dtype)), jnp.asarray(random(rng, rhs_shape, dtype))
  out_shape = jax.eval_shape(lambda: jax.lax.dot_general(lhs, rhs, dims)).shape
  weight = random(rng, out_shape, np.float32)

  def loss(fn, preferred):
    return lambda x, y: jnp.sum(fn(x, y, dims, precision, preferred) * weight)

  ours = jax.grad(loss(functools.partial(dg.dot_general, backend="xla"), np.float32),
                  (0, 1))(lhs, rhs)
  with jax.enable_x64(True):  # the reference: lax.dot_general's gradients in float64
    ref = jax.grad(loss(jax.lax.dot_general, None), (0, 1))(
        jnp.asarray(lhs, np.float64), jnp.asarray(rhs, np.float64))
    ref = [np.asarray(g) for g in ref]
  expected = jax.grad(loss(jax.lax.dot_general, np.float32), (0, 1))(lhs, rhs)
  # A bound on both gradients' contraction lengths (rhs free dims for d lhs, lhs's for d rhs).
  k = max(lhs.size, rhs.size)
  for name, g, e, r in zip(("lhs", "rhs"), ours, expected, ref):
    assert (g.shape, g.dtype) == (e.shape, e.dtype), name
    err = relative_error(g, r)
    assert err <= tolerance(dtype, precision, k, dtype), f"d{name}: {err:.3g}"


# ----------------------------------------------------------------------------- out_sharding


def test_out_sharding_is_applied():
  """out_sharding (explicit mesh axes only, as in lax) comes out as the result's type."""
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip(f"needs >= 2 devices; this process has {len(devices)}")
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=devices[:2])
  spec = jax.sharding.PartitionSpec("x", None)
  lhs, rhs = jnp.ones((4, 6)), jnp.ones((6, 8))
  with jax.set_mesh(mesh):
    before = _fallbacks()
    out = jax.jit(lambda x, y: dg.dot_general(x, y, NAMED["matmul"][2], out_sharding=spec,
                                              backend="xla"))(lhs, rhs)
    assert _fallbacks() == before
    assert jax.typeof(out).sharding.spec == spec
    # Explicitly sharded operands go to lax, which types the result by its own rules.
    sharded = jax.sharding.reshard(lhs, spec)
    _ = dg.dot_general(sharded, rhs, NAMED["matmul"][2])
    assert dg.FALLBACKS["explicit sharding"] >= 1
  np.testing.assert_array_equal(np.asarray(out), np.full((4, 8), 6.0))
