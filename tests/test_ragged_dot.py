"""pallas_gemm.ragged_dot: one suite run per backend ("xla"; "mosaic" in Mosaic GPU's
interpreter on a CPU, natively on an sm_90 GPU).

Every result is checked against a float64 per-group reference (`reference.reference` on
each group's rows) with the tolerance table, and the xla backend bitwise against
jax.lax.ragged_dot(_general) itself. Shapes are small and reused within a test, so the
interpreter compiles each kernel once; the GPU tests at the end run real sizes with a
NaN-poisoned allocator (rows in no group must be written as zeros).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU, jax_config, random
from pallas_gemm.grouped import api, ops
from pallas_gemm.testing import grouped_shapes as shapes
from pallas_gemm.grouped import ragged_dot, ragged_dot_general
from pallas_gemm.testing.reference import reference, relative_error, tolerance

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)
DIMS = api._DIMS  # the three forms the kernels take


def ragged_skip_reason(backend: str) -> str | None:
  """Why `backend` cannot run bf16 ragged_dot here, or None (the one skip decision)."""
  if backend == "xla":
    return None
  return api.mosaic_reason(BF16, BF16, None, BF16)


@pytest.fixture(params=["xla", "mosaic"])
def backend(request):
  reason = ragged_skip_reason(request.param)
  if reason:
    pytest.skip(f"backend {request.param}: {reason}")
  return request.param


# ----------------------------------------------------------------------------- references


def _rows(group_sizes, group_offset, num_groups, m):
  """[(local group i, first row, end row)] of the local groups, as api.py defines them."""
  sizes = np.asarray(group_sizes, np.int64)
  starts = np.concatenate([[0], np.cumsum(sizes)])
  offset = 0 if group_offset is None else int(group_offset)
  out = []
  for i in range(num_groups):
    j = offset + i
    if 0 <= j < len(sizes):
      out.append((i, min(starts[j], m), min(starts[j + 1], m)))
  return out


def ref_forward(lhs, rhs, group_sizes, group_offset=None, transpose_rhs=False):
  """Per group, lhs rows @ rhs[g] (or rhs[g].T); also dlhs = ct @ rhs[g].T of the forward."""
  m = lhs.shape[0]
  out = np.zeros((m, rhs.shape[1] if transpose_rhs else rhs.shape[2]))
  for i, lo, hi in _rows(group_sizes, group_offset, rhs.shape[0], m):
    if hi > lo:
      out[lo:hi] = np.asarray(reference(lhs[lo:hi], rhs[i], transpose_b=transpose_rhs))
  return out


def ref_weight_grad(lhs, rhs, group_sizes, group_offset=None, num_groups=None):
  g = len(group_sizes) if num_groups is None else num_groups
  out = np.zeros((g, lhs.shape[1], rhs.shape[1]))
  for i, lo, hi in _rows(group_sizes, group_offset, g, lhs.shape[0]):
    if hi > lo:
      out[i] = np.asarray(reference(lhs[lo:hi], rhs[lo:hi], transpose_a=True))
  return out


def check(out, ref, dtype, k, out_dtype=None):
  err = relative_error(np.asarray(out, np.float64), ref)
  tol = tolerance(dtype, None, k, out_dtype if out_dtype is not None else out.dtype)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def operands(rng, m, k, n, g, dtype=BF16, transpose_rhs=False):
  rhs_shape = (g, n, k) if transpose_rhs else (g, k, n)
  return random(rng, (m, k), dtype), random(rng, rhs_shape, dtype)


# ----------------------------------------------------------------------------- forward


# Kinds of shapes.SIZE_KINDS plus lax's edge cases: an all-empty call and a sum past M
# (lax cuts the groups at row M).
SIZE_CASES = [*shapes.SIZE_KINDS, "empty", "over"]


def _sizes(case, g, m, rng):
  if case == "empty":
    return np.zeros(g, np.int32)
  if case == "over":
    return np.full(g, m // g + 3, np.int32)
  return shapes.group_sizes(case, g, m, rng)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_forward_group_sizes(backend, rng, transpose_rhs):
  """Zeros, one group holding every row, sizes of 1, sum < M, sum > M, all empty; K and N
  not multiples of any tile; jitted once, every case with the same shapes."""
  m, k, n, g = 40, 72, 40, 4
  lhs, rhs = operands(rng, m, k, n, g, transpose_rhs=transpose_rhs)
  dims = DIMS["forward_t" if transpose_rhs else "forward"]
  f = jax.jit(functools.partial(ragged_dot_general, ragged_dot_dimension_numbers=dims,
                                backend=backend))
  for case in SIZE_CASES:
    sizes = _sizes(case, g, m, rng)
    out = np.asarray(f(lhs, rhs, jnp.asarray(sizes)))
    check(out, ref_forward(lhs, rhs, sizes, transpose_rhs=transpose_rhs), BF16, k)
    end = min(int(sizes.sum()), m)
    assert (out[end:] == 0).all(), f"{case}: rows past sum(group_sizes) must be zeros"
    if backend == "xla":
      np.testing.assert_array_equal(out, jax.lax.ragged_dot_general(lhs, rhs, sizes, dims))


def test_forward_f32_output(backend, rng):
  """preferred_element_type=float32: f32 accumulation written unrounded."""
  m, k, n, g = 40, 72, 40, 4
  lhs, rhs = operands(rng, m, k, n, g)
  sizes = shapes.group_sizes("uniform", g, m, rng)
  out = ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32, backend=backend)
  assert out.dtype == F32
  check(out, ref_forward(lhs, rhs, sizes), BF16, k, F32)


@pytest.mark.parametrize("g", [1, 256])
def test_group_counts(backend, rng, g):
  """One group; 256 groups over 64 rows (most empty, many of one row)."""
  m, k, n = 64, 64, 24
  lhs, rhs = operands(rng, m, k, n, g)
  sizes = shapes.group_sizes("pareto" if g > 1 else "uniform", g, m, rng)
  check(ragged_dot(lhs, rhs, sizes, backend=backend), ref_forward(lhs, rhs, sizes), BF16, k)


def test_weight_grad_form(backend, rng):
  """lax's ragged-contracting mode: (M, K), (M, N) -> (G, K, N); empty groups are zeros."""
  m, k, n, g = 40, 72, 40, 4
  lhs, dy = random(rng, (m, k), BF16), random(rng, (m, n), BF16)
  f = jax.jit(functools.partial(ragged_dot_general, ragged_dot_dimension_numbers=DIMS[
      "weight_grad"], backend=backend))
  for case in ("zeros", "partial", "one", "over"):
    sizes = _sizes(case, g, m, rng)
    out = np.asarray(f(lhs, dy, jnp.asarray(sizes)))
    check(out, ref_weight_grad(lhs, dy, sizes), BF16, m)
    assert (out[sizes == 0] == 0).all(), f"{case}: an empty group's result must be zeros"
    if backend == "xla":
      np.testing.assert_array_equal(
          out, jax.lax.ragged_dot_general(lhs, dy, sizes, DIMS["weight_grad"]))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_narrow_group_size_dtypes(backend, rng, dtype):
  """int8 / uint8 sizes that each fit their dtype while their sum does not: the groups
  still end at the sums of the sizes (a cumulative sum in the given dtype wraps)."""
  m, k, n, g = 300, 64, 24, 3
  lhs, rhs = operands(rng, m, k, n, g)
  dy = random(rng, (m, n), BF16)
  sizes = np.full(g, 100, dtype)
  check(ragged_dot(lhs, rhs, sizes, backend=backend), ref_forward(lhs, rhs, sizes), BF16, k)
  check(ragged_dot_general(lhs, dy, sizes, DIMS["weight_grad"], backend=backend),
        ref_weight_grad(lhs, dy, sizes), BF16, m)


# ----------------------------------------------------------------------------- group_offset


def test_group_offset(backend, rng):
  """rhs holds groups [offset, offset + G) of 6 global ones: their rows computed, every
  other row zero; traced offsets, including past the table (those groups are empty)."""
  m, k, n, g, total = 48, 64, 40, 3, 6
  lhs, rhs = operands(rng, m, k, n, g)
  sizes = shapes.group_sizes("partial", total, m, rng)
  f = jax.jit(lambda o: ragged_dot(lhs, rhs, sizes, group_offset=o, backend=backend))
  for offset in (0, 2, 3, 5):
    out = np.asarray(f(jnp.int32(offset)))
    check(out, ref_forward(lhs, rhs, sizes, offset), BF16, k)
    lo = int(sizes[:offset].sum())
    assert (out[:lo] == 0).all() and (out[int(sizes[:offset + g].sum()):] == 0).all()
  # The weight-gradient form: entry i is global group offset + i.
  dy = random(rng, (m, n), BF16)
  out = ragged_dot_general(lhs, dy, sizes, DIMS["weight_grad"], group_offset=jnp.array([0]),
                           backend=backend)
  check(out, ref_weight_grad(lhs, dy, sizes, 0), BF16, m)


def test_group_offset_gradients(backend, rng):
  """Expert parallelism's backward: dlhs only on the local groups' rows, drhs per local
  group, as the float64 reference's."""
  m, k, n, g, total = 48, 64, 40, 2, 4
  lhs, rhs = operands(rng, m, k, n, g)
  sizes = shapes.group_sizes("uniform", total, m, rng)
  ct = random(rng, (m, n), BF16)
  offset = 1
  _, vjp = jax.vjp(lambda x, w: ragged_dot(x, w, sizes, group_offset=jnp.int32(offset),
                                           backend=backend), lhs, rhs)
  dlhs, drhs = vjp(jnp.asarray(ct))
  check(dlhs, ref_forward(ct, rhs, sizes, offset, transpose_rhs=True), BF16, n)
  check(drhs, ref_weight_grad(lhs, ct, sizes, offset, g), BF16, m)


# ----------------------------------------------------------------------------- AD and vmap


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_grad(backend, rng, transpose_rhs):
  """dlhs by the forward kernel with rhs read transposed, drhs by the weight-gradient one:
  against float64 and against jax.vjp through jax.lax.ragged_dot_general. The transposed
  case has preferred_element_type=float32: its float32 cotangent comes back as gradients
  in the operands' dtype."""
  m, k, n, g = 40, 72, 40, 4
  lhs, rhs = operands(rng, m, k, n, g, transpose_rhs=transpose_rhs)
  sizes = shapes.group_sizes("zeros", g, m, rng)
  out_dtype = F32 if transpose_rhs else None
  ct = random(rng, (m, n), out_dtype or BF16)
  dims = DIMS["forward_t" if transpose_rhs else "forward"]
  _, vjp = jax.vjp(lambda x, w: ragged_dot_general(x, w, sizes, dims, backend=backend,
                                                   preferred_element_type=out_dtype), lhs, rhs)
  dlhs, drhs = vjp(jnp.asarray(ct))
  _, lax_vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot_general(
      x, w, sizes, dims, preferred_element_type=out_dtype), lhs, rhs)
  lax_dlhs, lax_drhs = lax_vjp(jnp.asarray(ct))
  assert dlhs.dtype == lhs.dtype and drhs.dtype == rhs.dtype
  ref_dlhs = ref_forward(ct, rhs, sizes, transpose_rhs=not transpose_rhs)
  ref_drhs = ref_weight_grad(ct, lhs, sizes) if transpose_rhs else ref_weight_grad(lhs, ct, sizes)
  check(dlhs, ref_dlhs, BF16, n)
  check(drhs, ref_drhs, BF16, m)
  if backend == "xla":
    np.testing.assert_array_equal(dlhs, lax_dlhs)
    if transpose_rhs:
      # The (G, N, K) weight gradient of a float32 cotangent: lax's transpose rule and the
      # xla backend's weight-gradient product sum it in different orders before rounding to
      # bfloat16, so an element near a rounding boundary lands one bf16 step apart (on the
      # CPU in about 15% of random draws, one element of 11520).
      np.testing.assert_allclose(np.asarray(drhs, np.float32), np.asarray(lax_drhs, np.float32),
                                 rtol=float(jnp.finfo(BF16).eps), atol=0)
    else:
      np.testing.assert_array_equal(drhs, lax_drhs)
  else:
    check(dlhs, np.asarray(lax_dlhs, np.float64), BF16, n)
    check(drhs, np.asarray(lax_drhs, np.float64), BF16, m)


def test_grad_of_weight_grad_form(backend, rng):
  """The ragged-contracting form's own cotangents: two forward calls."""
  m, k, n, g = 40, 64, 40, 3
  lhs, dy = random(rng, (m, k), BF16), random(rng, (m, n), BF16)
  sizes = shapes.group_sizes("partial", g, m, rng)
  ct = random(rng, (g, k, n), BF16)
  _, vjp = jax.vjp(lambda x, y: ragged_dot_general(x, y, sizes, DIMS["weight_grad"],
                                                   backend=backend), lhs, dy)
  dx, ddy = vjp(jnp.asarray(ct))
  check(dx, ref_forward(dy, ct, sizes, transpose_rhs=True), BF16, n)
  check(ddy, ref_forward(lhs, ct, sizes), BF16, k)


def test_jvp(backend, rng):
  """Forward mode by linearity: f(dlhs, rhs) + f(lhs, drhs), as lax's JVP."""
  m, k, n, g = 40, 64, 40, 3
  lhs, rhs = operands(rng, m, k, n, g)
  dlhs, drhs = operands(rng, m, k, n, g)
  sizes = shapes.group_sizes("uniform", g, m, rng)
  out, tangent = jax.jvp(lambda x, w: ragged_dot(x, w, sizes, preferred_element_type=F32,
                                                 backend=backend), (lhs, rhs), (dlhs, drhs))
  ref = ref_forward(dlhs, rhs, sizes) + ref_forward(lhs, drhs, sizes)
  check(tangent, ref, BF16, k, F32)
  check(out, ref_forward(lhs, rhs, sizes), BF16, k, F32)


def test_vmap(backend, rng):
  """A leading batch of (lhs, group_sizes) over shared weights, and of all three."""
  m, k, n, g, b = 40, 64, 40, 3, 2
  lhs = random(rng, (b, m, k), BF16)
  rhs = random(rng, (b, g, k, n), BF16)
  sizes = np.stack([shapes.group_sizes(kind, g, m, rng) for kind in ("uniform", "zeros")])
  out = jax.vmap(lambda x, s: ragged_dot(x, rhs[0], s, backend=backend))(lhs, sizes)
  for i in range(b):
    check(out[i], ref_forward(lhs[i], rhs[0], sizes[i]), BF16, k)
  out = jax.jit(jax.vmap(lambda x, w, s: ragged_dot(x, w, s, backend=backend)))(lhs, rhs, sizes)
  for i in range(b):
    check(out[i], ref_forward(lhs[i], rhs[i], sizes[i]), BF16, k)


def test_x64(backend, rng):
  """With jax_enable_x64 on: int64 group sizes and offset, forward and both gradients."""
  m, k, n, g, total = 40, 64, 24, 2, 3
  lhs, rhs = operands(rng, m, k, n, g)
  sizes = shapes.group_sizes("partial", total, m, rng)
  ct = random(rng, (m, n), BF16)
  with jax_config("jax_enable_x64", True):
    out, vjp = jax.vjp(lambda x, w: ragged_dot(x, w, jnp.asarray(sizes, jnp.int64),
                                               group_offset=jnp.int64(1), backend=backend),
                       lhs, rhs)
    dlhs, drhs = vjp(jnp.asarray(ct))
  check(out, ref_forward(lhs, rhs, sizes, 1), BF16, k)
  check(dlhs, ref_forward(ct, rhs, sizes, 1, transpose_rhs=True), BF16, n)
  check(drhs, ref_weight_grad(lhs, ct, sizes, 1, g), BF16, m)


def test_float32_inputs_run_as_lax(rng):
  """float32 operands: "auto" runs lax's computation (the kernels are 16-bit), bitwise."""
  m, k, n, g = 24, 16, 8, 3
  lhs, rhs = operands(rng, m, k, n, g, dtype=F32)
  sizes = jnp.asarray(shapes.group_sizes("uniform", g, m, rng))
  np.testing.assert_array_equal(ragged_dot(lhs, rhs, sizes),
                                jax.lax.ragged_dot(lhs, rhs, sizes))
  with pytest.raises(ValueError, match="16-bit"):
    ragged_dot(lhs, rhs, sizes, backend="mosaic")


@pytest.mark.parametrize("lhs_dtype, rhs_dtype, preferred", [
    (np.float16, BF16, None), (BF16, np.float16, None), (BF16, BF16, np.float64)])
def test_result_dtype_is_lax(rng, lhs_dtype, rhs_dtype, preferred):
  """The result dtype is lax.dot_general's: float16 x bfloat16 gives bfloat16 (the wider
  exponent wins, not jnp's promotion to float32), and a float64 preferred_element_type
  is float32 while x64 is off."""
  m, k, n, g = 24, 16, 8, 3
  lhs, rhs = random(rng, (m, k), lhs_dtype), random(rng, (g, k, n), rhs_dtype)
  sizes = shapes.group_sizes("uniform", g, m, rng)
  expected = jax.eval_shape(functools.partial(jax.lax.dot, preferred_element_type=preferred),
                            lhs, rhs[0]).dtype
  out = ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred)
  assert out.dtype == expected
  check(out, ref_forward(lhs, rhs, sizes), BF16, k)
  if lhs_dtype != rhs_dtype:
    np.testing.assert_array_equal(out, jax.lax.ragged_dot(lhs, rhs, sizes))


def test_other_forms_run_on_lax(rng):
  """A form the kernels do not take (lhs with a batch dimension) is lax's."""
  lhs = random(rng, (2, 12, 8), F32)
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([2], [2]), ([0], [1])), lhs_ragged_dimensions=[1],
      rhs_group_dimensions=[0])
  rhs = random(rng, (3, 2, 8, 4), F32)
  sizes = jnp.asarray([[4, 4, 4], [2, 0, 9]], jnp.int32)
  np.testing.assert_array_equal(ragged_dot_general(lhs, rhs, sizes, dims),
                                jax.lax.ragged_dot_general(lhs, rhs, sizes, dims))
  with pytest.raises(ValueError, match="backend='mosaic'"):
    ragged_dot_general(lhs, rhs, sizes, dims, backend="mosaic")


def test_empty_operands(backend, rng):
  """M = 0 and K = 0: no kernel, zeros of lax's shape."""
  rhs = random(rng, (3, 8, 5), BF16)
  sizes = jnp.zeros(3, jnp.int32)
  assert ragged_dot(jnp.zeros((0, 8), BF16), rhs, sizes, backend=backend).shape == (0, 5)
  out = ragged_dot(jnp.ones((4, 0), BF16), jnp.ones((3, 0, 5), BF16), jnp.array([1, 2, 1]),
                   backend=backend)
  np.testing.assert_array_equal(out, np.zeros((4, 5)))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make, error, match", [
    (lambda l, r: (l, r, jnp.array([1, 2], jnp.int32)), ValueError, "group_sizes"),  # length
    (lambda l, r: (l, r, jnp.array([1., 2, 3])), TypeError, "group_sizes.dtype"),
    (lambda l, r: (l, r, jnp.ones((1, 3), jnp.int32)), ValueError, "group_sizes"),  # rank
    (lambda l, r: (l, r, [1, 2, 3]), TypeError, "group_sizes"),
    (lambda l, r: (l, r, np.array([4, -1, 2], np.int32)), ValueError, ">= 0"),
    (lambda l, r: (l[:, :6], r, jnp.array([1, 2, 3])), ValueError, "share K"),
    (lambda l, r: (l.astype(jnp.int8), r, jnp.array([1, 2, 3])), TypeError, "lhs.dtype"),
    (lambda l, r: (l, r.astype(jnp.float64) if jax.config.jax_enable_x64 else r.astype(
        jnp.int32), jnp.array([1, 2, 3])), TypeError, "rhs.dtype"),
])
def test_bad_input(rng, make, error, match):
  lhs, rhs = operands(rng, 10, 8, 4, 3)
  with pytest.raises(error, match=match):
    ragged_dot(*make(jnp.asarray(lhs), jnp.asarray(rhs)))


def test_bad_arguments(rng):
  lhs, rhs = operands(rng, 10, 8, 4, 3)
  sizes = jnp.array([3, 3, 3], jnp.int32)
  with pytest.raises(TypeError, match="ragged_dot_dimension_numbers"):
    ragged_dot_general(lhs, rhs, sizes, (([1], [1]), ([], [])))
  with pytest.raises(ValueError, match="backend"):
    ragged_dot(lhs, rhs, sizes, backend="cuda")
  with pytest.raises(ValueError, match="group_offset must lie"):
    ragged_dot(lhs, rhs, jnp.array([3, 3, 3, 1]), group_offset=2)
  with pytest.raises(ValueError, match="group_offset must be a scalar"):
    ragged_dot(lhs, rhs, sizes, group_offset=jnp.zeros((2,), jnp.int32))
  with pytest.raises(TypeError, match="group_offset"):
    ragged_dot(lhs, rhs, sizes, group_offset=0.5)
  with pytest.raises(ValueError, match="same rows"):
    ragged_dot_general(lhs, random(rng, (9, 4), BF16), sizes, DIMS["weight_grad"])
  with pytest.raises(ValueError, match="at least rhs's"):
    ragged_dot(lhs, rhs, jnp.array([5, 5]), group_offset=0)
  for backend in api.BACKENDS:
    with pytest.raises(TypeError, match=r"config must be None or a pallas_gemm.grouped.config"
                                        r".Config; got builtins.dict"):
      ragged_dot(lhs, rhs, sizes, backend=backend, config={"block_m": 64})


def test_traced_negative_sizes_on_xla_are_lax(rng):
  """Traced sizes cannot be checked without a host sync: xla computes what lax does."""
  lhs, rhs = operands(rng, 10, 8, 4, 3, dtype=F32)
  sizes = jnp.array([4, -1, 5], jnp.int32)
  f = jax.jit(lambda s: ragged_dot(lhs, rhs, s, backend="xla"))
  np.testing.assert_array_equal(f(sizes), jax.lax.ragged_dot(lhs, rhs, sizes))


# ----------------------------------------------------------------------------- Mosaic lowering


def test_mosaic_lowers_for_cuda(rng):
  """The kernels of a forward and its gradients lower for CUDA (no GPU needed)."""
  if api.mosaic_reason(BF16, BF16, None, BF16) is not None:
    pytest.skip(api.mosaic_reason(BF16, BF16, None, BF16))
  m, k, n, g = 300, 200, 136, 4
  lhs, rhs = operands(rng, m, k, n, g)
  plan = ops.Plan(form="forward", num_groups=g, backend="mosaic", out_dtype=BF16, offset=True)

  def loss(x, w, s, o):
    return jnp.sum(ops.bind(plan, x, w, s, o).astype(F32))

  f = jax.jit(jax.value_and_grad(loss, (0, 1)))
  text = f.trace(lhs, rhs, jnp.ones(6, jnp.int32), jnp.int32(1)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3, "forward, dlhs and drhs kernels"


# ----------------------------------------------------------------------------- GPU, real sizes


def poison_allocator(nbytes):
  """Fill and free a NaN buffer so the next allocation likely reuses it: unwritten rows show."""
  jnp.full((nbytes // 4 + 1,), jnp.nan, jnp.float32).block_until_ready().delete()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["pareto", "zeros", "partial", "ones"])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gpu_forward_poisoned(rng, kind, transpose_rhs):
  m, k, n, g = 4099, 1000, 1544, 16
  lhs, rhs = operands(rng, m, k, n, g, transpose_rhs=transpose_rhs)
  sizes = shapes.group_sizes(kind, g, m, rng)
  dims = DIMS["forward_t" if transpose_rhs else "forward"]
  poison_allocator(2 * m * n)
  out = ragged_dot_general(lhs, rhs, sizes, dims, backend="mosaic")
  check(out, ref_forward(lhs, rhs, sizes, transpose_rhs=transpose_rhs), BF16, k)
  assert not np.isnan(np.asarray(out, np.float32)).any()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["pareto", "zeros", "partial"])
def test_gpu_weight_grad_poisoned(rng, kind):
  m, k, n, g = 4099, 1000, 776, 16
  lhs, dy = random(rng, (m, k), BF16), random(rng, (m, n), BF16)
  sizes = shapes.group_sizes(kind, g, m, rng)
  poison_allocator(4 * g * k * n)
  out = ragged_dot_general(lhs, dy, sizes, DIMS["weight_grad"], backend="mosaic",
                           preferred_element_type=jnp.float32)
  check(out, ref_weight_grad(lhs, dy, sizes), BF16, m, F32)
  assert not np.isnan(np.asarray(out)).any()


@pytest.mark.gpu
def test_gpu_group_offset_and_grad_poisoned(rng):
  m, k, n, g, total = 4099, 1024, 1536, 8, 32
  lhs, rhs = operands(rng, m, k, n, g)
  sizes = shapes.group_sizes("pareto", total, m, rng)
  ct = random(rng, (m, n), BF16)
  poison_allocator(2 * m * max(n, k))
  out, vjp = jax.vjp(lambda x, w: ragged_dot(x, w, sizes, group_offset=jnp.int32(8)), lhs, rhs)
  dlhs, drhs = vjp(jnp.asarray(ct))
  check(out, ref_forward(lhs, rhs, sizes, 8), BF16, k)
  check(dlhs, ref_forward(ct, rhs, sizes, 8, transpose_rhs=True), BF16, n)
  check(drhs, ref_weight_grad(lhs, ct, sizes, 8, g), BF16, m)


@pytest.mark.gpu
def test_gpu_auto_picks_mosaic():
  assert api.choose_backend("auto", BF16, BF16, None, BF16) == "mosaic"
  assert api.choose_backend("auto", F32, F32, None, F32) == "xla"
  assert ON_GPU
