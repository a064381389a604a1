"""The front door: `gemm` validates, normalises and dispatches to one backend.

    out = alpha * op(a) @ op(b) + beta * c

Every backend module (`xla`, `triton`, `mosaic`, `cuda`) sees the same normalised
problem (see `_contract.md`): 3-D operands (batch, rows, cols), one dtype, M/N/K >= 1,
static alpha/beta. Everything a user can get wrong is caught here, before any kernel
is traced, with an error that names the argument.

The normalised call is one `op.gemm_p` primitive; its rules under AD (forward and
reverse), vmap and shardings live in `op.py`, so this module stays validation and
backend choice.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.core import epilogue
from pallas_gemm.core.checks import SUPPORTED_DTYPES, dtype_of
from pallas_gemm.matmul import op
from pallas_gemm.core import precision as _precisions

BACKENDS = ("xla", "triton", "mosaic", "cuda")


class BackendUnavailableError(RuntimeError):
  """The requested backend cannot run on this machine (the message says why)."""


def _backend_module(name: str):
  return importlib.import_module(f"pallas_gemm.matmul.{name}")


def backends() -> dict[str, str | None]:
  """Maps each backend name to None when it can run here, else the reason it cannot."""
  status = {}
  for name in BACKENDS:
    try:
      status[name] = _backend_module(name).unavailable_reason()
    except ImportError as e:  # a backend whose toolchain is missing must not break the others
      status[name] = f"import failed: {e}"
  return status


# ----------------------------------------------------------------------------- validation


def _static_float(x, name: str) -> float:
  # alpha/beta are compile-time constants of the kernels (they select the epilogue);
  # a traced value would force a recompile per value or a runtime branch.
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a Python float (a static scalar); got {type(x).__name__} {x!r}")
  try:
    return float(x)
  except OverflowError:  # an int beyond float's range
    raise ValueError(f"{name} must fit in a float; got {x!r}") from None


def explicitly_sharded(x) -> bool:
  """Whether x's type is sharded over Explicit mesh axes (jax.sharding.AxisType.Explicit)."""
  return any(axes is not None for axes in jax.typeof(x).sharding.spec)


def _explicit_mode_gemm(a, b, c, *, alpha, beta, transpose_a, transpose_b, precision,
                        out_dtype, bias, activation, a_activation):
  """The GEMM as jnp ops, for operands sharded over Explicit mesh axes.

  In explicit mode sharding is part of the type and every op must type its result: lax
  does that for its dot (as for jnp.dot: an ambiguous K-sharded product raises and asks
  for an out_sharding), the gemm primitive does not yet. So these calls run XLA's dot with
  the same epilogue; a Pallas backend asked for by name is refused in api.gemm.
  """
  if a_activation is not None:
    a = epilogue.activate(a.astype(jnp.float32), a_activation).astype(a.dtype)
  a_op = jnp.swapaxes(a, -1, -2) if transpose_a else a
  b_op = jnp.swapaxes(b, -1, -2) if transpose_b else b
  acc = jnp.matmul(a_op, b_op, precision=_precisions.for_lax(precision),
                   preferred_element_type=jnp.float32)
  if alpha != 1.0:
    acc = alpha * acc
  return epilogue.apply(acc, c, bias, beta=beta, activation=activation, out_dtype=out_dtype)


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _auto_backend(dtype: np.dtype, precision, m: int, n: int, k: int,
                  leading_dims: tuple[int, ...], batch: int = 1, transpose_a: bool = False,
                  transpose_b: bool = False, has_epilogue: bool = False) -> str:
  """The `backend="auto"` decision, from the H200 measurements in benchmarks/results.

  cuBLAS (jnp.dot) is 1.0-1.03x our best kernels on aligned 16-bit shapes, so it keeps
  them. Our kernels win where cuBLAS falls off its fast path: a row stride that is not
  16-byte aligned (bf16 4097^3: jnp.dot 135 TFLOP/s, mosaic 545; TF32: 118 vs 239), and
  IEEE f32 grids that leave cuBLAS a part-full last wave (cuda with stream-K).
  """
  if not _on_gpu():
    return "xla"
  status = backends()
  if isinstance(precision, (str, jax.lax.DotAlgorithmPreset)):
    # The fastest backend that keeps the precision's promise (benchmarks --precision,
    # H100, TFLOP/s at 4096^3 / 8192^3 / 4097^3, error at 4096^3). Mosaic's
    # bf16 pieces with X6 (float32_accurate too): 103 / 114 / 85, error 2.0e-7, where
    # XLA's X6 runs 84 / 99 / 32 at 4.4e-6 and IEEE SGEMM 52 / 52 / 45 at 1.15e-6. X9:
    # XLA's errs 2.9e-4 (not 9 products), mosaic's 2.0e-7: mosaic at every size. X3 and
    # BF16 (f32 inputs): XLA where cuBLAS gets 16-byte-aligned bf16 rows (X3 172 / 212
    # vs 158 / 202), mosaic where not (4097^3: X3 137 vs 51, BF16 243 vs 120). Small
    # products (below 512^3, unmeasured, launch-bound) stay on XLA (float32_accurate
    # there: IEEE SGEMM), and so do skinny ones (min(M, N) < 128, unmeasured): they are
    # bound by reading the wide operand, which the pieces pass reads, writes 1.5x of and
    # the kernel reads again.
    split = _precisions.split_of(precision, dtype)
    bf16_misaligned = any(d * 2 % 16 for d in leading_dims)
    large = m * n * k >= 512**3 and min(m, n) >= 128
    # float32_f16x3 (opt-in for speed): mosaic wherever large.
    if split is not None and status["mosaic"] is None and (
        precision == jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X9
        or (large and (len(split.products) >= 6 or bf16_misaligned or split.scaled))):
      return "mosaic"
    return "xla"
  # Small square-ish 16-bit products: the Triton kernel's single short launch beats cuBLAS
  # (bf16 256^3: 1.24x, 512^3: 1.60x; at 1024^3 cuBLAS wins again, 0.74x). Not batched:
  # 64 x 256^3 bf16 ran at 0.80x cuBLAS's batched kernel.
  if (dtype.itemsize == 2 and batch == 1 and 256 <= min(m, n, k) and max(m, n, k) <= 512
      and status["triton"] is None):
    return "triton"
  # An epilogue (beta * C, a bias, an activation) with 16-bit inputs: the mosaic kernel
  # applies it to its f32 accumulator before the single store (C through TMA), where XLA
  # writes the product and reads it back in a fusion (or a cuBLASLt bias epilogue).
  # beta * C: bf16 4096^3 1.10-1.18x, 8192^3 1.06-1.12x the jnp.dot expression (H100;
  # 1.086x at 4096^3 on the H200), 0.87x at 2048^3. Bias (+ GELU):
  # the MLP layer x(8192x4096) @ W1 + b1 1.13x (1.06x) jnp.dot + b1 (+ jax.nn.gelu),
  # CUPTI. Under a training step's grad it is a wash (wall clock 0.95-1.00x the jnp.dot
  # step across runs, kernel time 0.96x: XLA fuses the bias into cuBLASLt there too, and
  # the GELU passes around the op cost more than XLA's own; README "In a Flax model"),
  # and on XLA with an f32 product it was 0.94-0.95x. So from 4096 on.
  if (has_epilogue and dtype.itemsize == 2 and batch == 1 and min(m, n, k) >= 4096
      and status["mosaic"] is None):
    return "mosaic"
  # Small or skinny products are launch- or bandwidth-bound: cuBLAS's specialised kernels
  # win there (16x8192x8192 bf16: jnp.dot 59, mosaic 31, triton 37 TFLOP/s).
  if min(m, n) < 128 or m * n * k < 512**3:
    return "xla"
  misaligned = any(d * dtype.itemsize % 16 for d in leading_dims)
  ieee_f32 = dtype == np.float32 and precision == jax.lax.Precision.HIGHEST
  # IEEE f32 with a full wave of the cuda kernel's 128x128 tiles (2 blocks per SM) or
  # more and a long K: its stream-K tail evens out the part-full last wave that cuBLAS
  # leaves (H200: 3000^3 1.12x, 4097^3 1.07x, 4096^3 1.01x, 8192^3 1.02x);
  # below a wave or with a short K it lost (2048^3 0.98x, 2047x8191x1023 0.84x), and
  # its layout with both operands K-contiguous (transpose_b alone) runs 0.91x at 4096^3.
  # Not batched: unmeasured. (A backward pass reuses the forward's backend, so the
  # gradient a @ b^T of a cuda forward does run in that layout.)
  if (ieee_f32 and batch == 1 and k >= 2048 and (transpose_a or not transpose_b)
      and status["cuda"] is None and _backend_module("cuda").full_wave(m, n)):
    return "cuda"
  # TF32 pays for a transposed copy of B besides the pads: at 997x1009x1013 that lost
  # (0.88x), from 2047x8191x1023 (1.5x) up it wins.
  small_tf32 = dtype == np.float32 and m * n * k * batch < 2**32
  if misaligned and not ieee_f32 and not small_tf32 and status["mosaic"] is None:
    return "mosaic"  # TMA + wgmma on padded copies; the IEEE-f32 case has no fast kernel
  return "xla"


def _resolve_config(module, config, m, n, k, dtype, precision, out_dtype, c_dtype):
  if config is not None:
    if not isinstance(config, module.Config):
      raise TypeError(
          f"config must be a pallas_gemm.matmul.{module.NAME}.Config for backend={module.NAME!r}; "
          f"got {type(config).__module__}.{type(config).__qualname__}")
    return config
  from pallas_gemm.matmul import tuning  # imported late: tuning imports backends, not the reverse
  return tuning.resolve_config(module.NAME, m, n, k, dtype, precision, out_dtype=out_dtype,
                               c_dtype=c_dtype)


# ----------------------------------------------------------------------------- public entry


def gemm(a, b, c=None, *, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
         precision=None, out_dtype=None, backend="auto", config=None, interpret=None,
         bias=None, activation=None, a_activation=None):
  """Returns ``act(alpha * op(a) @ op(b) + beta * c + bias)`` (BLAS GEMM + epilogue), jittable.

  Args:
    a: (..., M, K), or (..., K, M) with ``transpose_a``; float32, bfloat16 or float16.
    b: (..., K, N), or (..., N, K) with ``transpose_b``. Leading (batch) dims equal to a's,
      or none (one b shared by every batch entry).
    c: None, or an array broadcastable to the output shape (..., M, N). As in BLAS, c is
      not read when ``beta == 0`` (NaNs in it do not propagate).
    alpha, beta: Python floats (static: they select the kernel's epilogue). With K = 0
      the product is not formed and alpha is not applied (BLAS's quick return), so even
      a NaN or infinite alpha gives ``beta * c``.
    transpose_a, transpose_b: read the operand as its transpose over the last two axes.
    precision: as for ``jnp.dot``. For float32 inputs ``jax.lax.Precision.HIGHEST`` is
      IEEE fp32; None/DEFAULT/HIGH let the GPU use TF32 tensor cores (about 3e-4 relative
      error, ~8x faster). Ignored for 16-bit inputs (always exact products). Also a
      ``jax.lax.DotAlgorithmPreset`` (jnp.dot's meaning; its input dtypes must match),
      or ``"float32_accurate"``: float32 on tensor cores with an error no worse than IEEE
      SGEMM's, or ``"float32_f16x3"``: faster, each element kept to 23 bits (see
      ``pallas_gemm/core/precision.py``).
    out_dtype: result dtype; default the promoted input dtype. Accumulation is float32.
    backend: "auto" | "xla" | "triton" | "mosaic" | "cuda". See ``backends()``.
    config: a backend's ``Config`` (``pallas_gemm.<backend>.Config``); None picks the
      autotune cache, then the shipped tuned table, then a shape heuristic.
    interpret: run Pallas backends in interpret mode; None means "when not on a GPU".
    bias: None or an (N,) vector added to every row (after beta * c).
    activation: None, "relu", "gelu" (tanh approximation), "gelu_exact" or "silu",
      applied last. The whole epilogue runs in f32 before the cast to out_dtype, inside
      the kernel for mosaic; in XLA's fusion for xla, which rounds a bf16 product to
      bf16 first (as ``jnp.dot(a, b) + bias`` does); cuda and triton apply bias and
      activation in one XLA pass after an f32 result. Under differentiation the
      kernel computes the pre-activation (bias included) and XLA applies the activation
      and its derivative around it.
    a_activation: None or an activation name as for ``activation``: the product reads
      act(a) (elementwise, in f32, rounded to a's dtype) in place of a. For the layer
      after an activation: ``gemm(z, w, a_activation="gelu")`` is
      ``gemm(gelu(z), w)``, but its gradient in z is one GEMM whose epilogue multiplies
      by gelu'(z) (fused in mosaic's, an XLA pass after the others), where the unfused
      pair spends a pass over the hidden gradient on it. act(a) itself is an XLA pass
      before the kernel, as jnp writes it (`mlp` computes it in the previous layer's
      epilogue instead).
  """
  return _gemm(a, b, c, alpha=alpha, beta=beta, transpose_a=transpose_a,
               transpose_b=transpose_b, precision=precision, out_dtype=out_dtype,
               backend=backend, config=config, interpret=interpret, bias=bias,
               activation=activation, a_activation=a_activation)


def _gemm(a, b, c, *, alpha, beta, transpose_a, transpose_b, precision, out_dtype, backend,
          config, interpret, bias, activation, a_activation, keep_pre=False, a_given=None):
  """`gemm`, and for `mlp`: keep_pre returns (act(z), z), z the pre-activation; a_given is
  act(a), computed by the keep_pre call that computed a (the product reads it)."""
  a_dtype, b_dtype = dtype_of(a, "a"), dtype_of(b, "b")
  dtype = np.dtype(jnp.promote_types(a_dtype, b_dtype))
  for name, flag in (("transpose_a", transpose_a), ("transpose_b", transpose_b)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{name} must be a bool; got {type(flag).__name__} {flag!r}")
  transpose_a, transpose_b = bool(transpose_a), bool(transpose_b)
  if a.ndim < 2:
    raise ValueError(f"a must have rank >= 2 (..., M, K); got shape {a.shape}")
  if b.ndim < 2:
    raise ValueError(f"b must have rank >= 2 (..., K, N); got shape {b.shape}")
  m, k = (a.shape[-1], a.shape[-2]) if transpose_a else (a.shape[-2], a.shape[-1])
  k_b, n = (b.shape[-1], b.shape[-2]) if transpose_b else (b.shape[-2], b.shape[-1])
  if k != k_b:
    raise ValueError(
        f"contracting dimensions differ: a {a.shape} (transpose_a={transpose_a}) has K={k}, "
        f"b {b.shape} (transpose_b={transpose_b}) has K={k_b}")
  batch_shape = tuple(a.shape[:-2])
  if b.ndim > 2 and tuple(b.shape[:-2]) != batch_shape:
    raise ValueError(
        f"batch dimensions of b must equal a's {batch_shape} or be absent (shared b); "
        f"got b.shape {b.shape}")
  out_shape = batch_shape + (m, n)

  alpha, beta = _static_float(alpha, "alpha"), _static_float(beta, "beta")
  if c is not None:
    c_dtype = np.dtype(c.dtype) if hasattr(c, "dtype") else None
    if c_dtype is None or not jnp.issubdtype(c_dtype, jnp.floating):
      raise TypeError(f"c must be a floating-point array; got {type(c).__name__} {c_dtype}")
    try:
      fits = np.broadcast_shapes(tuple(c.shape), out_shape) == out_shape
    except ValueError:
      fits = False
    if not fits:
      raise ValueError(
          f"c must broadcast to the output shape {out_shape}; got c.shape {tuple(c.shape)}")
  elif beta != 0.0:
    raise ValueError(f"beta={beta} needs c; got c=None")

  if bias is not None:
    if not hasattr(bias, "dtype") or not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"bias must be a floating-point array; got {type(bias).__name__} "
                      f"{getattr(bias, 'dtype', None)}")
    if tuple(bias.shape) != (n,):
      raise ValueError(f"bias must have shape (N,) = ({n},); got {tuple(bias.shape)}")
  for name, act in (("activation", activation), ("a_activation", a_activation)):
    if act is not None and (not isinstance(act, str) or act not in epilogue.ACTIVATIONS):
      raise ValueError(f"{name} must be None or one of {sorted(epilogue.ACTIVATIONS)}; "
                       f"got {act!r}")
  if out_dtype is None:
    out_dtype = dtype
  else:
    try:
      out_dtype = np.dtype(out_dtype)
    except TypeError:
      raise TypeError(f"out_dtype must be a dtype; got {out_dtype!r}") from None
    if out_dtype not in SUPPORTED_DTYPES:
      raise TypeError(f"out_dtype must be one of float32, bfloat16, float16; got {out_dtype}")
  precision = _precisions.normalize(precision)
  _precisions.check_dtype(precision, dtype)
  precision = _precisions.effective(precision, dtype)
  if interpret is None:
    interpret = not _on_gpu()
  elif not isinstance(interpret, (bool, np.bool_)):
    raise TypeError(f"interpret must be None or a bool; got {type(interpret).__name__}")

  if any(explicitly_sharded(x) for x in (a, b, c, bias) if x is not None):
    if backend not in ("auto", "xla") or config is not None:
      raise ValueError(
          f"backend={backend!r}: an operand is sharded over Explicit mesh axes "
          "(jax.sharding.AxisType.Explicit), where gemm runs XLA's dot (backend 'auto' or "
          "'xla', no config); the Pallas and CUDA kernels are partitioned in Auto mode")
    given = a_given is not None
    z = _explicit_mode_gemm(a_given if given else a, b, c, alpha=alpha, beta=beta,
                            transpose_a=transpose_a, transpose_b=transpose_b,
                            precision=precision, out_dtype=out_dtype, bias=bias,
                            activation=None if keep_pre else activation,
                            a_activation=None if given else a_activation)
    return (epilogue.activated(z, activation), z) if keep_pre else z

  # Choose the backend and its config.
  if backend == "auto" and config is not None:  # a config names its backend
    name = type(config).__module__.rsplit(".", 1)[-1]
    if name not in BACKENDS or not isinstance(config, _backend_module(name).Config):
      raise TypeError(f"config must be a pallas_gemm.<backend>.Config; got {type(config).__qualname__}")
    backend = name
  if backend == "auto":
    backend = _auto_backend(dtype, precision, m, n, k, (a.shape[-1], b.shape[-1], n),
                            batch=math.prod(batch_shape), transpose_a=transpose_a,
                            transpose_b=transpose_b,
                            has_epilogue=(c is not None and beta != 0.0) or bias is not None
                            or activation is not None or a_activation is not None)
  elif backend not in BACKENDS:
    raise ValueError(f"backend must be 'auto' or one of {BACKENDS}; got {backend!r}")
  reason = backends()[backend]
  if reason is not None:
    raise BackendUnavailableError(f"backend={backend!r} is unavailable here: {reason}")
  module = _backend_module(backend)
  reason = module.supports(dtype, precision)
  if reason is not None:
    raise ValueError(f"backend={backend!r} cannot compute dtype={dtype}, precision={precision}: {reason}")

  # Zero-size products never reach a kernel: the sum over an empty K is 0.
  if 0 in out_shape or k == 0:
    c_full = None if c is None or 0 in out_shape else jnp.broadcast_to(c, out_shape)
    z = epilogue.apply(jnp.zeros(out_shape, jnp.float32), c_full, bias, beta=beta,
                       activation=None if keep_pre else activation, out_dtype=out_dtype)
    return (epilogue.activated(z, activation), z) if keep_pre else z

  c_dtype = None if c is None or beta == 0.0 else np.dtype(c.dtype)
  config = _resolve_config(module, config, m, n, k, dtype, precision, out_dtype, c_dtype)
  batch = math.prod(batch_shape)
  a3 = jnp.asarray(a, dtype).reshape((batch,) + a.shape[-2:])
  b3 = jnp.asarray(b, dtype).reshape((-1,) + b.shape[-2:])
  c3 = None
  if c is not None and beta != 0.0:
    c3 = jnp.broadcast_to(c, out_shape).reshape((batch, m, n))
  plan = op.Plan(backend, config, alpha, beta if c3 is not None else 0.0, transpose_a,
                 transpose_b, precision, out_dtype, bool(interpret), bias=bias is not None,
                 activation=activation, a_activation=a_activation, keep_pre=keep_pre,
                 a_given=a_given is not None)
  aux = None if a_given is None else jnp.asarray(a_given, dtype).reshape(a3.shape)
  out = op.bind(plan, a3, b3, c3, bias, aux)
  if keep_pre:
    return tuple(x.reshape(out_shape) for x in out)
  return out.reshape(out_shape)


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
  out = gemm(x2, w, bias=bias, activation=activation, precision=precision,
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
  h, z = _gemm(x2, w1, **common, out_dtype=None, bias=b1, activation=activation,
               a_activation=None, keep_pre=True)
  out = _gemm(z, w2, **common, out_dtype=out_dtype, bias=b2, activation=None,
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
