"""`fp8_dot_general`: a `jax.lax.dot_general` that computes in fp8, for training.

    nn.Dense(features, dot_general=pallas_gemm.fp8_dot_general)          # Flax linen
    nn.Dense(features, dot_general=functools.partial(
        pallas_gemm.fp8_dot_general, grad_dtype=jnp.float8_e5m2))

Current scaling with DeepSeek-V3's blocks: every call quantizes its inputs afresh (no
amax history): the activation-like operand (lhs) in 1x128 blocks along the contraction,
the weight (rhs) in 128x128 blocks, both float8_e4m3fn, with power-of-two scales
(`quantize`). The three GEMMs of a layer all run through `scaled_matmul`:
  forward  y  = x @ W          x: 1x128 along K,   W: 128x128
  dgrad    dx = dy @ W^T       dy: 1x128 along N,  W: the forward's fp8 W
  wgrad    dW = x^T @ dy       x and dy re-quantized 1x128 along M (the new contraction),
                               each read in place (`quantize(..., transpose=True)`)
W is quantized once, in the layout it is stored in: (K, N) for nn.Dense's kernel, which is
K-major for the dgrad (contracted over N), the forward reading the same fp8 numbers
transposed; or (N, K), K-major for the forward, the dgrad reading it transposed (a
128x128 block's amax, so its scale, does not depend on the direction it is read in). The
transpose moves fp8 bytes, half of W's bf16 ones, and W's own bf16 is not copied.
The gradient through the quantization is the identity (straight-through): the scales
follow the amax, so nothing saturates but infinities.

Gradients in float8_e4m3fn by default. Per-tensor recipes (TransformerEngine's
DelayedScaling, "HYBRID") store gradients in e5m2 because one scale must cover a
gradient tensor's whole range, which e4m3's 18 binades do not. With a scale per 128
values the range each scale must cover is a block's, and e4m3's extra mantissa bit
halves the rounding error: DeepSeek-V3 and TransformerEngine's block-scaling recipes
(Float8BlockScaling, MXFP8BlockScaling) use e4m3 for every tensor. grad_dtype=e5m2 is
kept for comparison (examples/fp8_mlp.py runs both).

wgrad="fp8-block" quantizes dy for the weight gradient in 128x128 blocks (128 rows of
the batch by 128 of N) instead of 1x128 ones along the batch, x as for "fp8": the
weight gradient then runs in the kernel's fast scale layout, a weight's (block scales
fold into the row scales), with one scale per 128x128 block of dy where "fp8" has one
per column of dy and 128 rows.
TransformerEngine's Float8BlockScaling offers the same choice for gradients (2-D
blocks); `examples/fp8_mlp.py` checks its loss curve against bf16's like the others'.

wgrad="input" computes the weight gradient as the stock layer does, x^T @ dy in the
operands' own dtype at the call's `precision`, and keeps fp8 for the forward and dgrad
GEMMs. Its operands then need no quantization down the batch (a pass over x and one over
dy), and it avoids the kernel's costliest scale layout: with both operands
scaled per 1x128 block, every step of K multiplies each product by a row and a column
scale, where 128x128 weight blocks fold into the row scales. docs/performance.md gives
what each choice costs in a training step; "fp8" (the default) keeps every GEMM in fp8, as
DeepSeek-V3's recipe does.

Contractions whose length is not a multiple of 128 are padded with zeros inside (zeros
change neither a block's amax nor a sum), so any shape works; aligned shapes copy
nothing.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.core import sharding
from pallas_gemm.fp8 import api
from pallas_gemm.fp8 import checks, scales
from pallas_gemm.fp8.quantize import quantize

_BLOCK = 128
FORWARD_DTYPE = jnp.float8_e4m3fn
WGRADS = ("fp8", "fp8-block", "input")


def _pad_to(x, axis: int, multiple: int = _BLOCK):
  size = x.shape[axis]
  extra = -size % multiple
  if not extra:
    return x
  pads = [(0, 0)] * x.ndim
  pads[axis] = (0, extra)
  return jnp.pad(x, pads)


def _weight_gradient(x, dy, dtypes, out_dtype, backend, dy_block=(1, _BLOCK)):
  """x (B, M, K)^T @ dy (B, M, N): (B, K, N), both quantized along M (padded to 128s),
  each read in place and written transposed: x^T in 1x128 blocks, dy^T in dy_block
  ((1, 128), or (128, 128): N padded to 128s too)."""
  x8, sx = quantize(_pad_to(x, 1), dtypes[0], transpose=True)
  n = dy.shape[2]
  if dy_block[0] > 1:
    dy = _pad_to(dy, 2)
  dy8, sdy = quantize(_pad_to(dy, 1), dtypes[1], dy_block, transpose=True)
  return api.scaled_matmul(x8, dy8, sx, sdy, out_dtype, backend=backend)[:, :, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def fp8_matmul(x, w, out_dtype, grad_dtype, wgrad, precision, backend, w_nk):
  """(B, M, N) = x (B, M, K) @ w in fp8 (module docstring), w (B, K, N), or (B, N, K)
  with w_nk; out_dtype, grad_dtype (numpy dtypes), wgrad, precision (that of an
  unquantized weight gradient), backend and w_nk are static."""
  y, _ = _forward(x, w, out_dtype, grad_dtype, wgrad, precision, backend, w_nk)
  return y


def _as_kn(a, w_nk: bool):
  """A (B, K, N) view of an array in w's layout: swapped if w is (B, N, K)."""
  return jnp.swapaxes(a, 1, 2) if w_nk else a


def _forward(x, w, out_dtype, grad_dtype, wgrad, precision, backend, w_nk):
  del grad_dtype, wgrad, precision
  n = w.shape[1 if w_nk else 2]
  # W padded on both axes (each is a contraction of one GEMM) and quantized as stored;
  # the forward reads it as (N, K), the dgrad as (K, N).
  w8, sw = quantize(_pad_to(_pad_to(w, 2), 1), FORWARD_DTYPE, (_BLOCK, _BLOCK))
  x8, sx = quantize(_pad_to(x, 2), FORWARD_DTYPE, (1, _BLOCK))
  w8_nk, sw_nk = (w8, sw) if w_nk else (jnp.swapaxes(w8, 1, 2), jnp.swapaxes(sw, 1, 2))
  y = api.scaled_matmul(x8, w8_nk[:, :n], sx, sw_nk, out_dtype, backend=backend)
  # An empty slice of w: residuals are arrays, and dW must come back in w's dtype and
  # type (its sharding, under Explicit mesh axes).
  return y, (x, w8, sw, w[tuple(slice(0, 0) for _ in w.shape)])


def _backward(out_dtype, grad_dtype, wgrad, precision, backend, w_nk, residuals, dy):
  del out_dtype
  x, w8, sw, w_like = residuals
  k = x.shape[2]
  # dgrad: dy (B, M, N) @ W^T, W (K, N) the K-major rhs, as quantized in the forward.
  dy8, sdy = quantize(_pad_to(dy, 2), grad_dtype, (1, _BLOCK))
  dx = api.scaled_matmul(dy8, _as_kn(w8, w_nk), sdy, _as_kn(sw, w_nk), x.dtype,
                         backend=backend)[:, :, :k]
  dx = sharding.typed_like(dx, jax.typeof(x))  # x's type, under Explicit axes too
  # wgrad: dW (K, N) = x^T (K, M) @ dy (M, N), both contracted over M, so both are
  # quantized along M (x^T in 1x128 blocks, dy^T in 1x128 or, with "fp8-block", 128x128
  # ones); (K, N) is also the kernel's own output layout, so the
  # optimizer update reads dW in place (a transposing update of the f32 parameters and
  # moments ran 3x slower).
  if wgrad == "input":  # x^T @ dy as the stock layer computes it, in x's and dy's dtype
    dw = jax.lax.dot_general(x, dy, (((1,), (1,)), ((0,), (0,))), precision=precision)
    dw = dw.astype(w_like.dtype)
  else:
    dy_block = (_BLOCK, _BLOCK) if wgrad == "fp8-block" else (1, _BLOCK)
    dw = _weight_gradient(x, dy, (FORWARD_DTYPE, grad_dtype), w_like.dtype, backend,
                          dy_block)
  return dx, sharding.typed_like(_as_kn(dw, w_nk), jax.typeof(w_like))


fp8_matmul.defvjp(_forward, _backward)


def _grad_dtype(grad_dtype) -> np.dtype:
  dtype = np.dtype(grad_dtype)
  if dtype not in scales.FP8_DTYPES:
    raise TypeError(f"grad_dtype must be float8_e4m3fn or float8_e5m2; got {dtype}")
  return dtype


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    *, out_sharding=None, grad_dtype=jnp.float8_e4m3fn, wgrad="fp8",
                    backend="auto"):
  """`jax.lax.dot_general` computed in fp8 (module docstring): lhs quantized in 1x128
  blocks, rhs (the weight) in 128x128 blocks, float32 accumulation; the backward GEMMs
  in fp8 too (the weight gradient's unless wgrad="input").

  Args:
    lhs, rhs, dimension_numbers, preferred_element_type, out_sharding: as for
      `jax.lax.dot_general` (result shape and dtype are lax's). Operands float32,
      bfloat16 or float16.
    precision: ignored by the fp8 GEMMs (fp8 is their precision); with wgrad="input",
      the precision of the weight gradient's dot_general, as in the stock layer.
    grad_dtype: the fp8 dtype of the output gradient in the backward fp8 GEMMs: the
      dgrad's, and the weight gradient's with wgrad="fp8" or "fp8-block"
      (float8_e4m3fn by default; see the module docstring for why).
    wgrad: "fp8" (default) computes the weight gradient in fp8 as above; "fp8-block"
      the same with the output gradient in 128x128 blocks (the faster kernel layout);
      "input" computes it as the stock layer does, from lhs and the output gradient in
      their own dtype (see the module docstring).
    backend: scaled_matmul's backend ("auto" | "xla" | "mosaic").
  """
  if wgrad not in WGRADS:
    raise ValueError(f"fp8_dot_general's wgrad must be one of {WGRADS}; got {wgrad!r}")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if np.dtype(x.dtype) not in scales.INPUT_DTYPES:
      raise TypeError(f"fp8_dot_general's {name}.dtype must be float32, bfloat16 or float16;"
                      f" got {np.dtype(x.dtype)}")
  out_type = jax.eval_shape(
      lambda a, b: jax.lax.dot_general(a, b, dimension_numbers,
                                       preferred_element_type=preferred_element_type), lhs, rhs)
  if np.dtype(out_type.dtype) not in checks.OUT_DTYPES:
    raise TypeError(f"fp8_dot_general computes float32, bfloat16 or float16 results; got"
                    f" preferred_element_type={np.dtype(out_type.dtype)}")
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = (
      [tuple(int(d) for d in dims) for dims in pair] for pair in dimension_numbers)
  lhs_free = tuple(d for d in range(lhs.ndim) if d not in lhs_batch + lhs_contract)
  rhs_free = tuple(d for d in range(rhs.ndim) if d not in rhs_batch + rhs_contract)
  size = lambda x, dims: math.prod(x.shape[d] for d in dims)  # noqa: E731
  b, m, k, n = (size(lhs, lhs_batch), size(lhs, lhs_free), size(lhs, lhs_contract),
                size(rhs, rhs_free))
  if k == 0:  # an empty contraction: lax's zeros (and zero gradients)
    out = jnp.zeros(out_type.shape, out_type.dtype)
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)
  # x (batch, free, contract): K-major, the layout fp8 wgmma reads. w as it is stored
  # where that is (batch, free, contract), else (batch, contract, free), as nn.Dense's
  # (K, N) kernel is: no copy of either, and it is quantized in place (module docstring).
  x = jnp.transpose(lhs, lhs_batch + lhs_free + lhs_contract).reshape(b, m, k)
  w_nk = rhs_batch + rhs_free + rhs_contract == tuple(range(rhs.ndim))
  w = jnp.transpose(rhs, rhs_batch + (rhs_free + rhs_contract if w_nk
                                      else rhs_contract + rhs_free))
  w = w.reshape((b, n, k) if w_nk else (b, k, n))
  # A static argument of the custom_vjp, so hashable (a list of two becomes a tuple).
  if wgrad != "input":
    precision = None
  elif isinstance(precision, list):
    precision = tuple(precision)
  out = fp8_matmul(x, w, np.dtype(out_type.dtype), _grad_dtype(grad_dtype), wgrad,
                   precision, backend, w_nk)
  out = out.reshape(out_type.shape)
  if out_sharding is not None:
    out = jax.sharding.reshard(out, out_sharding)
  return out
