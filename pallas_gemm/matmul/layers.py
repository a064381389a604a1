"""Layers on `gemm`: `dense` (the bias and activation in the GEMM's epilogue) and `mlp`
(two layers whose activation and its derivative both ride in epilogues)."""

from __future__ import annotations

import jax.numpy as jnp
import math


from pallas_gemm.core import epilogue
from pallas_gemm.matmul import api


def dense(x, w, bias=None, activation=None, *, input_activation=None, precision=None,
          out_dtype=None, backend="auto", config=None):
  """A dense layer, ``act(x @ w + bias)``, with the epilogue fused where the backend can:
  x (..., K), w (K, N), bias None or (N,). Differentiable in x, w and bias like `gemm`.

  input_activation: the layer reads ``input_activation(x)`` (`gemm`'s ``a_activation``).
  An MLP written ``dense(dense(x, w1, b1), w2, b2, input_activation="gelu")`` is
  ``dense(dense(x, w1, b1, "gelu"), w2, b2)`` with GELU's derivative fused into the
  backward GEMM that computes the hidden gradient."""
  x, x2 = _rows(x, "K")
  # Checked here so that the errors name dense's arguments, not gemm's a and b.
  n = _check_weight("w", w, x.shape[-1], "K = x.shape[-1]")
  _check_bias("bias", bias, n, "N = w.shape[1]")
  out = api.gemm(x2, w, bias=bias, activation=activation, precision=precision,
             out_dtype=out_dtype, backend=backend, config=config, a_activation=input_activation)
  return out.reshape(x.shape[:-1] + out.shape[-1:])


def mlp(x, w1, b1, w2, b2, activation="gelu", *, precision=None, out_dtype=None,
        backend="auto"):
  """Two dense layers with an activation between them, ``dense(dense(x, w1, b1,
  activation), w2, b2)``, wired for training: x (..., D), w1 (D, H), b1 None or (H,),
  w2 (H, N), b2 None or (N,). The hidden activations have x's and w1's promoted dtype;
  out_dtype is the output's. Differentiable in every array like `gemm`.

  The hidden layer's kernel stores both z = x @ w1 + b1 and act(z) (cuBLASLt's
  GELU_AUX), the second layer reads act(z), and the gradient in z is one GEMM whose
  epilogue multiplies by act'(z) (as ``dense(..., input_activation=)``). On the mosaic
  backend neither the activation nor its derivative costs a pass over the hidden
  activations, where jnp spends one on each (other backends compute them in XLA,
  around the kernels). Without a gradient, ``dense(dense(x, w1, b1, activation), w2,
  b2)`` writes half the hidden bytes (no z).
  """
  x, x2 = _rows(x, "D")
  # Checked here so that the errors name mlp's arguments, not the layers' a and b.
  hidden = _check_weight("w1", w1, x.shape[-1], "D = x.shape[-1]")
  n = _check_weight("w2", w2, hidden, "H = w1.shape[1]")
  _check_bias("b1", b1, hidden)
  _check_bias("b2", b2, n)
  if activation is None:
    return dense(dense(x, w1, b1, precision=precision, backend=backend), w2, b2,
                 precision=precision, out_dtype=out_dtype, backend=backend)
  if not isinstance(activation, str) or activation not in epilogue.ACTIVATIONS:
    raise ValueError(f"activation must be None or one of {sorted(epilogue.ACTIVATIONS)}; "
                     f"got {activation!r}")
  common = dict(c=None, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
                precision=precision, config=None, interpret=None, backend=backend)
  h, z = api.gemm_call(x2, w1, **common, out_dtype=None, bias=b1, activation=activation,
               a_activation=None, keep_pre=True)
  out = api.gemm_call(z, w2, **common, out_dtype=out_dtype, bias=b2, activation=None,
              a_activation=activation, a_given=h)
  return out.reshape(x.shape[:-1] + out.shape[-1:])


def _rows(x, features: str):
  """x as an array, and as the 2-D (rows, features) operand of a layer's GEMM."""
  x = jnp.asarray(x)
  if x.ndim < 1:
    raise ValueError(f"x must have rank >= 1 (..., {features}); got shape {x.shape}")
  return x, x.reshape((math.prod(x.shape[:-1]), x.shape[-1])) if x.ndim != 2 else x


def _check_weight(name: str, w, rows: int, what: str) -> int:
  """The columns of a 2-D weight whose rows must equal `rows` (`what`)."""
  shape = tuple(getattr(w, "shape", ()))
  if len(shape) != 2 or shape[0] != rows:
    raise ValueError(f"{name} must have shape ({rows}, ...) ({what}); got "
                     f"{shape if hasattr(w, 'shape') else type(w).__name__}")
  return shape[1]


def _check_bias(name: str, bias, size: int, what: str | None = None) -> None:
  """A layer's bias is None or a vector of `size` (`what`, where the size needs naming)."""
  if bias is not None and tuple(getattr(bias, "shape", ())) != (size,):
    raise ValueError(f"{name} must be None or have shape ({size},)"
                     f"{f' ({what})' if what else ''}; got "
                     f"{getattr(bias, 'shape', type(bias).__name__)}")
