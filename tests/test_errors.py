"""Bad input: a ValueError/TypeError that names the argument, before anything is traced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_gemm
import pallas_gemm.matmul.triton
import pallas_gemm.matmul.xla
from pallas_gemm import gemm

A = jnp.ones((4, 8), jnp.float32)
B = jnp.ones((8, 5), jnp.float32)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(a=jnp.ones((8,))), ValueError, r"a must have rank >= 2.*\(8,\)"),
    (dict(b=jnp.ones((8,))), ValueError, r"b must have rank >= 2.*\(8,\)"),
    (dict(b=jnp.ones((7, 5))), ValueError, r"K=8.*K=7"),
    (dict(b=jnp.ones((8, 5)), transpose_b=True), ValueError, r"contracting dimensions differ"),
    (dict(a=jnp.ones((2, 4, 8)), b=jnp.ones((3, 8, 5))), ValueError, r"batch dimensions of b"),
    (dict(c=jnp.ones((4, 6)), beta=1.0), ValueError, r"c must broadcast to the output shape \(4, 5\)"),
    (dict(beta=1.0), ValueError, r"beta=1.0 needs c"),
    (dict(a=jnp.ones((4, 8), jnp.int32)), TypeError, r"a.dtype must be one of .*int32"),
    (dict(b=np.ones((8, 5), np.float64)), TypeError, r"b.dtype must be one of .*float64"),
    (dict(a=[[1.0]]), TypeError, r"a must be an array.*list"),
    (dict(c=jnp.ones((4, 5), jnp.int32), beta=1.0), TypeError, r"c must be a floating-point"),
    (dict(alpha=jnp.float32(2.0)), TypeError, r"alpha must be a Python float"),
    (dict(beta="1"), TypeError, r"beta must be a Python float"),
    (dict(transpose_a=1), TypeError, r"transpose_a must be a bool"),
    (dict(out_dtype=jnp.int8), TypeError, r"out_dtype must be one of .*int8"),
    (dict(precision="ultra"), ValueError, r"precision must be None, a jax.lax.Precision name"),
    (dict(precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6, a=np.ones((4, 4), jnp.bfloat16),
          b=np.ones((4, 4), jnp.bfloat16)), ValueError, r"BF16_BF16_F32_X6 takes inputs of float32"),
    (dict(precision="float32_accurate", a=np.ones((4, 4), jnp.float16),
          b=np.ones((4, 4), jnp.float16)), ValueError, r"'float32_accurate' is for float32"),
    (dict(precision=3), TypeError, r"precision must be None, a str"),
    (dict(precision=jax.lax.DotAlgorithm(jnp.float32, jnp.float32, jnp.float32)), ValueError,
     r"precision: gemm takes a jax.lax.DotAlgorithmPreset, not a custom"),
    (dict(precision=(jax.lax.Precision.HIGHEST, "high")), ValueError, r"one Precision for both"),
    (dict(precision=[jax.lax.Precision.HIGHEST, "highest"], c=jnp.ones((4, 5)), beta=1.0), None,
     None),
    (dict(alpha=10**400), ValueError, r"alpha must fit in a float; got 1000"),
    (dict(backend="cublas"), ValueError, r"backend must be 'auto' or one of .*'cublas'"),
    (dict(backend="triton", config=pallas_gemm.matmul.xla.Config()), TypeError,
     r"config must be a pallas_gemm.matmul.triton.Config"),
    (dict(interpret="yes"), TypeError, r"interpret must be None or a bool"),
    (dict(activation="tanh"), ValueError, r"activation must be None or one of .*'tanh'"),
    (dict(a_activation="tanh"), ValueError, r"a_activation must be None or one of .*'tanh'"),
    (dict(activation=["relu"]), ValueError, r"activation must be None or one of .*\['relu'\]"),
    (dict(config={"block_m": 64}), TypeError, r"config must be a pallas_gemm.<backend>.Config; got dict"),
    (dict(c=jnp.ones((4, 5)), beta=1.0, config=pallas_gemm.matmul.xla.Config()), None, None),
])
def test_bad_input(kwargs, error, match):
  args = dict(a=A, b=B)
  args.update(kwargs)
  a, b = args.pop("a"), args.pop("b")
  if error is None:  # the control: a valid call next to the invalid ones
    np.testing.assert_allclose(gemm(a, b, **args), 8.0 + 1.0)
    return
  with pytest.raises(error, match=match):
    gemm(a, b, **args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(w1=jnp.ones((7, 6))), r"w1 must have shape \(8, \.\.\.\) \(D = x.shape\[-1\]\); got \(7, 6\)"),
    (dict(w1=jnp.ones((2, 8, 6))), r"w1 must have shape \(8, \.\.\.\).*\(2, 8, 6\)"),
    (dict(w2=jnp.ones((5, 3))), r"w2 must have shape \(6, \.\.\.\) \(H = w1.shape\[1\]\)"),
    (dict(b1=jnp.ones((5,))), r"b1 must be None or have shape \(6,\); got \(5,\)"),
    (dict(b2=jnp.ones((6,))), r"b2 must be None or have shape \(3,\)"),
    (dict(activation="tanh"), r"activation must be None or one of .*'tanh'"),
    (dict(activation={"relu": 1}), r"activation must be None or one of .*\{'relu': 1\}"),
    (dict(x=jnp.float32(1.0)), r"x must have rank >= 1"),
])
def test_mlp_bad_input(kwargs, match):
  args = dict(x=jnp.ones((4, 8)), w1=jnp.ones((8, 6)), b1=jnp.ones((6,)), w2=jnp.ones((6, 3)),
              b2=None, activation="relu")
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    pallas_gemm.mlp(**args)
  args.update(dict(x=jnp.ones((4, 8)), w1=jnp.ones((8, 6)), b1=None, w2=jnp.ones((6, 3)),
                   b2=None, activation="relu"))  # the control: a valid call
  np.testing.assert_allclose(pallas_gemm.mlp(**args), 48.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(w=jnp.ones((7, 6))), r"w must have shape \(8, \.\.\.\) \(K = x.shape\[-1\]\); got \(7, 6\)"),
    (dict(w="w"), r"w must have shape \(8, \.\.\.\).*got str"),
    (dict(bias=jnp.ones((5,))), r"bias must be None or have shape \(6,\) \(N = w.shape\[1\]\); got \(5,\)"),
    (dict(x=jnp.float32(1.0)), r"x must have rank >= 1"),
])
def test_dense_bad_input(kwargs, match):
  """dense names its own arguments (x, w, bias), not the a and b of the gemm it calls."""
  args = dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 6)), bias=jnp.ones((6,)))
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    pallas_gemm.dense(**args)
  np.testing.assert_allclose(pallas_gemm.dense(jnp.ones((4, 8)), jnp.ones((8, 6)), jnp.ones((6,))),
                             9.0)  # the control: a valid call


def test_config_that_does_not_fit():
  with pytest.raises(ValueError, match="block_m"):
    pallas_gemm.matmul.triton.Config(block_m=48, block_n=64, block_k=32)


def test_unavailable_backend_says_why():
  status = pallas_gemm.backends()
  assert set(status) == set(pallas_gemm.BACKENDS) and status["xla"] is None
  for name, reason in status.items():
    if reason is not None:
      with pytest.raises(pallas_gemm.BackendUnavailableError, match=name):
        gemm(A, B, backend=name)
