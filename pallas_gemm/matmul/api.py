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

import math

import jax.numpy as jnp
import numpy as np

from pallas_gemm.core import epilogue, sharding
from pallas_gemm.core.checks import SUPPORTED_DTYPES, dtype_of
from pallas_gemm.matmul import auto, op
from pallas_gemm.mgpu import hw
from pallas_gemm.matmul.auto import BackendUnavailableError
from pallas_gemm.core import precision as _precisions

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
  return gemm_call(a, b, c, alpha=alpha, beta=beta, transpose_a=transpose_a,
               transpose_b=transpose_b, precision=precision, out_dtype=out_dtype,
               backend=backend, config=config, interpret=interpret, bias=bias,
               activation=activation, a_activation=a_activation)


def gemm_call(a, b, c, *, alpha, beta, transpose_a, transpose_b, precision, out_dtype, backend,
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
    interpret = not hw.on_gpu()
  elif not isinstance(interpret, (bool, np.bool_)):
    raise TypeError(f"interpret must be None or a bool; got {type(interpret).__name__}")

  if any(sharding.explicitly_sharded(x) for x in (a, b, c, bias) if x is not None):
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
    if name not in auto.BACKENDS or not isinstance(config, auto.backend_module(name).Config):
      raise TypeError(f"config must be a pallas_gemm.<backend>.Config; got {type(config).__qualname__}")
    backend = name
  if backend == "auto":
    backend = auto.auto_backend(dtype, precision, m, n, k, (a.shape[-1], b.shape[-1], n),
                            batch=math.prod(batch_shape), transpose_a=transpose_a,
                            transpose_b=transpose_b,
                            has_epilogue=(c is not None and beta != 0.0) or bias is not None
                            or activation is not None or a_activation is not None)
  elif backend not in auto.BACKENDS:
    raise ValueError(f"backend must be 'auto' or one of {auto.BACKENDS}; got {backend!r}")
  reason = auto.backends()[backend]
  if reason is not None:
    raise BackendUnavailableError(f"backend={backend!r} is unavailable here: {reason}")
  module = auto.backend_module(backend)
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
