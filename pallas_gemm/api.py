"""The front door: `gemm` validates, normalises and dispatches to one backend.

    out = alpha * op(a) @ op(b) + beta * c

Every backend module (`xla`, `triton`, `mosaic`, `cuda`) sees the same normalised
problem (see `_contract.md`): 3-D operands (batch, rows, cols), one dtype, M/N/K >= 1,
static alpha/beta. Everything a user can get wrong is caught here, before any kernel
is traced, with an error that names the argument.

Differentiation: a `jax.custom_vjp` whose backward pass calls the same backend with
transpose flags, so gradients run on the fast kernels too. Batching under `jax.vmap`:
a `jax.custom_batching.custom_vmap` rule folds the vmapped axis into the batch axis the
kernels already have, instead of relying on each lowering's own batching rule.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BACKENDS = ("xla", "triton", "mosaic", "cuda")
SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


class BackendUnavailableError(RuntimeError):
  """The requested backend cannot run on this machine (the message says why)."""


def _backend_module(name: str):
  return importlib.import_module(f"pallas_gemm.{name}")


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


def _dtype_of(x, name: str) -> np.dtype:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray); got {type(x).__name__}")
  dtype = np.dtype(x.dtype)
  if dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"{name}.dtype must be one of float32, bfloat16, float16; got {dtype}")
  return dtype


def _static_float(x, name: str) -> float:
  # alpha/beta are compile-time constants of the kernels (they select the epilogue);
  # a traced value would force a recompile per value or a runtime branch.
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a Python float (a static scalar); got {type(x).__name__} {x!r}")
  return float(x)


def _precision(precision) -> jax.lax.Precision | None:
  if precision is None:
    return None
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2 or precision[0] != precision[1]:
      raise ValueError(f"precision must be one Precision for both operands; got {precision!r}")
    precision = precision[0]
  if isinstance(precision, str):
    try:
      return jax.lax.Precision(precision)
    except ValueError:
      raise ValueError(
          f"precision must be None, 'default', 'high', 'highest' (or another jax.lax.Precision name); got {precision!r}") from None
  if isinstance(precision, jax.lax.Precision):
    return precision
  raise TypeError(f"precision must be None, a str or a jax.lax.Precision; got {type(precision).__name__}")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one call: hashable, so it can key traces and custom rules."""
  backend: str
  config: Any
  alpha: float
  beta: float
  transpose_a: bool
  transpose_b: bool
  precision: jax.lax.Precision | None
  out_dtype: np.dtype
  interpret: bool
  c_dtype: np.dtype | None = None  # None: no C term (c absent or beta == 0)


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _auto_backend(dtype: np.dtype, precision, m: int, n: int, k: int,
                  leading_dims: tuple[int, ...], batch: int = 1, transpose_a: bool = False,
                  transpose_b: bool = False) -> str:
  """The `backend="auto"` decision, from the H200 measurements in benchmarks/results.

  cuBLAS (jnp.dot) is 1.0-1.03x our best kernels on aligned 16-bit shapes, so it keeps
  them. Our kernels win where cuBLAS falls off its fast path: a row stride that is not
  16-byte aligned (bf16 4097^3: jnp.dot 135 TFLOP/s, mosaic 545; TF32: 118 vs 239), and
  IEEE f32 grids that leave cuBLAS a part-full last wave (cuda with stream-K).
  """
  if not _on_gpu():
    return "xla"
  status = backends()
  # Small square-ish 16-bit products: the Triton kernel's single short launch beats cuBLAS
  # (bf16 256^3: 1.24x, 512^3: 1.60x; at 1024^3 cuBLAS wins again, 0.74x). Not batched:
  # 64 x 256^3 bf16 ran at 0.80x cuBLAS's batched kernel.
  if (dtype.itemsize == 2 and batch == 1 and 256 <= min(m, n, k) and max(m, n, k) <= 512
      and status["triton"] is None):
    return "triton"
  # Small or skinny products are launch- or bandwidth-bound: cuBLAS's specialised kernels
  # win there (16x8192x8192 bf16: jnp.dot 59, mosaic 31, triton 37 TFLOP/s).
  if min(m, n) < 128 or m * n * k < 512**3:
    return "xla"
  misaligned = any(d * dtype.itemsize % 16 for d in leading_dims)
  ieee_f32 = dtype == np.float32 and precision == jax.lax.Precision.HIGHEST
  # IEEE f32 with a full wave of the cuda kernel's 128x128 tiles (2 blocks per SM) or
  # more and a long K: its stream-K tail evens out the part-full last wave that cuBLAS
  # leaves (H200, session 5: 3000^3 1.12x, 4097^3 1.07x, 4096^3 1.01x, 8192^3 1.02x);
  # below a wave or with a short K it lost (2048^3 0.98x, 2047x8191x1023 0.84x), and
  # its layout with both operands K-contiguous (transpose_b alone) runs 0.91x at 4096^3.
  # Not batched: unmeasured. (A backward pass reuses the forward's backend, so the
  # gradient a @ b^T of a cuda forward does run in that layout.)
  from pallas_gemm import cuda, tuning  # noqa: PLC0415 - imported late, as in _resolve_config
  tile = cuda.CONFIGS[1]  # 128x128, two blocks per SM
  full_wave = -(-m // tile.block_m) * -(-n // tile.block_n) >= 2 * tuning.num_sms()
  if (ieee_f32 and batch == 1 and k >= 2048 and full_wave and (transpose_a or not transpose_b)
      and status["cuda"] is None):
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
          f"config must be a pallas_gemm.{module.NAME}.Config for backend={module.NAME!r}; "
          f"got {type(config).__module__}.{type(config).__qualname__}")
    return config
  from pallas_gemm import tuning  # imported late: tuning imports backends, not the reverse
  tuned = tuning.lookup_config(module.NAME, module.Config, m, n, k, dtype, precision)
  fits = getattr(module, "check_smem_budget", None)  # mosaic: the epilogue depends on dtypes
  if tuned is not None and fits is not None:
    try:
      fits(tuned, dtype, out_dtype, c_dtype, k)
    except ValueError:  # tuned for another output/C dtype; the heuristic adapts to this one
      tuned = None
  return tuned if tuned is not None else module.default_config(m, n, k, dtype)


# ----------------------------------------------------------------------------- public entry


def gemm(a, b, c=None, *, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
         precision=None, out_dtype=None, backend="auto", config=None, interpret=None):
  """Returns ``alpha * op(a) @ op(b) + beta * c`` (BLAS GEMM), jittable.

  Args:
    a: (..., M, K), or (..., K, M) with ``transpose_a``; float32, bfloat16 or float16.
    b: (..., K, N), or (..., N, K) with ``transpose_b``. Leading (batch) dims equal to a's,
      or none (one b shared by every batch entry).
    c: None, or an array broadcastable to the output shape (..., M, N). As in BLAS, c is
      not read when ``beta == 0`` (NaNs in it do not propagate).
    alpha, beta: Python floats (static: they select the kernel's epilogue).
    transpose_a, transpose_b: read the operand as its transpose over the last two axes.
    precision: as for ``jnp.dot``. For float32 inputs ``jax.lax.Precision.HIGHEST`` is
      IEEE fp32; None/DEFAULT/HIGH let the GPU use TF32 tensor cores (about 3e-4 relative
      error, ~8x faster). Ignored for 16-bit inputs (always exact products).
    out_dtype: result dtype; default the promoted input dtype. Accumulation is float32.
    backend: "auto" | "xla" | "triton" | "mosaic" | "cuda". See ``backends()``.
    config: a backend's ``Config`` (``pallas_gemm.<backend>.Config``); None picks the
      autotune cache, then the shipped tuned table, then a shape heuristic.
    interpret: run Pallas backends in interpret mode; None means "when not on a GPU".
  """
  a_dtype, b_dtype = _dtype_of(a, "a"), _dtype_of(b, "b")
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

  if out_dtype is None:
    out_dtype = dtype
  else:
    try:
      out_dtype = np.dtype(out_dtype)
    except TypeError:
      raise TypeError(f"out_dtype must be a dtype; got {out_dtype!r}") from None
    if out_dtype not in SUPPORTED_DTYPES:
      raise TypeError(f"out_dtype must be one of float32, bfloat16, float16; got {out_dtype}")
  precision = _precision(precision)
  if interpret is None:
    interpret = not _on_gpu()
  elif not isinstance(interpret, (bool, np.bool_)):
    raise TypeError(f"interpret must be None or a bool; got {type(interpret).__name__}")

  # Choose the backend and its config.
  if backend == "auto" and config is not None:  # a config names its backend
    name = type(config).__module__.rsplit(".", 1)[-1]
    if name not in BACKENDS or not isinstance(config, _backend_module(name).Config):
      raise TypeError(f"config must be a pallas_gemm.<backend>.Config; got {type(config).__qualname__}")
    backend = name
  if backend == "auto":
    backend = _auto_backend(dtype, precision, m, n, k, (a.shape[-1], b.shape[-1], n),
                            batch=math.prod(batch_shape), transpose_a=transpose_a,
                            transpose_b=transpose_b)
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
    if c is None or beta == 0.0 or 0 in out_shape:
      return jnp.zeros(out_shape, out_dtype)
    return (beta * jnp.broadcast_to(c, out_shape).astype(jnp.float32)).astype(out_dtype)

  c_dtype = None if c is None or beta == 0.0 else np.dtype(c.dtype)
  config = _resolve_config(module, config, m, n, k, dtype, precision, out_dtype, c_dtype)
  batch = math.prod(batch_shape)
  a3 = jnp.asarray(a, dtype).reshape((batch,) + a.shape[-2:])
  b3 = jnp.asarray(b, dtype).reshape((-1,) + b.shape[-2:])
  c3 = None
  if c is not None and beta != 0.0:
    c3 = jnp.broadcast_to(c, out_shape).reshape((batch, m, n))
  plan = _Plan(backend, config, alpha, beta if c3 is not None else 0.0, transpose_a, transpose_b,
               precision, out_dtype, bool(interpret), None if c3 is None else np.dtype(c3.dtype))
  return _gemm_vjp(plan, a3, b3, c3).reshape(out_shape)


# ----------------------------------------------------------------------------- vmap


@functools.lru_cache(maxsize=None)
def _vmappable(plan: _Plan):
  """The backend call for one plan, with a vmap rule that folds the vmapped axis into batch."""
  module = _backend_module(plan.backend)

  def call(a3, b3, *c3):
    return module.gemm(
        a3, b3, c3[0] if c3 else None, alpha=plan.alpha, beta=plan.beta if c3 else 0.0,
        transpose_a=plan.transpose_a, transpose_b=plan.transpose_b, precision=plan.precision,
        out_dtype=plan.out_dtype, config=plan.config, interpret=plan.interpret)

  call = jax.custom_batching.custom_vmap(call)

  @call.def_vmap
  def rule(axis_size, in_batched, a4, b4, *c4):
    a_batched, b_batched, *c_batched = in_batched
    batch = max(x.shape[1] if bat else x.shape[0] for x, bat in ((a4, a_batched), (b4, b_batched)))

    def fold(x, batched, rows_of_shared=False):
      # (V, B, r, c) -> (V*B, r, c); unbatched operands are repeated across V. A b shared by
      # every batch entry (B == 1) stays shared when it is not vmapped either.
      if not batched:
        if rows_of_shared:
          return x
        x = jnp.broadcast_to(x, (axis_size,) + x.shape)
      x = jnp.broadcast_to(x, (axis_size, batch) + x.shape[2:])
      return x.reshape((axis_size * batch,) + x.shape[2:])

    if axis_size * batch == 0:  # an empty vmapped axis: nothing for a kernel to do
      m = a4.shape[-1] if plan.transpose_a else a4.shape[-2]
      n = b4.shape[-2] if plan.transpose_b else b4.shape[-1]
      return jnp.zeros((axis_size, batch, m, n), plan.out_dtype), True
    a_f = fold(a4, a_batched)
    b_f = fold(b4, b_batched, rows_of_shared=b4.shape[0] == 1)
    c_f = [fold(c, bat) for c, bat in zip(c4, c_batched)]
    out = call(a_f, b_f, *c_f)
    return out.reshape((axis_size, batch) + out.shape[1:]), True

  return call


# ----------------------------------------------------------------------------- grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gemm_vjp(plan: _Plan, a3, b3, c3):
  return _vmappable(plan)(a3, b3, *(() if c3 is None else (c3,)))


def _gemm_fwd(plan, a3, b3, c3):
  return _gemm_vjp(plan, a3, b3, c3), (a3, b3)


def _gemm_bwd(plan, residuals, g):
  """d/d(a, b, c) of alpha*op(a)@op(b) + beta*c, as two more GEMMs of the same backend."""
  a3_in, b3_in = residuals
  ta, tb = plan.transpose_a, plan.transpose_b
  # Backends take one input dtype. A cotangent wider than the inputs (f16 in, f32 out)
  # keeps its width: narrowing it would overflow under f16 loss scaling.
  wide = np.dtype(jnp.promote_types(g.dtype, a3_in.dtype))
  g_in, a3, b3 = g.astype(wide), a3_in.astype(wide), b3_in.astype(wide)

  def mm(x, y, *, trans_x, trans_y, out_dtype):
    p = dataclasses.replace(plan, beta=0.0, transpose_a=trans_x, transpose_b=trans_y,
                            out_dtype=np.dtype(out_dtype), config=None, c_dtype=None)
    return _run(p, x, y)

  # dA = alpha * g @ op(b)^T, stored as op(a) is stored.
  if not ta:
    da = mm(g_in, b3, trans_x=False, trans_y=not tb, out_dtype=a3_in.dtype)
  else:  # dA^T = alpha * op(b) @ g^T
    b_full = jnp.broadcast_to(b3, (a3.shape[0],) + b3.shape[1:])
    da = mm(b_full, g_in, trans_x=tb, trans_y=True, out_dtype=a3_in.dtype)
  # dB = alpha * op(a)^T @ g; a b shared across the batch sums over it, which is one
  # GEMM with the batch folded into the contraction.
  a_c, g_c = a3, g_in
  if b3.shape[0] == 1 and a3.shape[0] > 1:
    a_rows = jnp.swapaxes(a3, 1, 2) if ta else a3          # (B, M, K)
    a_c, ta = a_rows.reshape(1, -1, a_rows.shape[-1]), False
    g_c = g_in.reshape(1, -1, g_in.shape[-1])              # (1, B*M, N)
  if not tb:
    db = mm(a_c, g_c, trans_x=not ta, trans_y=False, out_dtype=b3_in.dtype)
  else:  # dB^T = alpha * g^T @ op(a)
    db = mm(g_c, a_c, trans_x=True, trans_y=ta, out_dtype=b3_in.dtype)
  dc = None
  if plan.c_dtype is not None:
    dc = (plan.beta * g.astype(jnp.float32)).astype(plan.c_dtype)
  return da, db, dc


def _run(plan: _Plan, a3, b3):
  """A GEMM on already-normalised operands (the backward pass's entry), config re-resolved."""
  module = _backend_module(plan.backend)
  m = a3.shape[-1] if plan.transpose_a else a3.shape[-2]
  k = a3.shape[-2] if plan.transpose_a else a3.shape[-1]
  n = b3.shape[-2] if plan.transpose_b else b3.shape[-1]
  config = _resolve_config(module, None, m, n, k, np.dtype(a3.dtype), plan.precision,
                           plan.out_dtype, None)
  return _gemm_vjp(dataclasses.replace(plan, config=config), a3, b3, None)


_gemm_vjp.defvjp(_gemm_fwd, _gemm_bwd)
