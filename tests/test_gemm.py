"""The backend-independent suite: every test runs once per backend (the `backend` fixture).

On a CPU the Pallas backends run in interpret mode on small shapes; tests marked `gpu`
run the full-size and ragged-edge cases on the device machine (benchmarks/device_run.sh).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from conftest import ON_GPU, jax_config, random, skip_reason
import pallas_gemm
from pallas_gemm import gemm
from pallas_gemm.matmul import op
from pallas_gemm.testing.reference import ACTIVATIONS as reference_activations
from pallas_gemm.testing.reference import gated_gradient, reference, relative_error, tolerance

HIGHEST = jax.lax.Precision.HIGHEST
BF16 = jnp.bfloat16
# (dtype, precision): IEEE f32, TF32-allowed f32, and the two 16-bit types.
DTYPES = [(np.float32, HIGHEST), (np.float32, None), (BF16, None), (np.float16, None)]
DTYPE_IDS = ["f32-highest", "f32-default", "bf16", "f16"]
# Shapes (M, N, K) that divide no tile: 1, 7, 129, skinny, K-light.
SMALL_SHAPES = [(1, 1, 1), (7, 129, 33), (129, 7, 65), (64, 64, 64), (1, 200, 40), (33, 70, 1)]


def preferred_dtype(backend):
  """bf16 where the backend takes it (the common case), else f32 (the cuda backend)."""
  return BF16 if not skip_reason(backend, BF16) else np.float32


def check(backend, m, n, k, dtype, precision, rng, *, batch=(), shared_b=False, transpose_a=False,
          transpose_b=False, alpha=1.0, beta=0.0, c_shape=None, out_dtype=None, fn=None):
  """Runs one GEMM through the front door and compares it with the float64 reference."""
  reason = skip_reason(backend, dtype, precision)
  if reason:
    pytest.skip(reason)
  a = random(rng, batch + ((k, m) if transpose_a else (m, k)), dtype)
  b = random(rng, (() if shared_b else batch) + ((n, k) if transpose_b else (k, n)), dtype)
  c = None if c_shape is None else random(rng, c_shape, np.float32)
  call = fn or (lambda a, b, c: gemm(
      a, b, c, alpha=alpha, beta=beta, transpose_a=transpose_a, transpose_b=transpose_b,
      precision=precision, out_dtype=out_dtype, backend=backend))
  out = call(jnp.asarray(a), jnp.asarray(b), None if c is None else jnp.asarray(c))
  expected_dtype = np.dtype(out_dtype or dtype)
  assert out.shape == batch + (m, n) and out.dtype == expected_dtype, (out.shape, out.dtype)
  ref = reference(a, b, c, alpha=alpha, beta=beta, transpose_a=transpose_a,
                  transpose_b=transpose_b)
  err = relative_error(out, ref)
  tol = tolerance(dtype, precision, k, out_dtype)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g} ({backend}, {m}x{n}x{k}, {np.dtype(dtype)})"
  return out


@pytest.mark.parametrize("dtype,precision", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", SMALL_SHAPES)
def test_shapes(backend, m, n, k, dtype, precision, rng):
  check(backend, m, n, k, dtype, precision, rng)


@pytest.mark.parametrize("transpose_a,transpose_b", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype,precision", [DTYPES[0], DTYPES[2]], ids=["f32-highest", "bf16"])
def test_transposes(backend, transpose_a, transpose_b, dtype, precision, rng):
  check(backend, 40, 72, 24, dtype, precision, rng, transpose_a=transpose_a,
        transpose_b=transpose_b)


@pytest.mark.parametrize("shared_b", [False, True])
def test_batched(backend, shared_b, rng):
  check(backend, 17, 24, 40, preferred_dtype(backend), None, rng, batch=(2, 3), shared_b=shared_b)


@pytest.mark.parametrize("c_shape", [(3, 20, 36), (36,)], ids=["full-c", "bias"])
def test_alpha_beta(backend, c_shape, rng):
  check(backend, 20, 36, 16, np.float32, HIGHEST, rng, batch=(3,), alpha=-0.5, beta=2.0,
        c_shape=c_shape)
  check(backend, 20, 36, 16, preferred_dtype(backend), None, rng, batch=(3,), alpha=1.5, beta=-1.0,
        c_shape=c_shape, out_dtype=np.float16)


def test_beta_zero_does_not_read_c(backend, rng):
  dtype = preferred_dtype(backend)
  a, b = random(rng, (16, 8), dtype), random(rng, (8, 24), dtype)
  out = gemm(a, b, jnp.full((16, 24), jnp.nan), beta=0.0, backend=backend)
  assert bool(jnp.all(jnp.isfinite(out)))  # BLAS: beta == 0 means C is not read


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_out_dtype(backend, out_dtype, rng):
  check(backend, 24, 40, 32, preferred_dtype(backend), None, rng, out_dtype=out_dtype)


def test_alpha_brings_an_f16_product_back_into_range(backend):
  """alpha applies to the f32 accumulator: an f16 product beyond f16's range (65504) that
  alpha scales back into it is finite (no backend rounds the product to f16 first)."""
  if skip_reason(backend, np.float16):
    pytest.skip(skip_reason(backend, np.float16))
  a = jnp.full((16, 16), 300.0, jnp.float16)
  out = gemm(a, a, alpha=1.0 / 64, bias=jnp.full((16,), -500.0, jnp.float16), backend=backend)
  assert out.dtype == jnp.float16
  np.testing.assert_allclose(np.asarray(out, np.float32), 16 * 300.0**2 / 64 - 500, rtol=2**-10)


def test_jit_and_vmap(backend, rng):
  dtype = preferred_dtype(backend)
  a, b = random(rng, (3, 12, 20), dtype), random(rng, (3, 20, 28), dtype)
  c = random(rng, (3, 12, 28), np.float32)
  f = jax.jit(lambda a, b, c: gemm(a, b, c, alpha=2.0, beta=0.5, backend=backend,
                                   out_dtype=np.float32))
  tol = tolerance(dtype, None, 20, np.float32)
  ref = reference(a, b, c, alpha=2.0, beta=0.5)
  assert relative_error(f(a, b, c), ref) <= tol
  assert relative_error(jax.vmap(f)(a, b, c), ref) <= tol
  # vmap over a with b shared (in_axes None), and over b with a shared.
  assert relative_error(jax.vmap(f, in_axes=(0, None, 0))(a, b[0], c),
                        reference(a, b[0], c, alpha=2.0, beta=0.5)) <= tol
  assert relative_error(jax.vmap(f, in_axes=(None, 0, 0))(a[0], b, c),
                        reference(a[0], b, c, alpha=2.0, beta=0.5)) <= tol
  # vmap of an already-batched call: the vmapped axis folds into the batch axis.
  g = jax.vmap(lambda a, b: gemm(a, b, backend=backend, out_dtype=np.float32))
  a4, b4 = random(rng, (2, 3, 12, 20), dtype), random(rng, (2, 3, 20, 28), dtype)
  assert relative_error(g(a4, b4), reference(a4, b4)) <= tol


@pytest.mark.parametrize("transpose_a,transpose_b,shared_b", [
    (False, False, False), (True, True, False), (False, False, True), (True, False, True),
    (False, True, True)])
def test_grad_matches_analytic(backend, transpose_a, transpose_b, shared_b, rng):
  """Gradients of <W, gemm(a, b, c)> against float64 closed forms, for every backend."""
  dtype, precision = np.float32, (HIGHEST if not skip_reason(backend, np.float32, HIGHEST) else None)
  if skip_reason(backend, dtype, precision):
    pytest.skip(skip_reason(backend, dtype, precision))
  m, n, k, alpha, beta = 12, 20, 16, 1.5, -0.5
  a = random(rng, (2,) + ((k, m) if transpose_a else (m, k)), dtype)
  b = random(rng, (() if shared_b else (2,)) + ((n, k) if transpose_b else (k, n)), dtype)
  c, w = random(rng, (2, m, n), dtype), random(rng, (2, m, n), dtype)

  def loss(a, b, c):
    out = gemm(a, b, c, alpha=alpha, beta=beta, transpose_a=transpose_a, transpose_b=transpose_b,
               precision=precision, backend=backend)
    return jnp.sum(out * w)

  da, db, dc = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a, b, c)
  w64, a64, b64 = (x.astype(np.float64) for x in (w, a, b))
  op_a = np.swapaxes(a64, -1, -2) if transpose_a else a64
  op_b = np.swapaxes(b64, -1, -2) if transpose_b else b64
  d_op_a = alpha * w64 @ np.swapaxes(op_b, -1, -2)
  d_op_b = alpha * np.swapaxes(op_a, -1, -2) @ w64
  if shared_b:
    d_op_b = d_op_b.sum(axis=0)
  tol = tolerance(dtype, precision, max(m, n, 2 * m))
  assert relative_error(da, np.swapaxes(d_op_a, -1, -2) if transpose_a else d_op_a) <= tol
  assert relative_error(db, np.swapaxes(d_op_b, -1, -2) if transpose_b else d_op_b) <= tol
  assert relative_error(dc, beta * w64) <= tol


def test_x64(backend, rng):
  """With jax_enable_x64 on, value and gradients match the reference."""
  dtype = preferred_dtype(backend)
  precision = HIGHEST if not skip_reason(backend, dtype, HIGHEST) else None
  m, n, k = 40, 24, 64
  a, b, w = random(rng, (m, k), dtype), random(rng, (k, n), dtype), random(rng, (m, n), dtype)
  with jax_config("jax_enable_x64", True):
    out, vjp = jax.vjp(lambda a, b: gemm(a, b, precision=precision, backend=backend), a, b)
    da, db = vjp(jnp.asarray(w))
  a64, b64, w64 = (x.astype(np.float64) for x in (a, b, w))
  assert out.dtype == np.dtype(dtype)
  assert relative_error(out, a64 @ b64) <= tolerance(dtype, precision, k)
  assert relative_error(da, w64 @ b64.T) <= tolerance(dtype, precision, n)
  assert relative_error(db, a64.T @ w64) <= tolerance(dtype, precision, m)


def test_grad_keeps_wide_cotangents(backend, rng):
  """f16 inputs with an f32 output: a cotangent above f16's range must not become inf."""
  dtype = np.float16 if not skip_reason(backend, np.float16) else np.float32
  a, b = np.full((2, 4), 1e-3, dtype), np.full((4, 3), 1e-3, dtype)
  da = jax.grad(lambda a: 1e5 * jnp.sum(gemm(a, b, out_dtype=np.float32, backend=backend)))(a)
  np.testing.assert_allclose(np.asarray(da, np.float32), 300.0, rtol=5e-3)


def test_vmap_over_an_empty_axis(backend):
  dtype = preferred_dtype(backend)
  out = jax.vmap(lambda a: gemm(a, jnp.ones((16, 8), dtype), backend=backend))(
      jnp.ones((0, 8, 16), dtype))
  assert out.shape == (0, 8, 8)


def test_check_grads(backend, rng):
  """jax.test_util.check_grads (reverse mode, numerical) where IEEE f32 is available."""
  if skip_reason(backend, np.float32, HIGHEST):
    pytest.skip(skip_reason(backend, np.float32, HIGHEST))
  a, b = random(rng, (2, 6, 5), np.float32), random(rng, (5, 7), np.float32)
  c = random(rng, (2, 6, 7), np.float32)
  f = lambda a, b, c: gemm(a, b, c, alpha=0.7, beta=1.3, precision=HIGHEST, backend=backend)
  # f is bilinear, so central differences are exact at any step: a step of 1 keeps
  # float32's rounding of f (~1e-7 |f| / eps) out of the numerical derivative (at jax's
  # default eps of 1e-4 it reached the 1e-2 bound on one seed in a GPU run).
  check_grads(f, (a, b, c), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1.0)


ACTIVATIONS = [None, "relu", "gelu", "gelu_exact", "silu"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias_dtype", [np.float32, BF16])
def test_bias_and_activation(backend, activation, bias_dtype, rng):
  """act(alpha*a@b + beta*c + bias), every activation, ragged shapes, batched."""
  dtype = preferred_dtype(backend)
  m, n, k = 19, 40, 24
  bias = random(rng, (n,), bias_dtype)
  a, b = random(rng, (2, m, k), dtype), random(rng, (k, n), dtype)
  c = random(rng, (2, m, n), np.float32)
  out = gemm(a, b, c, alpha=0.5, beta=-1.0, bias=bias, activation=activation,
             out_dtype=np.float32, backend=backend)
  ref = reference(a, b, c, alpha=0.5, beta=-1.0, bias=bias, activation=activation)
  assert relative_error(out, ref) <= tolerance(dtype, None, k, np.float32)


def _f32_precision(backend):
  """IEEE f32 where the backend has it, else its f32 default (TF32); skips without f32."""
  precision = HIGHEST if not skip_reason(backend, np.float32, HIGHEST) else None
  if skip_reason(backend, np.float32, precision):
    pytest.skip(skip_reason(backend, np.float32, precision))
  return precision


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_dense_gradients(backend, activation, rng):
  """grad and jvp of dense(x, w, bias, act) against float64 autodiff of the reference."""
  dtype = np.float32
  precision = _f32_precision(backend)
  x, w = random(rng, (3, 5, 8), dtype), random(rng, (8, 6), dtype)
  bias, cot = random(rng, (6,), dtype), random(rng, (3, 5, 6), dtype)
  loss = lambda x, w, bias: jnp.sum(pallas_gemm.dense(
      x, w, bias, activation, precision=precision, backend=backend) * cot)
  act64 = reference_activations[activation]
  dense64 = lambda x, w, bias: act64(jnp.matmul(x, w, precision=HIGHEST) + bias)
  with jax.enable_x64(True):
    x64, w64, bias64 = (np.asarray(v, np.float64) for v in (x, w, bias))
    loss64 = lambda x, w, bias: jnp.sum(dense64(x, w, bias) * cot)
    want = [np.asarray(g) for g in jax.grad(loss64, argnums=(0, 1, 2))(x64, w64, bias64)]
    tangent_ref = np.asarray(jax.jvp(lambda x: dense64(x, w64, bias64), (x64,), (x64,))[1])
  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, bias)
  # The GEMM's bound, doubled: the activation and its derivative are evaluated in f32 on
  # top of it (a few ulp each; CI saw a gelu tangent at 1.52e-6 against 1.39e-6).
  tol = 2 * tolerance(dtype, precision, 15)
  for g, ref in zip(got, want):
    assert relative_error(g, ref) <= tol
  _, tangent = jax.jvp(lambda x: pallas_gemm.dense(x, w, bias, activation, precision=precision,
                                                   backend=backend), (x,), (x,))
  assert relative_error(tangent, tangent_ref) <= tol


@pytest.mark.parametrize("a_activation,transpose_a", [
    ("relu", False), ("gelu", False), ("silu", False), ("gelu", True)])
def test_a_activation(backend, a_activation, transpose_a, rng):
  """gemm(a, b, a_activation=act) is act(op(a)) @ b, in value, grad, jvp and hessian; its
  gradient in a is ONE gated GEMM on the backend (act'(a) in the epilogue)."""
  precision = _f32_precision(backend)
  m, n, k = 6, 5, 8
  a = random(rng, (2, k, m) if transpose_a else (2, m, k), np.float32)
  b, bias, cot = (random(rng, s, np.float32) for s in ((k, n), (n,), (2, m, n)))
  f = lambda a, b, bias: gemm(a, b, bias=bias, transpose_a=transpose_a, a_activation=a_activation,
                              precision=precision, backend=backend)
  tol = 2 * tolerance(np.float32, precision, k)  # as in test_dense_gradients
  ref = reference(a, b, bias=bias, transpose_a=transpose_a, a_activation=a_activation)
  assert relative_error(f(a, b, bias), ref) <= tol
  act64 = reference_activations[a_activation]
  op_a = (lambda a: jnp.swapaxes(a, -1, -2)) if transpose_a else (lambda a: a)
  f64 = lambda a, b, bias: jnp.matmul(op_a(act64(a)), b, precision=HIGHEST) + bias
  loss = lambda f: lambda a, b, bias: jnp.sum(f(a, b, bias) * cot)
  with jax.enable_x64(True):
    args64 = [np.asarray(v, np.float64) for v in (a, b, bias)]
    want = jax.grad(loss(f64), argnums=(0, 1, 2))(*args64)
    tangent_ref = jax.jvp(f64, args64, args64)[1]
    cube = lambda f: lambda a: jnp.sum(f(a, args64[1], args64[2]) ** 3)
    hessian_ref = np.asarray(jax.hessian(cube(f64))(args64[0]))
  grads = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(a, b, bias)
  for got, ref in zip(grads, want):
    assert relative_error(got, np.asarray(ref)) <= tol
  # Per-example gradients: vmap folds the gate's aux with a into the batch axis.
  per_example = jax.vmap(jax.grad(lambda a, cot: jnp.sum(f(a, b, bias) * cot)))(a, cot)
  assert relative_error(per_example, np.asarray(want[0])) <= tol
  assert relative_error(jax.jvp(f, (a, b, bias), (a, b, bias))[1], np.asarray(tangent_ref)) <= tol
  cube32 = lambda a: jnp.sum(f(a, b, bias) ** 3)
  assert relative_error(jax.hessian(cube32)(a), hessian_ref) <= 4 * tol
  plans = [e.params["plan"] for e in jax.make_jaxpr(jax.grad(loss(f)))(a, b, bias).eqns
           if e.primitive is op.gemm_p]
  assert [(p.backend, p.c_gate) for p in plans if p.c_gate] == [(backend, a_activation)], plans


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_mlp(backend, activation, rng):
  """mlp is dense(dense(x, w1, b1, act), w2, b2) in value, grad, jvp, vmap and hessian, and
  its GEMMs run on the backend: the hidden layer stores act(z) and z (keep_pre), the
  second layer reads act(z) (a_given), and the hidden gradient is one gated GEMM."""
  precision = _f32_precision(backend)
  x, w1, b1 = (random(rng, s, np.float32) for s in ((2, 5, 8), (8, 12), (12,)))
  w2, b2, cot = (random(rng, s, np.float32) for s in ((12, 6), (6,), (2, 5, 6)))
  args = (x, w1, b1, w2, b2)
  f = lambda x, w1, b1, w2, b2: pallas_gemm.mlp(x, w1, b1, w2, b2, activation,
                                                 precision=precision, backend=backend)
  act64 = reference_activations[activation]
  f64 = lambda x, w1, b1, w2, b2: jnp.matmul(act64(jnp.matmul(x, w1, precision=HIGHEST) + b1),
                                             w2, precision=HIGHEST) + b2
  loss = lambda f: lambda *args: jnp.sum(f(*args) * cot)
  with jax.enable_x64(True):
    args64 = [np.asarray(v, np.float64) for v in args]
    value_ref = np.asarray(f64(*args64))
    want = jax.grad(loss(f64), argnums=tuple(range(5)))(*args64)
    tangent_ref = np.asarray(jax.jvp(f64, args64, args64)[1])
    cube = lambda f: lambda x: jnp.sum(f(x, *args64[1:]) ** 3)
    hessian_ref = np.asarray(jax.hessian(cube(f64))(args64[0][0]))
    # Linear in the output: the second derivative runs through act'' alone, and the
    # tangents of c and of the product are symbolically zero in places.
    linear = lambda f: lambda x: jnp.sum(f(x, *args64[1:]) * cot[0])
    linear_ref = np.asarray(jax.hessian(linear(f64))(args64[0][0]))
    # Both Hessians are sums that cancel (over the hidden units, the outputs, the rows'
    # terms), so each error is bounded against the same sums of absolute values, to first
    # order: each act^(n)(z) taken as |act^(n)(z)| + |act^(n+1)(z)| Z, where Z = |x||w1| +
    # |b1| bounds z's float32 error in units of tol; f_o as |act(z)| |w2| + |b2|.
    # The linear form's row r block is w1 diag(act''(z_r) * (w2 cot_r)) w1^T; the cube's,
    # sum_o 6 f_ro g_ro g_ro^T + 3 f_ro^2 w1 diag(act''(z_r) * w2[:, o]) w1^T with
    # g_ro = w1 (act'(z_r) * w2[:, o]).
    z = args64[0][0] @ args64[1] + args64[2]
    big_z = np.abs(args64[0][0]) @ np.abs(args64[1]) + np.abs(args64[2])
    grad_n = [act64]
    for _ in range(3):
      grad_n.append(jax.grad(grad_n[-1]))
    act_n = [np.abs(np.asarray(jax.vmap(jax.vmap(g))(z))) for g in grad_n]
    act_abs = [act_n[i] + act_n[i + 1] * big_z for i in range(3)]  # act, act', act''
    aw1, aw2 = np.abs(args64[1]), np.abs(args64[3])
    weights = act_abs[2] * (np.abs(np.asarray(cot[0], np.float64)) @ aw2.T)
    linear_scale = np.sqrt(sum(np.sum(((aw1 * w) @ aw1.T) ** 2) for w in weights))
    f_abs = act_abs[0] @ aw2 + np.abs(args64[4])
    cube_scale = np.sqrt(sum(np.sum(sum(
        6 * f_abs[r, o] * np.outer(g, g) + 3 * f_abs[r, o] ** 2 * (aw1 * (act_abs[2][r] * aw2[:, o])) @ aw1.T
        for o in range(aw2.shape[1]) for g in [aw1 @ (act_abs[1][r] * aw2[:, o])]) ** 2)
        for r in range(z.shape[0])))
  tol = 4 * tolerance(np.float32, precision, 12)  # two GEMMs, each with an activation's
  assert relative_error(jax.jit(f)(*args), value_ref) <= tol
  for got, ref in zip(jax.jit(jax.grad(loss(f), argnums=tuple(range(5))))(*args), want):
    assert relative_error(got, np.asarray(ref)) <= tol
  assert relative_error(jax.jvp(f, args, args)[1], tangent_ref) <= tol
  per_row = jax.vmap(f, in_axes=(1, None, None, None, None), out_axes=1)(*args)
  assert relative_error(per_row, value_ref) <= tol
  cube32 = lambda x: jnp.sum(f(x, *args[1:]) ** 3)
  cube_err = np.linalg.norm(np.asarray(jax.hessian(cube32)(x[0]), np.float64) - hessian_ref)
  assert cube_err <= 8 * tol * cube_scale
  linear32 = lambda x: jnp.sum(f(x, *args[1:]) * cot[0])
  linear_err = np.linalg.norm(np.asarray(jax.hessian(linear32)(x[0]), np.float64) - linear_ref)
  assert linear_err <= 8 * tol * linear_scale
  # Reverse over reverse: entry (o, i, j) is sum_h w2[h,o] act''(z_h) w1[i,h] w1[j,h], whose
  # f32 error is set by the f32 tanh/erf inside act'' (XLA's are approximations) and is
  # elementwise, so it is bounded by jnp's own f32 error (f64's code on f32 arrays, a different
  # evaluation order) plus tol against the same sum taken over |w2| |w1| |w1|.
  jac2 = lambda f, *args: jax.jacrev(jax.jacrev(lambda x: f(x, *args[1:])))(args[0][0, 0])
  with jax.enable_x64(True):
    jac2_ref = np.asarray(jac2(f64, *args64))
  jnp_err = np.linalg.norm(np.asarray(jac2(f64, *args), np.float64) - jac2_ref)
  jac2_scale = np.linalg.norm(np.einsum("ho,ih,jh->oij", *(np.abs(args64[i]) for i in (3, 1, 1))))
  jac2_err = np.linalg.norm(np.asarray(jac2(f, *args), np.float64) - jac2_ref)
  assert jac2_err <= 4 * jnp_err + 2 * tol * jac2_scale
  plans = [e.params["plan"] for e in jax.make_jaxpr(jax.grad(loss(f), argnums=(0, 1, 3)))(*args).eqns
           if e.primitive is op.gemm_p]
  assert {p.backend for p in plans} == {backend} and len(plans) == 6, plans
  assert sum(p.keep_pre for p in plans) == 1, plans
  assert [p.c_gate for p in plans if p.c_gate] == [activation], plans
  forward = [e.params["plan"] for e in jax.make_jaxpr(f)(*args).eqns if e.primitive is op.gemm_p]
  assert [(p.keep_pre, p.a_given) for p in forward] == [(True, False), (False, True)], forward


def test_forward_mode_and_higher_order(backend, rng):
  """jvp, linearize, jacfwd and hessian (forward over reverse) agree with jnp.dot's, and the
  tangent/cotangent GEMMs run on the backend (one gemm primitive per product, no dot)."""
  dtype = np.float32
  precision = _f32_precision(backend)
  a, b = random(rng, (5, 4), dtype), random(rng, (4, 3), dtype)
  c, ta, tb, tc = (random(rng, s, dtype) for s in ((5, 3), (5, 4), (4, 3), (5, 3)))
  kw = dict(alpha=0.5, beta=-1.5, precision=precision)
  f = lambda a, b, c: gemm(a, b, c, backend=backend, **kw)
  ref = lambda a, b, c: 0.5 * jnp.dot(a, b, precision=HIGHEST) - 1.5 * c
  tol = tolerance(dtype, precision, 4)

  # Each transform jitted and its result complete before the next call: Mosaic GPU's
  # interpreter runs kernels on worker threads, and eager ops dispatched while they ran
  # could deadlock (test_moe's `_check` says the same).
  done = lambda fn, *args: jax.block_until_ready(jax.jit(fn)(*args))  # noqa: E731
  _, tangent = done(lambda *t: jax.jvp(f, (a, b, c), t), ta, tb, tc)
  _, tangent_ref = done(lambda *t: jax.jvp(ref, (a, b, c), t), ta, tb, tc)
  assert relative_error(tangent, np.asarray(tangent_ref, np.float64)) <= tol
  assert relative_error(done(lambda *t: jax.linearize(f, a, b, c)[1](*t), ta, tb, tc),
                        np.asarray(tangent_ref, np.float64)) <= tol
  for jac in (jax.jacfwd, jax.jacrev):
    got = done(jac(f, argnums=(0, 1)), a, b, c)
    want = done(jac(ref, argnums=(0, 1)), a, b, c)
    for x, y in zip(got, want):
      assert relative_error(x, np.asarray(y, np.float64)) <= tol
  cube = lambda g: lambda a: jnp.sum(g(a, b, c) ** 3)
  assert relative_error(done(jax.hessian(cube(f)), a),
                        np.asarray(done(jax.hessian(cube(ref)), a))) <= 4 * tol
  # Every product of the second derivative is a gemm primitive, none a dot_general.
  jaxpr = str(jax.make_jaxpr(jax.hessian(cube(f)))(a))
  assert "pallas_gemm" in jaxpr and "dot_general" not in jaxpr


@pytest.mark.parametrize("shape_a,shape_b", [((0, 8), (8, 5)), ((4, 8), (8, 0)), ((4, 0), (0, 5)),
                                             ((0, 4, 8), (0, 8, 5))])
def test_zero_size(backend, shape_a, shape_b):
  a, b = jnp.ones(shape_a, jnp.float32), jnp.ones(shape_b, jnp.float32)
  out_shape = shape_a[:-1] + shape_b[-1:]
  c = jnp.full(out_shape, 3.0)
  out = gemm(a, b, c, beta=2.0, backend=backend)
  assert out.shape == out_shape
  np.testing.assert_array_equal(out, np.full(out_shape, 6.0))  # empty K: the sum is 0
  if shape_a[-1] == 0:  # BLAS's quick return: alpha is not applied to an empty sum
    out = gemm(a, b, c, alpha=float("nan"), beta=2.0, backend=backend)
    np.testing.assert_array_equal(out, np.full(out_shape, 6.0))


# Inf * 0 is NaN by design here; NumPy (Mosaic GPU's interpreter) warns about it.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_nan_inf_propagate(backend, rng):
  if skip_reason(backend, np.float32, None):
    pytest.skip(skip_reason(backend, np.float32, None))
  a, b = random(rng, (9, 6), np.float32), random(rng, (6, 10), np.float32)
  a[2, 3], a[5, 1], b[4, 7] = np.nan, np.inf, -np.inf
  out = np.asarray(gemm(a, b, backend=backend))
  with np.errstate(invalid="ignore"):
    ref = a.astype(np.float64) @ b.astype(np.float64)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
  np.testing.assert_array_equal(np.isposinf(out), np.isposinf(ref))
  np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))


# ----------------------------------------------------------------------------- on the GPU


def poison_allocator(nbytes):
  """Fill and free a NaN buffer so the next allocation likely reuses it: unwritten outputs show."""
  jnp.full((nbytes // 4 + 1,), jnp.nan, jnp.float32).block_until_ready().delete()


GPU_SHAPES = [(4097, 4097, 4097), (129, 4097, 1025), (1000, 1000, 1000), (16, 8192, 4096),
              (7, 129, 4097), (4103, 257, 129), (1024, 1024, 64)]  # last: one K step


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_large_and_ragged(backend, m, n, k, dtype, precision, rng):
  poison_allocator(4 * m * n)
  check(backend, m, n, k, dtype, precision, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, False), (False, True),
                                                     (True, True)])
@pytest.mark.parametrize("dtype,precision", [DTYPES[0], DTYPES[1], DTYPES[2]],
                         ids=["f32-highest", "f32-default", "bf16"])
def test_gpu_transposed_batched_epilogue(backend, transpose_a, transpose_b, dtype, precision, rng):
  poison_allocator(4 * 3 * 1031 * 517)
  check(backend, 1031, 517, 777, dtype, precision, rng, batch=(3,), transpose_a=transpose_a,
        transpose_b=transpose_b, alpha=0.5, beta=-2.0, c_shape=(3, 1031, 517))
  check(backend, 520, 264, 1000, dtype, precision, rng, batch=(2,), shared_b=True,
        transpose_a=transpose_a, transpose_b=transpose_b)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(2100, 2051, 300), (200, 2100, 129)])  # copies b, a
@pytest.mark.parametrize("shared_b", [False, True])
def test_gpu_nt_layout_of_long_products(backend, m, n, k, shared_b, rng):
  """transpose_b alone on products long enough that cuda copies an operand out of it."""
  poison_allocator(4 * 2 * m * n)
  check(backend, m, n, k, np.float32, HIGHEST, rng, batch=(2,), shared_b=shared_b,
        transpose_b=True, alpha=0.5, beta=-1.0, c_shape=(2, m, n))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_fused_epilogue_ragged(backend, activation, rng):
  """Bias + activation on ragged multi-tile shapes (edge sub-tiles read the padded bias)."""
  dtype = preferred_dtype(backend)
  poison_allocator(4 * 2 * 1031 * 517)
  m, n, k = 1031, 517, 777
  a, b = random(rng, (2, m, k), dtype), random(rng, (k, n), dtype)
  bias, c = random(rng, (n,), BF16), random(rng, (2, m, n), dtype)
  out = gemm(a, b, c, alpha=0.5, beta=-1.0, bias=bias, activation=activation, backend=backend)
  ref = reference(a, b, c, alpha=0.5, beta=-1.0, bias=bias, activation=activation)
  assert relative_error(out, ref) <= tolerance(dtype, None, k)


@pytest.mark.gpu
@pytest.mark.parametrize("a_activation", ["relu", "gelu", "silu"])
def test_gpu_gated_gradient_ragged(backend, a_activation, rng):
  """The gradient of gemm(a, b, a_activation=act) in a: one GEMM whose epilogue reads a
  as its C and multiplies by act'(a), on ragged multi-tile shapes."""
  dtype = preferred_dtype(backend)
  m, n, k = 1031, 517, 777
  poison_allocator(4 * m * k)
  a, b, cot = random(rng, (m, k), dtype), random(rng, (k, n), dtype), random(rng, (m, n), dtype)
  loss = lambda a: jnp.sum(gemm(a, b, a_activation=a_activation, backend=backend)
                           .astype(np.float32) * cot.astype(np.float32))
  got = jax.jit(jax.grad(loss))(a)
  want = gated_gradient(a, b, cot, a_activation)
  # Doubled: the gate is evaluated in f32 on top of the GEMM (xla rounds the product first).
  assert relative_error(got, want) <= 2 * tolerance(dtype, None, n)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_gpu_mlp_ragged(backend, activation, rng):
  """mlp on ragged multi-tile shapes: the value, and the gradients in x and w1 (through
  the stored z and the gated hidden gradient), against float64."""
  dtype = preferred_dtype(backend)
  m, d, hidden, n = 1031, 777, 1300, 517
  poison_allocator(4 * 2 * m * hidden)
  x, w1, b1 = random(rng, (m, d), dtype), random(rng, (d, hidden), dtype), random(rng, (hidden,), dtype)
  w2, b2, cot = random(rng, (hidden, n), dtype), random(rng, (n,), dtype), random(rng, (m, n), dtype)
  f = lambda x, w1: pallas_gemm.mlp(x, w1, b1, w2, b2, activation, backend=backend)
  h_ref = reference(x, w1, bias=b1, activation=activation)
  assert relative_error(f(x, w1), reference(h_ref, w2, bias=b2)) <= 2 * tolerance(dtype, None, hidden)
  loss = lambda x, w1: jnp.sum(f(x, w1).astype(np.float32) * cot.astype(np.float32))
  dx, dw1 = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w1)
  z = reference(x, w1, bias=b1)
  dz = gated_gradient(z, np.asarray(w2, np.float64), cot, activation)
  assert relative_error(dx, dz @ np.asarray(w1, np.float64).T) <= 4 * tolerance(dtype, None, hidden)
  assert relative_error(dw1, np.asarray(x, np.float64).T @ dz) <= 4 * tolerance(dtype, None, m)


@pytest.mark.gpu
def test_gpu_runs_on_gpu():
  assert ON_GPU and jax.devices()[0].platform == "gpu"
