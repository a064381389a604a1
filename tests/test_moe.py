"""pallas_gemm.moe_mlp and the routers: the layer and its four gradients against the dense
float64 reference (`testing.reference.moe_reference`), on each grouped-GEMM backend
("xla"; "mosaic" in Mosaic GPU's interpreter on a CPU, natively on a GPU), edge cases of
routing, NaN confinement, bad input, and that the layer's program never scatters rows."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_gemm
from pallas_gemm import moe
from pallas_gemm.moe import layer
from pallas_gemm.testing.reference import (moe_fp8_tolerance, moe_fp8_training_tolerance,
                                           moe_reference, moe_tolerance, relative_error)

from conftest import ON_GPU, jax_config, random

BF16 = jnp.bfloat16


def _problem(rng, t, d, f, e, k, dtype=BF16, *, gated=True, ids=None):
  x = random(rng, (t, d), dtype)
  w_gate_up = random(rng, (e, d, 2 * f if gated else f), np.float32) / np.sqrt(d)
  w_down = random(rng, (e, f, d), np.float32) / np.sqrt(f)
  if ids is None:
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]) if t else np.zeros((0, k))
  weights = rng.random((t, k)).astype(np.float32)
  return (jnp.asarray(x), jnp.asarray(weights), jnp.asarray(ids, jnp.int32),
          jnp.asarray(w_gate_up, dtype), jnp.asarray(w_down, dtype))


def _check(args, *, backend, activation="swiglu", grads=True, precision=None):
  """The layer's output and (with grads) its four gradients within the table's bound."""
  x, weights, ids, wgu, wd = args
  layer = functools.partial(pallas_gemm.moe_mlp, activation=activation, backend=backend,
                            precision=precision)
  # Jitted, and each result complete before the next step: Mosaic GPU's interpreter runs
  # the kernels on worker threads, and eager ops dispatched (or the reference traced with
  # x64 on) while they ran deadlocked. conftest's jax_config sets x64 process-wide.
  out, vjp = jax.vjp(jax.jit(lambda x, w, a, b: layer(x, w, ids, a, b)), x, weights, wgu, wd)
  out = jax.block_until_ready(out)
  ct = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), out.dtype)
  grad_values = jax.block_until_ready(vjp(ct) if grads else ())
  f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
  with jax_config("jax_enable_x64", True):
    ref, ref_vjp = jax.vjp(lambda x, w, a, b: moe_reference(x, w, ids, a, b, activation),
                           f64(x), f64(weights), f64(wgu), f64(wd))
    ref_grads = ref_vjp(f64(ct)) if grads else ()
  bound = moe_fp8_training_tolerance if precision == "fp8" else moe_tolerance
  tol = bound(x.dtype, x.shape[-1], wd.shape[1])
  assert out.dtype == x.dtype and out.shape == x.shape
  assert relative_error(out, ref) <= tol
  for name, g, r in zip(("x", "topk_weights", "w_gate_up", "w_down"), grad_values, ref_grads):
    assert relative_error(g, r) <= tol, name


def _backends():
  return ["xla", "mosaic"]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_layer_and_gradients(rng, backend, activation):
  # T, D, F that divide no tile; some experts get no token.
  args = _problem(rng, 37, 40, 24, 6, 3, gated=activation == "swiglu")
  _check(args, backend=backend, activation=activation)


@pytest.mark.parametrize("backend", _backends())
def test_experts_wider_than_the_model(rng, backend):
  # F > D, with T, D, F that divide no tile: the four gradients as where F < D.
  _check(_problem(rng, 29, 24, 40, 5, 2), backend=backend)


@pytest.mark.parametrize("activation, ids", [
    ("swiglu", None), ("geglu", None),
    ("swiglu", "one_expert"),  # every pair in one group: all other experts empty
])
def test_fused_gate(rng, activation, ids):
  # F a multiple of 64: the first GEMM and the activation run as the gated kernel (its
  # a from f32 products, h written for the backward), T and D still ragged.
  t, e, k = 37, 6, 3
  if ids == "one_expert":
    ids = np.full((t, k), 4)
  args = _problem(rng, t, 40, 64, e, k, ids=ids)
  plan = moe.layer.Plan(activation=activation, precision=None, out_dtype=BF16,
                        backend="mosaic")
  assert moe.layer.fused_gate(plan, args[0], args[3])
  _check(args, backend="mosaic", activation=activation)


@pytest.mark.parametrize("activation", ["geglu", "silu"])
def test_other_activations(rng, activation):
  _check(_problem(rng, 19, 16, 8, 4, 2, gated=activation == "geglu"), backend="xla",
         activation=activation)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dtypes(rng, dtype):
  _check(_problem(rng, 21, 24, 16, 5, 2, dtype), backend="xla")


@pytest.mark.parametrize("k", [1, 8])
def test_top_k_extremes(rng, k):
  _check(_problem(rng, 17, 16, 8, 8, k), backend="xla")


def test_every_token_to_one_expert(rng):
  t, k = 13, 2
  ids = np.full((t, k), 3)  # the same id twice in a row: both pairs count
  _check(_problem(rng, t, 16, 8, 5, k, ids=ids), backend="mosaic" if ON_GPU else "xla")


def test_ids_outside_the_experts_route_nowhere(rng):
  t, e, k = 15, 4, 3
  x, weights, ids, wgu, wd = _problem(rng, t, 16, 8, e, k)
  ids = ids.at[::3, 0].set(-1).at[1::4, 2].set(e)
  _check((x, weights, ids, wgu, wd), backend="xla")
  # and those pairs get no weight gradient
  dw = jax.grad(lambda w: jnp.sum(pallas_gemm.moe_mlp(x, w, ids, wgu, wd).astype(jnp.float32)))(
      weights)
  assert np.all(np.asarray(dw)[np.asarray((ids < 0) | (ids >= e))] == 0)
  # whatever their weight: Inf and NaN there change nothing
  nowhere = np.asarray((ids < 0) | (ids >= e))
  odd = jnp.where(nowhere, jnp.asarray(np.resize([np.inf, np.nan, -np.inf], ids.shape),
                                       weights.dtype), weights)
  np.testing.assert_array_equal(np.asarray(pallas_gemm.moe_mlp(x, odd, ids, wgu, wd)),
                                np.asarray(pallas_gemm.moe_mlp(x, weights, ids, wgu, wd)))


def test_inf_weight_reaches_its_expert_only(rng):
  # Inf times that expert's output row: +-Inf in the token's row, NaN nowhere (its other
  # pairs, and every other token, stay as IEEE arithmetic has them: finite).
  x, weights, ids, wgu, wd = _problem(rng, 12, 16, 8, 4, 2)
  weights = weights.at[3, 1].set(jnp.inf)
  out = np.asarray(pallas_gemm.moe_mlp(x, weights, ids, wgu, wd, backend="xla"))
  assert np.all(np.isinf(out[3])), out[3]
  assert np.all(np.isfinite(np.delete(out, 3, axis=0)))


def test_nan_stays_in_its_token(rng):
  x, weights, ids, wgu, wd = _problem(rng, 12, 16, 8, 4, 2)
  x = x.at[5, 3].set(jnp.nan)
  out = np.asarray(jax.jit(pallas_gemm.moe_mlp)(x, weights, ids, wgu, wd), np.float32)
  assert np.all(np.isnan(out[5]))
  assert np.all(np.isfinite(np.delete(out, 5, axis=0)))


def test_no_tokens_and_leading_dims(rng):
  x, weights, ids, wgu, wd = _problem(rng, 0, 16, 8, 4, 2)
  assert pallas_gemm.moe_mlp(x, weights, ids, wgu, wd).shape == (0, 16)
  x, weights, ids, wgu, wd = _problem(rng, 12, 16, 8, 4, 2)
  flat = pallas_gemm.moe_mlp(x, weights, ids, wgu, wd)
  batched = pallas_gemm.moe_mlp(x.reshape(3, 4, 16), weights.reshape(3, 4, 2),
                                ids.reshape(3, 4, 2), wgu, wd)
  np.testing.assert_array_equal(np.asarray(batched).reshape(12, 16), np.asarray(flat))


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "sorted"])
def test_program_gathers_and_never_scatters_rows(rng, monkeypatch, counted):
  """The forward and backward move rows only by gathers: the only scatters are the
  sorted dispatch's, of R int32s (the permutation's inverse, the group sizes; layer.py);
  the counted dispatch (few pairs) has none."""
  if not counted:
    monkeypatch.setattr(layer, "RANKED_MAX_PAIRS", 0)
  x, weights, ids, wgu, wd = _problem(rng, 24, 16, 8, 4, 2)

  def step(x, w, a, b):
    return jax.grad(lambda *p: jnp.sum(pallas_gemm.moe_mlp(p[0], p[1], ids, p[2], p[3],
                                                           backend="xla")
                                       .astype(jnp.float32)), argnums=(0, 1, 2, 3))(x, w, a, b)

  text = str(jax.make_jaxpr(step)(x, weights, wgu, wd))
  # every scatter's result: "name:dtype[shape] = scatter..." (nested jaxprs included)
  scatters = re.findall(r"\w+:(\w+)\[([\d,]*)\] = scatter", text)
  assert bool(scatters) != counted, "the sorted dispatch scatters R int32s: the check sees it"
  assert all(dtype.startswith("i") and "," not in shape for dtype, shape in scatters), scatters


@pytest.mark.parametrize("t, k, e", [(16, 8, 8), (64, 8, 128), (5, 3, 4), (1, 1, 1),
                                     (7, 1, 3), (0, 2, 4)])
def test_counted_dispatch_is_the_stable_sort(rng, monkeypatch, t, k, e):
  # Few pairs are dispatched by counting, many by a sort: the same Dispatch, ties in pair
  # order, ids outside [0, E) after every group.
  ids = rng.integers(-2, e + 2, (t, k)).astype(np.int32)
  assert t * k <= layer.RANKED_MAX_PAIRS  # moe_mlp counts for these shapes
  counted = layer.dispatch(ids, e)
  monkeypatch.setattr(layer, "RANKED_MAX_PAIRS", 0)
  sorted_ = layer.dispatch(ids, e)
  key = np.where((ids >= 0) & (ids < e), ids, e).reshape(-1)
  order = np.argsort(key, kind="stable")
  for d in (counted, sorted_):
    np.testing.assert_array_equal(d.order, order)
    np.testing.assert_array_equal(d.token, order // k)
    np.testing.assert_array_equal(d.inverse, np.argsort(order))
    np.testing.assert_array_equal(d.group_sizes, np.bincount(key, minlength=e + 1)[:e])


@pytest.mark.parametrize("change, error, match", [
    (dict(x=np.zeros((4, 16), np.int32)), TypeError, "x.dtype"),
    (dict(topk_ids=np.zeros((4, 2), np.float32)), TypeError, "topk_ids.dtype"),
    (dict(topk_ids=np.zeros((4, 3), np.int32)), ValueError, "topk_ids must have"),
    (dict(topk_weights=np.zeros((5, 2), np.float32)), ValueError, "topk_weights"),
    (dict(w_gate_up=np.zeros((4, 16, 8), BF16)), ValueError, r"w_gate_up must be \(E, D, 2F\)"),
    (dict(w_down=np.zeros((4, 8, 15), BF16)), ValueError, "w_down must be"),
    (dict(w_down=np.zeros((4, 8, 16), np.float32)), TypeError, "w_down.dtype"),
    (dict(activation="relu"), ValueError, "activation"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(x=[1.0]), TypeError, "x must be an array"),
])
def test_bad_input(change, error, match):
  args = dict(x=np.zeros((4, 16), BF16), topk_weights=np.zeros((4, 2), np.float32),
              topk_ids=np.zeros((4, 2), np.int32), w_gate_up=np.zeros((4, 16, 16), BF16),
              w_down=np.zeros((4, 8, 16), BF16))
  args.update(change)
  kwargs = {k: args.pop(k) for k in ("activation", "backend") if k in args}
  with pytest.raises(error, match=match):
    pallas_gemm.moe_mlp(**args, **kwargs)


# ----------------------------------------------------------------------------- fp8 inference


@pytest.mark.parametrize("backend", _backends())
def test_fp8_inference(rng, backend):
  x, weights, ids, wgu, wd = _problem(rng, 29, 256, 128, 4, 2)
  gate_up8, down8 = moe.quantize_experts(wgu, wd)
  out = jax.block_until_ready(jax.jit(functools.partial(pallas_gemm.moe_mlp, backend=backend))(
      x, weights, ids, gate_up8, down8))  # before x64 goes on (see `_check`)
  assert out.dtype == x.dtype
  dequantized = [jnp.swapaxes(pallas_gemm.dequantize(*p), 1, 2) for p in (gate_up8, down8)]
  with jax_config("jax_enable_x64", True):
    f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
    ref = moe_reference(f64(x), f64(weights), ids, *map(f64, dequantized))
  err = relative_error(out, ref)
  assert err <= moe_fp8_tolerance(x.dtype, 256, 128), err


@pytest.mark.parametrize("width", [256, 192])  # 2F in whole scale blocks, and not
def test_quantize_experts_is_quantize_of_the_transposed_weights(rng, width):
  _, _, _, wgu, wd = _problem(rng, 8, 256, 128, 3, 1)
  wgu = jnp.asarray(random(rng, (3, 256, width), np.float32) * 4, BF16)
  for w, (values, scales) in zip((wgu, wd), moe.quantize_experts(wgu, wd)):
    want_values, want_scales = pallas_gemm.quantize(jnp.swapaxes(w, 1, 2),
                                                    block_shape=(128, 128))
    np.testing.assert_array_equal(np.asarray(values.astype(np.float32)),
                                  np.asarray(want_values.astype(np.float32)))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))


def test_fp8_inference_fuses_the_gate_up_to_its_widest_f(as_on_a_gpu):
  # The fused first GEMM + activation + quantize where F <= FUSED_GATE_MAX_F; three
  # passes (the first GEMM on wider tiles) above it.
  from pallas_gemm.moe import fp8 as moe_fp8  # noqa: PLC0415
  plan = moe.layer.Plan(activation="swiglu", precision=None, out_dtype=BF16, backend="auto")
  rows8 = jnp.zeros((64, 128), jnp.float8_e4m3fn)
  for f, fused in ((128, True), (moe_fp8.FUSED_GATE_MAX_F, True),
                   (moe_fp8.FUSED_GATE_MAX_F + 128, False)):
    gu8 = jax.ShapeDtypeStruct((2, 2 * f, 128), jnp.float8_e4m3fn)
    assert moe_fp8._fused_gate(plan, rows8, gu8, jnp.float8_e4m3fn) == fused, f


def test_fp8_inference_has_no_gradient(rng):
  x, weights, ids, wgu, wd = _problem(rng, 8, 128, 128, 2, 1)
  experts = moe.quantize_experts(wgu, wd)
  with pytest.raises(TypeError, match="inference only"):
    jax.grad(lambda x: jnp.sum(pallas_gemm.moe_mlp(x, weights, ids, *experts)
                               .astype(jnp.float32)))(x)


def test_fp8_bad_input(rng):
  x, weights, ids, wgu, wd = _problem(rng, 8, 128, 128, 2, 1)
  (gu8, gu_s), down8 = moe.quantize_experts(wgu, wd)
  with pytest.raises(TypeError, match="w_gate_up: with fp8 experts"):
    pallas_gemm.moe_mlp(x, weights, ids, wgu, down8)
  with pytest.raises(ValueError, match="w_gate_up scales must be 128x128 blocks"):
    pallas_gemm.moe_mlp(x, weights, ids, (gu8, gu_s[:, :1]), down8)
  with pytest.raises(TypeError, match="values must be float8"):
    pallas_gemm.moe_mlp(x, weights, ids, (gu8.astype(BF16), gu_s), down8)
  with pytest.raises(ValueError, match="multiple of 128"):
    moe.quantize_experts(wgu[:, :100], wd)


# ----------------------------------------------------------------------------- fp8 training


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_fp8_training(rng, backend, activation):
  # The output and the four gradients of precision="fp8" against the float64 layer of the
  # bf16 weights; ids outside [0, E) route nowhere here too.
  ids = np.stack([rng.permutation(4)[:2] for _ in range(29)])
  ids[3] = [-1, 4]
  _check(_problem(rng, 29, 256, 128, 4, 2, gated=activation == "swiglu", ids=ids),
         backend=backend, activation=activation, precision="fp8")


def test_fp8_training_bad_input(rng):
  x, weights, ids, wgu, wd = _problem(rng, 8, 128, 64, 2, 1)
  with pytest.raises(ValueError, match="D and F multiples of 128"):
    pallas_gemm.moe_mlp(x, weights, ids, wgu, wd, precision="fp8")
  x, weights, ids, wgu, wd = _problem(rng, 8, 128, 128, 2, 1)
  with pytest.raises(ValueError, match="master weights"):
    pallas_gemm.moe_mlp(x, weights, ids, *moe.quantize_experts(wgu, wd), precision="fp8")


def _fp8_step(args, activation, backend, fp8_weights):
  """precision="fp8"'s output and four gradients, the weights quantized in the call (None)
  or given as fp8_weights."""
  x, weights, ids, wgu, wd = args
  layer = functools.partial(pallas_gemm.moe_mlp, activation=activation, backend=backend,
                            precision="fp8")

  def step(x, w, a, b, cached):
    out, vjp = jax.vjp(lambda x, w, a, b: layer(x, w, ids, a, b, fp8_weights=cached),
                       x, w, a, b)
    return (out, *vjp(jnp.ones_like(out) + out))  # a cotangent that depends on the output

  return jax.block_until_ready(jax.jit(step)(x, weights, wgu, wd, fp8_weights))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("activation, paired", [("swiglu", False), ("swiglu", True),
                                                ("gelu", False)])
def test_fp8_training_on_cached_weights_is_the_same_step(rng, backend, activation, paired):
  # Weights quantized once (quantize_experts_for_training) give the very numbers of the
  # form that quantizes them in the call: output and all four gradients, bit for bit.
  args = _problem(rng, 29, 256, 128, 4, 2, gated=activation == "swiglu")
  if paired:  # w_gate_up as (E, D, 2, F), the tensor-parallel layout
    args = (*args[:3], args[3].reshape(4, 256, 2, 128), args[4])
  want = _fp8_step(args, activation, backend, None)
  got = _fp8_step(args, activation, backend, moe.quantize_experts_for_training(*args[3:]))
  for name, a, b in zip(("out", "x", "topk_weights", "w_gate_up", "w_down"), got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=name)


def test_fp8_cached_weights_get_no_gradient(rng):
  x, weights, ids, wgu, wd = _problem(rng, 8, 128, 128, 2, 1)
  cached = moe.quantize_experts_for_training(wgu, wd)
  grads = jax.grad(lambda c: jnp.sum(pallas_gemm.moe_mlp(
      x, weights, ids, wgu, wd, precision="fp8", backend="xla", fp8_weights=c)
      .astype(jnp.float32)))(cached)
  for g in jax.tree.leaves(grads):
    assert not np.any(np.asarray(g, np.float32))


def test_fp8_cached_weights_bad_input(rng):
  x, weights, ids, wgu, wd = _problem(rng, 8, 128, 128, 2, 1)
  cached = moe.quantize_experts_for_training(wgu, wd)
  layer = functools.partial(pallas_gemm.moe_mlp, x, weights, ids, wgu, wd)
  with pytest.raises(ValueError, match="fp8_weights is for precision='fp8'"):
    layer(fp8_weights=cached)
  with pytest.raises(TypeError, match="must be the pair quantize_experts_for_training"):
    layer(precision="fp8", fp8_weights=moe.quantize_experts(wgu, wd))
  other = moe.quantize_experts_for_training(jnp.concatenate([wgu, wgu]),
                                            jnp.concatenate([wd, wd]))
  with pytest.raises(ValueError, match=r"fp8_weights\[0\] .* must have shapes"):
    layer(precision="fp8", fp8_weights=other)
  as_f32 = moe.quantize_experts_for_training(wgu.astype(np.float32), wd.astype(np.float32))
  with pytest.raises(TypeError, match="made from float32 weights"):
    layer(precision="fp8", fp8_weights=as_f32)
  with pytest.raises(ValueError, match="multiples of 128"):
    moe.quantize_experts_for_training(wgu[:, :, :64], wd)
  with pytest.raises(TypeError, match=r"w_gate_up.dtype must be .* got int32"):
    moe.quantize_experts_for_training(wgu.astype(jnp.int32), wd)
  with pytest.raises(TypeError, match="w_down must be an array; got list"):
    moe.quantize_experts_for_training(wgu, [[1.0]])
  with pytest.raises(ValueError, match=r"E, D = \(2, 128\) from w_down"):
    moe.quantize_experts_for_training(jnp.concatenate([wgu, wgu]), wd)
  with pytest.raises(TypeError, match=r"got tuple of \(tuple, tuple\)"):
    layer(precision="fp8", fp8_weights=moe.quantize_experts(wgu, wd))


# ----------------------------------------------------------------------------- routers


def test_softmax_topk_is_mixtrals(rng):
  logits = jnp.asarray(rng.standard_normal((9, 8)), jnp.float32)
  weights, ids = moe.softmax_topk(logits, 2)
  top, top_ids = jax.lax.top_k(logits, 2)  # Mixtral: softmax over the k largest logits
  np.testing.assert_allclose(weights, jax.nn.softmax(top, axis=-1), rtol=1e-6)
  np.testing.assert_array_equal(ids, top_ids)
  raw, _ = moe.softmax_topk(logits, 2, renormalize=False)
  np.testing.assert_allclose(raw, jnp.take_along_axis(jax.nn.softmax(logits), ids, -1),
                             rtol=1e-6)


def test_sigmoid_topk_is_deepseek_v3s(rng):
  t, e, k, groups, best_groups = 7, 16, 4, 4, 2
  logits = rng.standard_normal((t, e)).astype(np.float32)
  bias = rng.standard_normal(e).astype(np.float32)
  weights, ids = moe.sigmoid_topk(jnp.asarray(logits), k, bias=jnp.asarray(bias), scale=2.5,
                                  num_groups=groups, topk_groups=best_groups)
  s = 1 / (1 + np.exp(-logits.astype(np.float64)))
  for row in range(t):  # the reference, token by token
    choice = (s[row] + bias).reshape(groups, e // groups)
    group_score = np.sort(choice, axis=1)[:, -2:].sum(axis=1)
    allowed = np.argsort(-group_score)[:best_groups]
    masked = np.full(e, -np.inf)
    for g in allowed:
      masked[g * (e // groups):(g + 1) * (e // groups)] = choice[g]
    expect = np.argsort(-masked)[:k]
    assert set(np.asarray(ids[row]).tolist()) == set(expect.tolist())
    w = s[row, np.asarray(ids[row])]
    np.testing.assert_allclose(weights[row], w / w.sum() * 2.5, rtol=1e-5)


def test_load_balancing_loss(rng):
  e = 4
  uniform = jnp.zeros((8, e))
  ids = jnp.asarray(np.arange(16).reshape(8, 2) % e, jnp.int32)
  np.testing.assert_allclose(moe.load_balancing_loss(uniform, ids), 1.0, rtol=1e-6)
  skewed = jnp.asarray(rng.standard_normal((8, e)), jnp.float32).at[:, 0].add(5.0)
  ids0 = jnp.zeros((8, 2), jnp.int32)
  assert moe.load_balancing_loss(skewed, ids0) > 2.0  # all pairs on the most probable
  assert jnp.isfinite(jax.grad(moe.load_balancing_loss)(skewed, ids0)).all()


@pytest.mark.parametrize("k", [0, 9, True])
def test_router_bad_k(k):
  with pytest.raises(ValueError, match="k must be"):
    moe.softmax_topk(jnp.zeros((3, 8)), k)
