"""Flax layers with ``dot_general=pallas_gemm``'s: the same results as the stock layers.

Each layer is built twice from the same arguments (ours with `dot_general=`, the stock one
without); both run on our parameters, the stock one in float64 (jax.enable_x64) as the
reference. The jaxpr shows that the kernel path ran: one `pallas_gemm` primitive per
projection and no growth of `FALLBACKS`.

`MoEBlock` (pallas_gemm.moe.flax_block): the block is `moe_mlp` on its own parameters and
routing, it trains under AdamW, and it sows the load-balancing loss.
"""

import functools

import pytest

flax = pytest.importorskip("flax", reason="flax not installed (pip install '.[flax]')")

import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import pallas_gemm  # noqa: E402
from conftest import random, skip_reason  # noqa: E402
from pallas_gemm.matmul import auto  # noqa: E402
from pallas_gemm.moe import sigmoid_topk, softmax_topk  # noqa: E402
from pallas_gemm.moe.flax_block import ROUTERS, MoEBlock  # noqa: E402
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


# ----------------------------------------------------------------------------- MoEBlock


def _moe_block(**kwargs):
  """A tiny block on the XLA grouped GEMM: 4 experts, 2 per token, hidden width 16."""
  return MoEBlock(num_experts=4, top_k=2, d_ff=16, backend="xla", **kwargs)


@pytest.mark.parametrize("router", ROUTERS)
def test_moe_block_is_moe_mlp(router, rng):
  """The block's output is moe_mlp's on the block's own parameters and routing, bit for
  bit: the module adds routing and casts, no arithmetic of its own."""
  block = _moe_block(router=router)
  x = jnp.asarray(random(rng, (2, 7, 12), np.float32))
  variables = block.init(jax.random.key(0), x)
  params = variables["params"]
  logits = jnp.dot(x, params["router"]["kernel"])
  if router == "softmax":
    weights, ids = softmax_topk(logits, 2)
  else:  # a nonzero bias, so that the check covers its part in the choice
    bias = jnp.asarray(random(rng, (4,), np.float32))
    variables = {**variables, "router_bias": {"bias": bias}}
    weights, ids = sigmoid_topk(logits, 2, bias=bias)
  out = block.apply(variables, x)
  bf16 = lambda a: a.astype(BF16)  # noqa: E731
  ref = pallas_gemm.moe_mlp(bf16(x), weights, ids, bf16(params["w_gate_up"]),
                            bf16(params["w_down"]), backend="xla")
  assert out.dtype == BF16 and out.shape == x.shape
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_moe_block_sigmoid_bias_is_not_a_param(rng):
  """The sigmoid router's bias lives in "router_bias" (zeros at init, outside the
  optimizer's reach) and steers the choice: a large bias on expert 3 gives it every token."""
  block = _moe_block(router="sigmoid")
  x = jnp.asarray(random(rng, (9, 12), np.float32))
  variables = block.init(jax.random.key(0), x)
  assert set(variables) == {"params", "router_bias"}
  assert set(variables["params"]) == {"router", "w_gate_up", "w_down"}
  np.testing.assert_array_equal(variables["router_bias"]["bias"], np.zeros(4, np.float32))
  biased = {**variables, "router_bias": {"bias": jnp.array([0.0, 0.0, 0.0, 10.0])}}
  _, state = block.apply(biased, x, mutable=["intermediates"])
  load, = state["intermediates"]["expert_load"]
  assert float(load[3]) == 0.5  # one of each token's two slots
  assert float(jnp.sum(load)) == 1.0


def test_moe_block_load_balancing_loss(rng):
  """The sown loss is finite, and 1 for uniform routing (a zero router: every expert equally
  probable for every token)."""
  block = _moe_block()
  x = jnp.asarray(random(rng, (3, 5, 12), np.float32))
  variables = block.init(jax.random.key(0), x)
  _, state = block.apply(variables, x, mutable=["intermediates"])
  aux, = state["intermediates"]["load_balancing_loss"]
  assert aux.shape == () and np.isfinite(aux) and float(aux) > 0
  router = jax.tree.map(jnp.zeros_like, variables["params"]["router"])
  uniform = {"params": {**variables["params"], "router": router}}
  _, state = block.apply(uniform, x, mutable=["intermediates"])
  aux, = state["intermediates"]["load_balancing_loss"]
  np.testing.assert_allclose(float(aux), 1.0, rtol=1e-6)


class _MoERegressor(nn.Module):
  """A tiny model around the block: an input projection, then the block."""

  @nn.compact
  def __call__(self, x):
    return _moe_block()(nn.Dense(12)(x))


def test_moe_block_trains():
  """A few AdamW steps on a fixed regression task lower the loss (mean squared error plus
  the sown load-balancing loss, as a training loop adds it)."""
  kx, kt = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (64, 8))
  y = jnp.tanh(x @ jax.random.normal(kt, (8, 12)))
  model = _MoERegressor()
  params = model.init(jax.random.key(1), x)["params"]
  opt = optax.adamw(1e-2)

  def loss_fn(params):
    out, state = model.apply({"params": params}, x, mutable=["intermediates"])
    aux = sum(jax.tree.leaves(state["intermediates"]))
    return jnp.mean((out.astype(jnp.float32) - y) ** 2) + 1e-2 * aux

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = opt.init(params), []
  for _ in range(15):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_moe_package_does_not_import_flax():
  """flax is an optional extra: only flax_block imports it."""
  code = "import sys, pallas_gemm.moe; sys.exit('flax' in sys.modules)"
  root = pathlib.Path(__file__).resolve().parent.parent  # `-c` imports from the cwd
  assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0
