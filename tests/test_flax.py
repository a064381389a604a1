"""Flax layers with ``dot_general=pallas_gemm``'s: the same results as the stock layers.

Each layer is built twice from the same arguments (ours with `dot_general=`, the stock one
without); both run on our parameters, the stock one in float64 (jax.enable_x64) as the
reference. The jaxpr shows that the kernel path ran: one `pallas_gemm` primitive per
projection and no growth of `FALLBACKS`.
"""

import functools

import pytest

flax = pytest.importorskip("flax", reason="flax not installed (pip install '.[flax]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from conftest import random, skip_reason  # noqa: E402
from pallas_gemm.matmul import auto  # noqa: E402
from pallas_gemm.testing.reference import relative_error, tolerance  # noqa: E402

from pallas_gemm.matmul import lax_dot as dg

HIGHEST = jax.lax.Precision.HIGHEST
BF16 = jnp.bfloat16
# The kernel backends (Pallas ones in interpret mode on a CPU): one tiny layer each.
PALLAS = [name for name in auto.BACKENDS if name != "xla"]
# (dtype of the layer and its inputs, precision): IEEE f32 and bf16.
DTYPES = [(np.float32, HIGHEST), (BF16, None)]
DTYPE_IDS = ["f32-highest", "bf16"]


def _ours(backend="xla"):
  return functools.partial(dg.dot_general, backend=backend)


def _to64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _gemm_calls(fn, *args) -> int:
  """How many gemm primitives `fn(*args)` binds, asserting that nothing fell back."""
  before = sum(dg.FALLBACKS.values())
  jaxpr = jax.make_jaxpr(fn)(*args)
  assert sum(dg.FALLBACKS.values()) == before, f"fell back: {dict(dg.FALLBACKS)}"
  return str(jaxpr).count("pallas_gemm[")


def _compare(name, out, ref, dtype, precision, k):
  """`out` against the float64 `ref`, one norm over all leaves, within the table's bound.

  One norm, not one per leaf: in attention the key projection's bias has a zero gradient in
  exact arithmetic (softmax ignores a shift shared by all keys), so a per-leaf relative error
  would divide rounding noise by ~0.
  """
  assert jax.tree.structure(out) == jax.tree.structure(ref), name
  assert [o.shape for o in jax.tree.leaves(out)] == [r.shape for r in jax.tree.leaves(ref)], name
  out_flat = np.concatenate([np.asarray(o, np.float64).ravel() for o in jax.tree.leaves(out)])
  ref_flat = np.concatenate([np.asarray(r, np.float64).ravel() for r in jax.tree.leaves(ref)])
  out_dtype = jax.tree.leaves(out)[0].dtype
  err, tol = relative_error(out_flat, ref_flat), tolerance(dtype, precision, k, out_dtype)
  assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


def _check_linen(make, x_shape, dtype, precision, k, rng, *, gemms, backend="xla"):
  """make(dot_general, dtype) builds the layer: ours in `dtype`, the stock one (None) in
  float64 on the same parameters (held in `dtype`, so both layers see the same values)."""
  ours, stock = make(_ours(backend), dtype), make(None, np.float64)
  x = jnp.asarray(random(rng, x_shape, dtype))
  params = ours.init(jax.random.key(0), x)
  out_shape = jax.eval_shape(ours.apply, params, x).shape
  weight = jnp.asarray(random(rng, out_shape, np.float32))

  def loss(module):
    return lambda p, x: jnp.sum(module.apply(p, x).astype(jnp.float32) * weight)

  assert _gemm_calls(ours.apply, params, x) == gemms
  out = ours.apply(params, x)
  grads = jax.grad(loss(ours), (0, 1))(params, x)
  with jax.enable_x64(True):
    ref = stock.apply(_to64(params), _to64(x))
    ref_grads = jax.grad(loss(stock), (0, 1))(_to64(params), _to64(x))
  assert out.dtype == dtype
  _compare("forward", out, ref, dtype, precision, k)
  # A gradient's contraction runs over the batch and output features: a bound on its K.
  for name, g, r in zip(("d params", "d inputs"), grads, ref_grads):
    _compare(name, g, r, dtype, precision, max(k, x.size))


@pytest.mark.parametrize("dtype,precision", DTYPES, ids=DTYPE_IDS)
def test_dense(dtype, precision, rng):
  make = lambda dot, dt: nn.Dense(6, dtype=dt, param_dtype=dtype, precision=precision,  # noqa: E731
                                  dot_general=dot)
  _check_linen(make, (2, 3, 8), dtype, precision, 8, rng, gemms=1)


@pytest.mark.parametrize("dtype,precision", DTYPES, ids=DTYPE_IDS)
def test_dense_general(dtype, precision, rng):
  make = lambda dot, dt: nn.DenseGeneral((3, 4), axis=(-2, -1), dtype=dt,  # noqa: E731
                                         param_dtype=dtype, precision=precision,
                                         dot_general=dot)
  _check_linen(make, (2, 5, 6), dtype, precision, 30, rng, gemms=1)


def test_dense_general_batch_dims(rng):
  """batch_dims: a kernel per batch entry, one batched GEMM."""
  make = lambda dot, dt: nn.DenseGeneral(4, axis=-1, batch_dims=(0,), dtype=dt,  # noqa: E731
                                         precision=HIGHEST, dot_general=dot)
  _check_linen(make, (2, 3, 5), np.float32, HIGHEST, 5, rng, gemms=1)


def test_multi_head_attention(rng):
  """q/k/v and out projections through qkv_dot_general/out_dot_general, the two attention
  einsums through dot_product_attention's einsum_dot_general: six GEMMs."""
  def make(dot, dtype):
    attention = functools.partial(nn.dot_product_attention, einsum_dot_general=dot)
    return nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, dtype=dtype, precision=HIGHEST, qkv_dot_general=dot,
        out_dot_general=dot, attention_fn=attention if dot else nn.dot_product_attention)
  _check_linen(make, (2, 5, 6), np.float32, HIGHEST, 8, rng, gemms=6)


@pytest.mark.parametrize("pallas_backend", PALLAS)
def test_dense_pallas_interpret(pallas_backend, rng):
  """A tiny Dense per kernel backend; xla runs every other test here."""
  dtype = BF16 if not skip_reason(pallas_backend, BF16) else np.float32
  reason = skip_reason(pallas_backend, dtype)
  if reason:
    pytest.skip(reason)
  make = lambda dot, dt: nn.Dense(6, dtype=dt, param_dtype=dtype, dot_general=dot)  # noqa: E731
  _check_linen(make, (3, 8), dtype, None, 8, rng, gemms=1, backend=pallas_backend)


@pytest.mark.parametrize("dtype,precision", DTYPES, ids=DTYPE_IDS)
def test_nnx_linear(dtype, precision, rng):
  kwargs = dict(param_dtype=dtype, precision=precision, rngs=nnx.Rngs(0))
  ours = nnx.Linear(8, 6, dtype=dtype, dot_general=_ours(), **kwargs)
  graphdef, state = nnx.split(ours)
  with jax.enable_x64(True):  # the stock layer computes in float64 on our parameters
    stock_graphdef, _ = nnx.split(nnx.Linear(8, 6, dtype=np.float64, **kwargs))
  x = jnp.asarray(random(rng, (2, 3, 8), dtype))
  weight = jnp.asarray(random(rng, (2, 3, 6), np.float32))

  def loss(graphdef):
    return lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x).astype(jnp.float32) * weight)

  assert _gemm_calls(lambda s, x: nnx.merge(graphdef, s)(x), state, x) == 1
  out = ours(x)
  assert out.dtype == dtype
  grads = jax.grad(loss(graphdef), (0, 1))(state, x)
  with jax.enable_x64(True):
    state64 = _to64(state)
    ref = nnx.merge(stock_graphdef, state64)(_to64(x))
    ref_grads = jax.grad(loss(stock_graphdef), (0, 1))(state64, _to64(x))
  _compare("forward", out, ref, dtype, precision, 8)
  for name, g, r in zip(("d params", "d inputs"), grads, ref_grads):
    _compare(name, g, r, dtype, precision, x.size)
