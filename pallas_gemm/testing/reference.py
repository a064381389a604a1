"""The one reference and the one tolerance table, shared by tests and benchmarks."""

from __future__ import annotations

import math

import jax
import numpy as np

from pallas_gemm.core import precision as precisions


# The activations in float64, from jax.nn (independent of pallas_gemm/core/epilogue.py).
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
}


def input_family(kind: str, rng: np.random.Generator, shape, operand: str = "a") -> np.ndarray:
  """float32 inputs of one family, as the precision tests and benchmarks draw them:
  "normal" N(0,1); "wide" x * exp(1.5 N(0,1)); "range": magnitudes near float32's limits,
  sign * [1, 2) * 2^e with e in [0, 115] for operand "a" and [-100, 0] for "b", so that
  the products (and their sums) stay finite in float32 and every piece of a bf16 split
  is a normal bf16 (the model of precision.py)."""
  x = rng.standard_normal(shape).astype(np.float32)
  if kind == "wide":
    x = x * np.exp(1.5 * rng.standard_normal(shape)).astype(np.float32)
  elif kind == "range":
    low, high = (0, 115) if operand == "a" else (-100, 0)
    x = (np.sign(x) * rng.uniform(1, 2, shape) * np.exp2(rng.integers(low, high + 1, shape))
         ).astype(np.float32)
  elif kind != "normal":
    raise ValueError(f"kind={kind!r}: expected 'normal', 'wide' or 'range'")
  return x


def reference(a, b, c=None, *, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
              bias=None, activation=None, a_activation=None):
  """act(alpha * op(a') @ op(b) + beta * c + bias) in float64 (BLAS semantics: beta == 0
  ignores c), a' = a_activation(a) or a.

  NumPy on the host. Large products on a GPU run there, still in float64 (a 4097^3
  product takes seconds on the host, milliseconds on the device), and come back as a
  float64 jax.Array.
  """
  xp = np
  big = math.prod(a.shape) * (b.shape[-2] if transpose_b else b.shape[-1]) > 2**30
  if big and jax.default_backend() == "gpu":
    import jax.numpy as xp  # noqa: PLC0415 - device path only
  with jax.enable_x64(True):
    a64, b64 = xp.asarray(a, dtype=xp.float64), xp.asarray(b, dtype=xp.float64)
    if a_activation is not None:
      a64 = xp.asarray(ACTIVATIONS[a_activation](jax.numpy.asarray(a64)), dtype=xp.float64)
    if transpose_a:
      a64 = xp.swapaxes(a64, -1, -2)
    if transpose_b:
      b64 = xp.swapaxes(b64, -1, -2)
    out = alpha * xp.matmul(a64, b64)
    if c is not None and beta != 0.0:
      out = out + beta * xp.asarray(c, dtype=xp.float64)
    if bias is not None:
      out = out + xp.asarray(bias, dtype=xp.float64)
    if activation is not None:
      out = ACTIVATIONS[activation](jax.numpy.asarray(out, dtype=jax.numpy.float64))
  return out


def scaled_reference(lhs, rhs, lhs_scales, rhs_scales):
  """jax.nn.scaled_matmul's product in float64: einsum("bmk,bnk->bmn", lhs * ls, rhs * rs)
  with each scale repeated over its block (rows: one per row, per 128 rows, or one per
  tensor; K // K_s along K). 2-D arguments give a 2-D result. Host NumPy, or the device
  in float64 for large products on a GPU (as `reference`)."""
  xp = np
  if math.prod(lhs.shape) * rhs.shape[-2] > 2**30 and jax.default_backend() == "gpu":
    import jax.numpy as xp  # noqa: PLC0415 - device path only
  with jax.enable_x64(True):
    def dequantize(x, s):
      x = xp.asarray(xp.asarray(x).astype(xp.float32), dtype=xp.float64)
      s = xp.asarray(xp.asarray(s).astype(xp.float32), dtype=xp.float64)
      rows, k = x.shape[-2:]
      if s.shape[-2] not in (1, rows):  # blocks of 128 rows, the last one partial
        s = xp.repeat(s, 128, axis=-2)[..., :rows, :]
      return x * xp.repeat(s, k // s.shape[-1], axis=-1) if s.shape[-1] > 1 else x * s
    a, b = dequantize(lhs, lhs_scales), dequantize(rhs, rhs_scales)
    return xp.matmul(a, xp.swapaxes(b, -1, -2))


def scaled_ragged_reference(lhs, rhs, group_sizes, lhs_scales, rhs_scales):
  """scaled_ragged_dot's product in float64, (M, N): the rows of group g (consecutive from
  row 0) times rhs[g] as `scaled_reference` takes them (lhs_scales (M, K_s), rhs_scales
  (G, ceil(N/128), K_s)); rows past the groups are zeros."""
  m, n = lhs.shape[0], rhs.shape[1]
  out = np.zeros((m, n))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    rows = slice(start, min(start + int(size), m))
    if rows.stop > rows.start:
      out[rows] = np.asarray(scaled_reference(lhs[rows], rhs[g], lhs_scales[rows],
                                              rhs_scales[g]))
    start = rows.stop
  return out


def gated_gradient(a, b, g, activation):
  """The float64 gradient in a of sum(g * (act(a) @ b)): act'(a) * (g @ b^T), on the host."""
  with jax.enable_x64(True):
    a64 = np.asarray(a, np.float64)
    slope = jax.jvp(ACTIVATIONS[activation], (a64,), (np.ones_like(a64),))[1]
    return np.asarray(slope) * (np.asarray(g, np.float64) @ np.asarray(b, np.float64).T)


# Normwise relative error ||out - ref|| / ||ref|| allowed, as base + per_sqrt_k * sqrt(K):
# rounding of the products/accumulation, which grows like a random walk over K.
_COMPUTE_TOL = {
    "ieee": (1e-6, 1e-7),   # fp32 FFMA: 1e-5 at K = 8192 (issue 3's bound)
    # inputs cut to 10 mantissa bits (wgmma may truncate: up to 2^-9 on one product,
    # 1.04e-3 seen at 1x1x1 on the H200); ~3e-4 normwise at 4096
    "tf32": (2e-3, 1e-5),
    "16bit": (1e-5, 1e-6),  # bf16/f16 products are exact in f32; tensor-core accumulation
    # float32 from bf16 pieces (pallas_gemm/core/precision.py): two pieces drop products of
    # 2^-16 (jnp.dot's X3: 1.6e-5 at 4096^3, 1.9e-5 at 8192^3, H200); one piece is
    # bf16 inputs (8 bits: 8x TF32's rounding). X6, X9 and float32_accurate are "ieee".
    "bf16x3": (3e-5, 3e-7),
    "bf16": (1.6e-2, 8e-5),
    "tf32x3": (2e-5, 5e-7),  # jnp.dot's TF32_TF32_F32_X3: 9.7e-6 at 4096^3, 1.9e-5 at 8192^3
    # float32_f16x3: elements kept to 2^-22 (23 bits): 2e-7 on N(0,1) at 4096^3-8192^3,
    # up to 1.75x SGEMM's where a few terms dominate (the "range" inputs; H200)
    "f16x3": (2e-6, 1e-7),
    # fp8 operands against the float64 product of the dequantized operands: the products
    # are exact in f32, but fp8 wgmma keeps ~14 bits while it sums (DeepSeek-V3), so a
    # kernel sums 128 products that way before adding them into f32 registers; a K loop
    # left to the tensor core's accumulator loses ~2^-14 per step of it (xla and
    # interpret mode: f32 throughout, ~1e-7).
    "fp8": (2e-4, 2e-6),
    # precision="fast_accumulation": all of K in the tensor core's accumulator (the mosaic
    # kernel's default with scales constant along K): its ~14 kept bits truncate at every
    # wgmma, an error that grows with K (DeepSeek-V3: ~2% elementwise at K = 4096).
    "fp8_fast": (2e-3, 1e-4),
}
# ... plus the final rounding to the output dtype (half an ulp, normwise below that). An
# fp8 output is a quantized one (values times power-of-two block scales): e4m3 rounds to 3
# mantissa bits (2^-4 of a value at most, ~2.5e-2 normwise on N(0,1) data), e5m2 to 2.
_OUTPUT_TOL = {"float32": 0.0, "bfloat16": 8e-3, "float16": 1e-3, "float8_e4m3fn": 4e-2,
               "float8_e5m2": 8e-2}


def compute_class(dtype, precision) -> str:
  if np.dtype(dtype).itemsize == 1:
    return "fp8_fast" if precision == "fast_accumulation" else "fp8"
  if np.dtype(dtype).itemsize == 2:
    return "16bit"
  precision = precisions.effective(precisions.normalize(precision), dtype)
  split = precisions.split_of(precision, dtype)
  if split is not None and split.dtype == "float16":
    return "f16x3"
  if split is not None:
    return {1: "bf16", 2: "bf16x3"}.get(split.pieces, "ieee")
  if precision == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3:
    return "tf32x3"
  return "ieee" if precision == jax.lax.Precision.HIGHEST else "tf32"


def tolerance(dtype, precision, k: int, out_dtype=None) -> float:
  """The relative-error bound for a GEMM of inputs `dtype` over a contraction of length k."""
  base, per_sqrt_k = _COMPUTE_TOL[compute_class(dtype, precision)]
  out = np.dtype(out_dtype if out_dtype is not None else dtype).name
  return base + per_sqrt_k * math.sqrt(max(k, 1)) + _OUTPUT_TOL[out]


def relative_error(out, ref, scale=None) -> float:
  """||out - ref|| / ||ref|| (or / ||scale||) in float64; NaN/Inf where ref is finite (or
  vice versa) gives inf.

  scale: the array whose norm divides instead of ref's, e.g. the product of the operands'
  absolute values (a summation's forward-error scale, which cancellation in ref does not
  shrink).

  Large outputs on a GPU are compared there (still float64): a host copy of a 16384^2
  result in float64 would cost seconds per check.
  """
  if tuple(out.shape) != tuple(ref.shape):
    raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs reference {tuple(ref.shape)}")
  xp = np
  if out.size > 1 << 22 and jax.default_backend() == "gpu":
    import jax.numpy as xp  # noqa: PLC0415 - device path only
  with jax.enable_x64(True):
    out64, ref64 = xp.asarray(out, dtype=xp.float64), xp.asarray(ref, dtype=xp.float64)
    finite = xp.isfinite(ref64)
    # Non-finite values must match exactly: NaN where NaN, and infinities of the same sign.
    same_nan = xp.isnan(out64) == xp.isnan(ref64)
    same_inf = xp.where(xp.isinf(ref64) | xp.isinf(out64), out64 == ref64, True)
    if not bool(xp.all(same_nan & same_inf)):
      return math.inf
    diff = xp.where(finite, out64, 0.0) - xp.where(finite, ref64, 0.0)
    norm_of = ref64 if scale is None else xp.asarray(scale, dtype=xp.float64)
    denom = float(xp.linalg.norm(xp.where(xp.isfinite(norm_of), norm_of, 0.0)))
    err = float(xp.linalg.norm(diff))
  return err / denom if denom > 0 else err


def gated_tolerance(dtype, k: int) -> float:
  """The bound of a gated product a = act(x @ gate) * (x @ up) written in dtype (the gated
  grouped GEMM): the two GEMMs' compute errors add to first order, plus a's rounding."""
  return 2 * tolerance(dtype, None, k, np.float32) + _OUTPUT_TOL[np.dtype(dtype).name]


def moe_reference(x, topk_weights, topk_ids, w_gate_up, w_down, activation="swiglu"):
  """`pallas_gemm.moe_mlp` in float64, written densely: every token through every expert,
  then weighted by how often (and how much) its row of topk_ids picks that expert. No
  sort, no gather: independent of the layer's dataflow. Small shapes only (T * E * D * F
  products). A jnp function under jax_enable_x64, so jax.vjp gives the reference
  gradients; call it inside `with jax.enable_x64(True)`."""
  jnp = jax.numpy
  f64 = jnp.float64
  name, gated = {"swiglu": ("silu", True), "geglu": ("gelu", True), "silu": ("silu", False),
                 "gelu": ("gelu", False)}[activation]
  act = ACTIVATIONS[name]
  x, w = jnp.asarray(x, f64), jnp.asarray(topk_weights, f64)
  wgu, wd = jnp.asarray(w_gate_up, f64), jnp.asarray(w_down, f64)
  e = wd.shape[0]
  picks = jnp.asarray(topk_ids)[..., None] == jnp.arange(e)  # (T, k, E)
  # A select, not a product: a pair's weight (Inf or NaN included) reaches its own expert
  # only, and an id outside [0, E) reaches none.
  coef = jnp.sum(jnp.where(picks, w[..., None], 0.0), axis=1)
  h = jnp.einsum("td,edf->tef", x, wgu)
  if gated:
    f = h.shape[-1] // 2
    a = act(h[..., :f]) * h[..., f:]
  else:
    a = act(h)
  y = jnp.einsum("tef,efd->ted", a, wd)
  return jnp.einsum("te,ted->td", coef, y)


# e4m3's relative rounding step (3 mantissa bits, to nearest: half a step of 2^-3): also
# how far two fp8 computations of the same value may differ where a last-bit difference
# upstream moves a value across a rounding boundary.
E4M3_STEP = 2.0**-4


def moe_tolerance(dtype, d_model: int, d_ff: int) -> float:
  """The relative-error bound of `moe_mlp` and of each of its gradients: the layer chains
  two GEMMs (contractions over D and F, or 2F for a gradient of the gated form) with an
  intermediate rounded to dtype, so to first order their bounds add."""
  return tolerance(dtype, None, d_model) + tolerance(dtype, None, 2 * d_ff)


def moe_fp8_training_tolerance(dtype, d_model: int, d_ff: int) -> float:
  """The bound of `moe_mlp(precision="fp8")` and of each of its gradients against the
  float64 layer of the bf16 weights: the bf16 layer's, plus e4m3's relative rounding step
  (2^-4) for each quantized operand on the path, to first order: the forward quantizes
  two activations and two weights; an input gradient adds two cotangents and two weights
  to the forward's error in h (the weight gradients, in bf16, see the same)."""
  return moe_tolerance(dtype, d_model, d_ff) + 8 * E4M3_STEP


def moe_fp8_tolerance(dtype, d_model: int, d_ff: int) -> float:
  """The bound of `moe_mlp`'s fp8 inference form against the float64 layer of its
  dequantized weights: the bf16 layer's, plus e4m3's relative rounding step (2^-4: 3
  mantissa bits, to nearest) for each of the two activations it quantizes in the call."""
  return moe_tolerance(dtype, d_model, d_ff) + 2 * E4M3_STEP
