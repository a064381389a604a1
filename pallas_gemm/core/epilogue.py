"""The fused epilogue: ``act(alpha * op(a) @ op(b) + beta * c + bias)``, in f32, and the
gate ``act'(c) * (alpha * op(a) @ op(b))`` of a backward pass (see `op.py`).

One definition of each activation and of its derivative, used by every path: inside the
Mosaic GPU kernel's epilogue (these jnp functions lower there), in the XLA backend's
expression (which XLA fuses around cuBLAS), after the kernels that do not fuse it (cuda,
triton), and by the JVP in `op.py`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu(x):  # tanh approximation, as jax.nn.gelu(approximate=True)
  return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def _gelu_grad(x):
  inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
  t = jnp.tanh(inner)
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)


def _gelu_exact(x):  # as jax.nn.gelu(approximate=False)
  return 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))


def _gelu_exact_grad(x):
  cdf = 0.5 * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))
  return cdf + x * jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))


def _silu(x):
  return x * jax.nn.sigmoid(x)


def _silu_grad(x):
  s = jax.nn.sigmoid(x)
  return s * (1.0 + x * (1.0 - s))


# name: (f, f'), both on f32 arrays.
ACTIVATIONS = {
    "relu": (lambda x: jnp.maximum(x, 0.0), lambda x: (x > 0).astype(x.dtype)),
    "gelu": (_gelu, _gelu_grad),
    "gelu_exact": (_gelu_exact, _gelu_exact_grad),
    "silu": (_silu, _silu_grad),
}


# The functions of a gate (SwiGLU's silu, GeGLU's gelu) in the gated grouped GEMM.
GATES = ("silu", "gelu")


def activate(x, activation: str | None):
  return x if activation is None else ACTIVATIONS[activation][0](x)


def gated(h, gate: str):
  """a = gate(h[..., :F]) * h[..., F:] of h (..., 2F) = [gate | up], in f32, rounded to
  h's dtype: a gated MLP's activation of its rounded first product (SwiGLU, GeGLU)."""
  f = h.shape[-1] // 2
  hf = h.astype(jnp.float32)
  return (activate(hf[..., :f], gate) * hf[..., f:]).astype(h.dtype)


def activated(z, activation: str):
  """act(z) in f32, rounded back to z's dtype: the activation of a GEMM's rounded output,
  as XLA computes ``act(jnp.dot(...))``."""
  return activate(z.astype(jnp.float32), activation).astype(z.dtype)


def derivative(x, activation: str):
  return ACTIVATIONS[activation][1](x)


def apply(acc, c, bias, *, beta: float, activation: str | None, out_dtype,
          c_gate: str | None = None):
  """acc (f32, alpha already applied) -> act(acc + beta*c + bias) in out_dtype.

  bias is (N,) and broadcasts over rows (and the batch). With c_gate (an activation's
  name), c is a gate, not a summand: acc * act'(c), and beta, bias and activation are
  unused (a gated call has none)."""
  if c_gate is not None:
    return (acc * derivative(c.astype(jnp.float32), c_gate)).astype(out_dtype)
  if c is not None and beta != 0.0:
    acc = acc + beta * c.astype(jnp.float32)
  if bias is not None:
    acc = acc + bias.astype(jnp.float32)
  return activate(acc, activation).astype(out_dtype)
