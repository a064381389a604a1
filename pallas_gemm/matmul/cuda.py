"""The "cuda" backend: a register-tiled SGEMM as an XLA FFI custom call.

The kernel follows the register-tiled SGEMM of "Matrix Multiplication on GPU, Part 2: Tiling" (lawmurray/gpu-gemm),
generalised to any shape, layout and batch.

Python twin of ``cuda_sgemm.cu`` (read its header for the kernel design). The shared
library ``_cuda_sgemm.so`` is built by CMake at install time when nvcc is present;
this module finds it, registers its handler with XLA for the CUDA platform, and calls
it through ``jax.ffi.ffi_call``.

float32 inputs only: the kernel multiplies with FFMA, which is IEEE fp32 whatever
``precision`` asks for.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
import pathlib
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.mgpu import hw

NAME = "cuda"

# XLA custom-call target registered by this module.
TARGET_NAME = "pallas_gemm_cuda_sgemm"
# Environment variable naming the shared library explicitly (overrides the search).
LIBRARY_ENV = "PALLAS_GEMM_CUDA_LIB"
_LIBRARY_NAMES = ("_cuda_sgemm.so", "lib_cuda_sgemm.so")
_CONFIG_FIELDS = (
    "block_m", "block_n", "block_k", "warp_m", "warp_n", "thread_m", "thread_n", "stages")


# ---------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------

# The template instances compiled into cuda_sgemm.cu, as
# (block_m, block_n, block_k, warp_m, warp_n, thread_m, thread_n, stages); the
# library exports the same list (tests/test_cuda_plumbing.py checks they agree).
_TILED = (
    (256, 128, 8, 64, 64, 8, 16, 4),  # the original design's tile: 8 warps, 1 block per SM
    (128, 128, 8, 64, 64, 8, 16, 4),  # its warp/thread tiles: 4 warps, 2 blocks per SM
    (128, 64, 8, 64, 32, 8, 8, 4),    # 4 warps, 3 blocks per SM
)
# The textbook shared-memory kernel (32×32 threads, one output each), the baseline.
_TEXTBOOK = (32, 32, 32, 1, 32, 1, 1, 1)
_COMPILED = _TILED + (_TEXTBOOK,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tile sizes of the CUDA kernel; only combinations compiled into the library exist.

  block_m × block_n: output tile of a thread block; block_k: depth of a K-slice;
  warp_m × warp_n: output tile of a warp; thread_m × thread_n: output tile of a
  thread (registers); stages: depth of the cp.async pipeline.

  Fields left out are filled from the first compiled configuration that matches the
  given ones (``Config()`` is the 256×128 kernel, ``Config(block_m=128,
  block_n=64)`` the 128×64 one); ``TEXTBOOK`` is the textbook 32×32 kernel.

  stream_k: where a grid of whole tiles would leave some of the GPU's resident block
  slots idle in its last wave, share the last waves out among all of them by K-slices
  and sum the tiles cut between blocks through a scratch buffer (the ``Schedule`` in
  cuda_sgemm.cu). False: one block per tile. The textbook kernel ignores it.
  """

  block_m: int | None = None
  block_n: int | None = None
  block_k: int | None = None
  warp_m: int | None = None
  warp_n: int | None = None
  thread_m: int | None = None
  thread_n: int | None = None
  stages: int | None = None
  stream_k: bool = True

  def __post_init__(self):
    if not isinstance(self.stream_k, (bool, np.bool_)):
      raise ValueError(f"Config.stream_k must be a bool, got {self.stream_k!r}")
    object.__setattr__(self, "stream_k", bool(self.stream_k))
    given = {}
    for name in _CONFIG_FIELDS:
      value = getattr(self, name)
      if value is None:
        continue
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
      given[name] = int(value)
    for i, name in enumerate(_CONFIG_FIELDS):
      allowed = sorted({c[i] for c in _COMPILED})
      if name in given and given[name] not in allowed:
        raise ValueError(
            f"Config.{name}={given[name]} is not compiled into the CUDA library "
            f"(tile sizes are template parameters; values compiled: {allowed}); valid "
            f"configs:\n{_valid_configs_text()}")
    matches = [c for c in _COMPILED
               if all(c[_CONFIG_FIELDS.index(name)] == v for name, v in given.items())]
    if not matches:
      text = ", ".join(f"{name}={v}" for name, v in given.items())
      raise ValueError(
          f"Config({text}) is not a combination compiled into the CUDA library (tile "
          f"sizes are template parameters); valid configs:\n{_valid_configs_text()}")
    for name, value in zip(_CONFIG_FIELDS, matches[0]):
      object.__setattr__(self, name, value)

  def astuple(self) -> tuple[int, ...]:
    """The tile fields (the compiled template instance), without stream_k."""
    return tuple(getattr(self, name) for name in _CONFIG_FIELDS)

  @property
  def is_textbook(self) -> bool:
    return self.astuple() == _TEXTBOOK

  replace = dataclasses.replace


def _valid_configs_text() -> str:
  return "\n".join(
      "  Config(" + ", ".join(f"{n}={v}" for n, v in zip(_CONFIG_FIELDS, c)) + ")"
      for c in _COMPILED)


CONFIGS = tuple(Config(**dict(zip(_CONFIG_FIELDS, c))) for c in _TILED)
TEXTBOOK = Config(**dict(zip(_CONFIG_FIELDS, _TEXTBOOK)))


# Autotuning candidates (tuning.default_candidates): the template instances compiled into
# cuda_sgemm.cu (compiled_configs()).
TUNING_GRID = {"f32": {("block_m", "block_n"): ((256, 128), (128, 128), (128, 64))}}


def full_wave(m: int, n: int) -> bool:
  """Whether an m x n output fills a whole wave of the 128x128 tiles at two blocks per SM,
  from where stream-K evens out the part-full last wave (api's backend choice)."""
  tile = CONFIGS[1]
  return -(-m // tile.block_m) * -(-n // tile.block_n) >= 2 * hw.num_sms()


def default_config(m: int, n: int, k: int, dtype, *, out_dtype=None, c_dtype=None,
                   precision=None) -> Config:
  """128x128 where its tiles number at least 0.9x the SMs (0.45 of a wave at 2 blocks per
  SM), else 128x64 (more, smaller tiles for small outputs).

  From a full wave of 128x128 tiles up, stream-K (the default) evens out the part-full
  last wave, which makes 128x128 beat 128x64 for e.g. 4097^3 (4.1 waves): 1.07x jnp.dot
  vs 1.02x on the H200. Below a wave the kernel runs whole tiles (see MakeSchedule in
  cuda_sgemm.cu). The 256x128 tile is not a default: the 128x128 block
  with the same warp and thread tiles ran 5-16% faster for NN and NT at 2048^3 and 4096^3
  on the H200 (4% slower for TT).
  """
  del k, dtype, out_dtype, c_dtype, precision  # the tile depends only on the output grid
  tile, small = CONFIGS[1], CONFIGS[2]  # 128x128, 128x64
  blocks = math.ceil(m / tile.block_m) * math.ceil(n / tile.block_n)
  return tile if blocks >= 0.9 * hw.num_sms() else small


# ---------------------------------------------------------------------------
# The shared library.
# ---------------------------------------------------------------------------


def _candidate_paths() -> list[pathlib.Path]:
  """Where the library may be: beside this file (regular install, in-tree build),
  then in every pallas_gemm/matmul folder on the import path (scikit-build-core's editable
  install puts compiled files in site-packages/pallas_gemm/matmul, not in the source tree)."""
  dirs = [pathlib.Path(__file__).resolve().parent]
  roots = [sysconfig.get_path("platlib"), sysconfig.get_path("purelib"), *sys.path]
  for root in roots:
    if root:
      dirs.append(pathlib.Path(root).resolve() / "pallas_gemm" / "matmul")
  seen = set()
  paths = []
  for d in dirs:
    for name in _LIBRARY_NAMES:
      path = d / name
      if path not in seen:
        seen.add(path)
        paths.append(path)
  return paths


def _load_library() -> tuple[ctypes.CDLL | None, str | None]:
  """Returns (library, None) or (None, why not)."""
  explicit = os.environ.get(LIBRARY_ENV)
  paths = [pathlib.Path(explicit)] if explicit else _candidate_paths()
  found = [p for p in paths if p.is_file()]
  if not found:
    where = f"{LIBRARY_ENV}={explicit}" if explicit else ", ".join(
        str(p.parent) for p in paths[::len(_LIBRARY_NAMES)])
    return None, (
        "the CUDA library _cuda_sgemm.so was not built (no CUDA compiler when "
        f"pallas_gemm was installed?); looked in: {where}")
  try:
    lib = ctypes.CDLL(str(found[0]))
  except OSError as e:
    return None, f"could not load {found[0]}: {e}"
  try:
    _declare(lib)
  except AttributeError as e:  # a build from before an entry point was added
    return None, (f"{found[0]} lacks an entry point this pallas_gemm needs ({e}): a stale"
                  " build; reinstall pallas_gemm (see BUILD.md)")
  return lib, None


def _declare(lib: ctypes.CDLL) -> None:
  """The C signatures of the library's host entry points."""
  lib.pallas_gemm_cuda_num_configs.restype = ctypes.c_int
  lib.pallas_gemm_cuda_config.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
  lib.pallas_gemm_cuda_config.restype = ctypes.c_int
  lib.pallas_gemm_cuda_hilbert.argtypes = [
      ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
      ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
  lib.pallas_gemm_cuda_hilbert.restype = ctypes.c_int
  i64, p64 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
  lib.pallas_gemm_cuda_schedule.argtypes = [i64, i64, i64, ctypes.c_int, p64]
  lib.pallas_gemm_cuda_schedule.restype = None
  lib.pallas_gemm_cuda_work_item.argtypes = [i64, i64, i64, i64, i64, i64, p64, p64]
  lib.pallas_gemm_cuda_work_item.restype = ctypes.c_int


_LIB, _LIB_ERROR = _load_library()
LIBRARY_PATH: str | None = _LIB._name if _LIB is not None else None

if _LIB is not None:
  jax.ffi.register_ffi_target(
      TARGET_NAME, jax.ffi.pycapsule(_LIB.PallasGemmCudaSgemm), platform="CUDA")


def library_error() -> str | None:
  """None when the shared library is loaded and its target registered, else why not."""
  return _LIB_ERROR


def compiled_configs() -> tuple[tuple[int, ...], ...]:
  """The configurations the loaded library was compiled with (textbook last)."""
  if _LIB is None:
    raise RuntimeError(_LIB_ERROR)
  out = []
  fields = (ctypes.c_int64 * 8)()
  for i in range(_LIB.pallas_gemm_cuda_num_configs()):
    if _LIB.pallas_gemm_cuda_config(i, fields) != 0:
      raise RuntimeError(f"pallas_gemm_cuda_config({i}) failed")
    out.append(tuple(fields))
  return tuple(out)


def hilbert_tile(index: int, rows: int, cols: int) -> tuple[int, int]:
  """The (row, col) tile that block `index` of a rows × cols grid computes."""
  if _LIB is None:
    raise RuntimeError(_LIB_ERROR)
  row, col = ctypes.c_int64(), ctypes.c_int64()
  if _LIB.pallas_gemm_cuda_hilbert(index, rows, cols, ctypes.byref(row), ctypes.byref(col)):
    raise ValueError(f"hilbert_tile: index {index} outside a {rows}×{cols} grid")
  return row.value, col.value


def schedule(tiles: int, slices: int, slots: int, stream_k: bool) -> tuple[int, int, int]:
  """(dp_tiles, sk_slices, grid): how the kernel splits `tiles` tiles of `slices`
  K-slices over `slots` resident blocks (see Schedule in cuda_sgemm.cu)."""
  if _LIB is None:
    raise RuntimeError(_LIB_ERROR)
  fields = (ctypes.c_int64 * 3)()
  _LIB.pallas_gemm_cuda_schedule(tiles, slices, slots, int(stream_k), fields)
  return tuple(fields)


def work_items(dp_tiles: int, sk_slices: int, slices: int, block: int, grid: int):
  """(stream-K range start, [(tile, slice_begin, slice_end), ...]): block `block`'s
  pieces of work in the order it computes them (the kernel's own code)."""
  if _LIB is None:
    raise RuntimeError(_LIB_ERROR)
  piece, begin = (ctypes.c_int64 * 3)(), ctypes.c_int64()
  items = []
  while _LIB.pallas_gemm_cuda_work_item(dp_tiles, sk_slices, slices, block, grid, len(items),
                                        piece, ctypes.byref(begin)):
    items.append(tuple(piece))
  return begin.value, items


@functools.cache
def unavailable_reason() -> str | None:
  if _LIB is None:
    return _LIB_ERROR
  try:
    devices = jax.devices("cuda")
  except RuntimeError as e:
    return f"no CUDA GPU visible to jax ({e})"
  capability = getattr(devices[0], "compute_capability", None)
  if capability is not None and tuple(int(v) for v in str(capability).split(".")) < (8, 0):
    return f"the CUDA kernel is compiled for compute capability >= 8.0, got {capability}"
  return None


def supports(dtype, precision) -> str | None:
  if jnp.dtype(dtype) != jnp.float32:
    return f"the cuda backend computes float32 only, got {jnp.dtype(dtype).name}"
  # FFMA is IEEE fp32: as accurate as any jax.lax.Precision or "float32_accurate" asks.
  # A DotAlgorithmPreset names an algorithm, which this kernel does not run.
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return f"precision={precision.name} names a tensor-core algorithm; cuda runs IEEE FFMA"
  return None


# ---------------------------------------------------------------------------
# The public function.
# ---------------------------------------------------------------------------


def _align_rows(a, b, *, transpose_a: bool, transpose_b: bool):
  """Zero-pads the stored rows of a and b to multiples of 4 floats (16 bytes).

  The tiled kernels copy 16 bytes at a time and need every stored row 16-byte aligned
  (the handler refuses other rows). Their 4-byte-copy fallback ran 4097^3 at 31.4
  TFLOP/s on the H200 against 45-46 for aligned shapes and was deleted once nothing
  reached it; one padded copy of an operand costs about 1% of such a GEMM. Rows along
  M (transposed A) or N (B) get a longer stride that the kernel skips; a padded K is
  padded in both operands, with zeros, so the extra products are exact zeros.
  """
  pad_to = lambda x: -(-x // 4) * 4
  k = a.shape[1] if transpose_a else a.shape[2]
  k_contiguous = not transpose_a or transpose_b
  k4 = pad_to(k) if k_contiguous else k

  def pad(x, rows, cols):
    extra = (rows - x.shape[1], cols - x.shape[2])
    return x if extra == (0, 0) else jnp.pad(x, ((0, 0), (0, extra[0]), (0, extra[1])))

  if transpose_a:  # (batch, K, M): rows along M
    a = pad(a, k4, pad_to(a.shape[2]))
  else:  # (batch, M, K)
    a = pad(a, a.shape[1], k4)
  if transpose_b:  # (batch_b, N, K)
    b = pad(b, b.shape[1], k4)
  else:  # (batch_b, K, N): rows along N
    b = pad(b, k4, pad_to(b.shape[2]))
  return a, b


# Below this many rows (copying a) or columns (copying b) of the result, the copy costs
# more than a third of what it saves (see `_nt_copy`).
_NT_COPY_MIN_OTHER_DIM = 2048


def _nt_copy(batch: int, m: int, n: int, k: int, batch_b: int) -> str | None:
  """Which operand to copy out of the NT layout (a (M, K) and b (N, K), both K-contiguous),
  "a", "b" or None.

  The kernel runs NT at 0.913x cuBLAS at 4096^3 where TT (a copied to (K, M)) runs 1.022x
  and NN (b copied to (K, N)) 1.007x (H200); no issue-step
  variant closed the gap. NT is the layout of a backward pass's g @ W^T, e.g. the MLP
  step's dh = g_y @ W2^T (one of its five f32 GEMMs; the step ran 0.98x jnp.dot's).
  A copy of a moves 8*M*K bytes (about 66.7/N of the GEMM's time at 50 TFLOP/s and
  3 TB/s) to save 9%: the smaller operand is copied when its ratio is below 3%.
  Measured (H100): NT through the copy 1.001x jnp.dot at 4096^3 (TT 1.019x, NN 1.002x
  alongside); the f32 HIGHEST MLP step runs 0.995-0.997x jnp.dot's (0.98x without it).
  """
  a_elems, b_elems = batch * m * k, batch_b * n * k
  if a_elems <= b_elems and n >= _NT_COPY_MIN_OTHER_DIM:
    return "a"
  if b_elems < a_elems and m >= _NT_COPY_MIN_OTHER_DIM:
    return "b"
  return None


def gemm(a, b, c, *, alpha: float, beta: float, transpose_a: bool, transpose_b: bool,
         precision, out_dtype, config: Config, interpret: bool) -> jax.Array:
  """alpha * op(a) @ op(b) + beta * c with the CUDA kernel (see _contract.md).

  a: (batch, M, K), or (batch, K, M) when transpose_a; b: (batch_b, K, N), or
  (batch_b, N, K) when transpose_b, batch_b in {batch, 1}; c: None or (batch, M, N).
  Transposes are read in place, except the NT layout of long products (see
  `_nt_copy`); an operand whose rows are not 16-byte aligned is copied once, padded (see
  _align_rows). Under vmap every leading dim is a batch dim (vmap_method="broadcast_all").
  """
  if interpret:
    raise ValueError("interpret=True: the cuda backend has no interpreter; it runs on "
                     "an NVIDIA GPU only")
  if (why := supports(a.dtype, precision)) is not None:
    raise ValueError(f"a.dtype: {why}")
  if b.dtype != a.dtype:
    raise ValueError(f"b.dtype must equal a.dtype ({a.dtype}), got {b.dtype}")
  if not isinstance(config, Config):
    raise ValueError(f"config must be a pallas_gemm.matmul.cuda.Config, got {config!r}")
  if _LIB is None:
    raise RuntimeError(f"the cuda backend is unavailable: {_LIB_ERROR}")
  if a.ndim != 3 or b.ndim != 3:
    raise ValueError(f"a and b must be 3-D (batch first), got a{a.shape}, b{b.shape}")
  batch = a.shape[0]
  m, k = (a.shape[2], a.shape[1]) if transpose_a else (a.shape[1], a.shape[2])
  k_b, n = (b.shape[2], b.shape[1]) if transpose_b else (b.shape[1], b.shape[2])
  if k_b != k:
    raise ValueError(f"inner dims differ: a{a.shape} (transpose_a={transpose_a}) has K={k}, "
                     f"b{b.shape} (transpose_b={transpose_b}) has K={k_b}")
  if b.shape[0] not in (batch, 1):
    raise ValueError(f"b batch must be {batch} or 1, got b{b.shape}")
  if c is None:
    beta = 0.0
    # Never read when beta == 0 (the kernel skips C), but the call needs a buffer.
    c = jnp.zeros((1,), jnp.float32)
  elif c.shape != (batch, m, n):
    raise ValueError(f"c must have shape {(batch, m, n)}, got {c.shape}")
  else:
    c = c.astype(jnp.float32)
  copy = _nt_copy(batch, m, n, k, b.shape[0]) if transpose_b and not transpose_a else None
  if copy == "a":
    a, transpose_a = jnp.swapaxes(a, 1, 2), True
  elif copy == "b":
    b, transpose_b = jnp.swapaxes(b, 1, 2), False
  a, b = _align_rows(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
  call = jax.ffi.ffi_call(
      TARGET_NAME,
      jax.ShapeDtypeStruct((batch, m, n), jnp.float32),
      vmap_method="broadcast_all",
  )
  out = call(
      a, b, c,
      alpha=np.float32(alpha),
      beta=np.float32(beta),
      transpose_a=bool(transpose_a),
      transpose_b=bool(transpose_b),
      **{name: int(value) for name, value in zip(_CONFIG_FIELDS, config.astuple())},
      stream_k=config.stream_k,
  )
  if jnp.dtype(out_dtype) != jnp.float32:
    out = out.astype(out_dtype)
  return out
