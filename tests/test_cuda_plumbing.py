"""CPU checks of the CUDA backend's plumbing: library, registration, lowering, tile order, Config.

The kernel itself runs only on the GPU (the shared suite in test_gemm.py covers it there);
these tests need the compiled library but no GPU. They skip, saying why, only when the
library was not built (no nvcc when pallas_gemm was installed).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_gemm.matmul import cuda

needs_library = pytest.mark.skipif(
    cuda.library_error() is not None,
    reason=f"CUDA library not built: {cuda.library_error()}")


# --- The library ------------------------------------------------------------------------


@needs_library
def test_library_loads_and_exports_the_handler():
  assert cuda.LIBRARY_PATH is not None
  lib = cuda._LIB
  assert lib.PallasGemmCudaSgemm is not None  # the FFI handler symbol
  assert lib.pallas_gemm_cuda_num_configs() == len(cuda._COMPILED)


def test_a_library_without_the_entry_points_is_reported_stale(monkeypatch):
  # A shared library that loads but lacks the entry points (here the C library, in
  # place of a _cuda_sgemm.so built from older sources) makes the backend unavailable
  # with a reason, instead of failing `import pallas_gemm`.
  import ctypes.util  # noqa: PLC0415
  libc = ctypes.util.find_library("c")
  if libc is None:
    pytest.skip("no C library found to stand in for a stale build")
  monkeypatch.setenv(cuda.LIBRARY_ENV, str(ctypes.CDLL(libc)._name))
  monkeypatch.setattr(cuda.pathlib.Path, "is_file", lambda self: True)
  lib, why = cuda._load_library()
  assert lib is None and "stale build" in why


@needs_library
def test_compiled_configs_match_python_list():
  # Config validation uses cuda._COMPILED; the handler dispatches on the C++ table.
  assert cuda.compiled_configs() == cuda._COMPILED


@needs_library
def test_target_registered_for_cuda():
  from jaxlib import xla_client  # noqa: PLC0415 - registry internals, no public query
  if "CUDA" in xla_client._custom_callback_handler:
    pytest.skip("a CUDA client is live: registrations go straight to it, nothing to inspect")
  pending = [entry[0] for entry in xla_client._custom_callback.get("CUDA", [])]
  assert cuda.TARGET_NAME in pending


# --- Lowering for the GPU (on the CPU) ------------------------------------------------------


def _lower(fn, *args) -> str:
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@needs_library
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("with_c", [False, True])
def test_lowers_to_custom_call(transpose_a, transpose_b, with_c):
  m, n, k = 65, 17, 33
  a = jax.ShapeDtypeStruct((2, k, m) if transpose_a else (2, m, k), np.float32)
  b = jax.ShapeDtypeStruct((1, n, k) if transpose_b else (1, k, n), np.float32)  # shared b
  c = jax.ShapeDtypeStruct((2, m, n), np.float16) if with_c else None
  config = cuda.Config(block_m=128, block_n=64)

  def f(a, b, c):
    return cuda.gemm(a, b, c, alpha=0.5, beta=2.0 if with_c else 0.0,
                     transpose_a=transpose_a, transpose_b=transpose_b, precision=None,
                     out_dtype=np.dtype(np.float32), config=config, interpret=False)

  text = _lower(f, a, b, c)
  assert f"stablehlo.custom_call @{cuda.TARGET_NAME}" in text
  assert f"transpose_a = {str(transpose_a).lower()}" in text
  assert f"transpose_b = {str(transpose_b).lower()}" in text
  assert "block_m = 128 : i64" in text and "block_n = 64 : i64" in text
  assert f"beta = {'2.000000e+00' if with_c else '0.000000e+00'} : f32" in text
  assert "stablehlo.transpose" not in text  # transposes are read in place


@needs_library
@pytest.mark.parametrize("m,n,want", [(2100, 2100, "a"), (2100, 300, "b"), (300, 2100, "a"),
                                      (512, 512, None)])
def test_nt_layout_of_a_long_product_copies_the_smaller_operand(m, n, want):
  """NT (transpose_b alone) is the kernel's slow layout: a long product runs TT (a copied)
  or NN (b copied), whichever copy is smaller; a short one stays NT (see cuda._nt_copy)."""
  k = 64
  a = jax.ShapeDtypeStruct((1, m, k), np.float32)
  b = jax.ShapeDtypeStruct((1, n, k), np.float32)

  def f(a, b):
    return cuda.gemm(a, b, None, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=True,
                     precision=None, out_dtype=np.dtype(np.float32), config=cuda.Config(),
                     interpret=False)

  text = _lower(f, a, b)
  layout = {"a": ("true", "true"), "b": ("false", "false"), None: ("false", "true")}[want]
  assert f"transpose_a = {layout[0]}" in text and f"transpose_b = {layout[1]}" in text
  assert text.count("stablehlo.transpose") == (want is not None)
  assert f"-> tensor<1x{m}x{n}xf32>" in text


@needs_library
def test_lowers_under_vmap_with_leading_batch_dims():
  # broadcast_all: the handler sees (V, batch, ...) operands and treats both as batch.
  a = jax.ShapeDtypeStruct((3, 2, 40, 24), np.float32)
  b = jax.ShapeDtypeStruct((3, 1, 24, 8), np.float32)

  def f(a, b):
    return cuda.gemm(a, b, None, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
                     precision=None, out_dtype=np.dtype(np.float32), config=cuda.Config(),
                     interpret=False)

  text = _lower(jax.vmap(f), a, b)
  assert f"stablehlo.custom_call @{cuda.TARGET_NAME}" in text
  assert "-> tensor<3x2x40x8xf32>" in text


@needs_library
def test_out_dtype_is_a_cast_after_the_call():
  a = jax.ShapeDtypeStruct((1, 8, 8), np.float32)

  def f(a):
    return cuda.gemm(a, a, None, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
                     precision=None, out_dtype=np.dtype(jax.numpy.bfloat16),
                     config=cuda.TEXTBOOK, interpret=False)

  text = _lower(f, a)
  assert f"stablehlo.custom_call @{cuda.TARGET_NAME}" in text
  assert "bf16" in text


# --- Tile order --------------------------------------------------------------------------


@needs_library
@pytest.mark.parametrize("rows,cols", [(5, 3), (3, 5), (17, 33), (33, 17), (1, 1), (64, 64),
                                       (1, 7), (7, 1), (2, 2), (9, 9), (13, 100), (6, 5)])
def test_hilbert_order_is_a_bijection_of_neighbours(rows, cols):
  # The same function the kernel runs on the device (compiled __host__ __device__).
  tiles = [cuda.hilbert_tile(i, rows, cols) for i in range(rows * cols)]
  assert sorted(tiles) == [(r, c) for r in range(rows) for c in range(cols)]
  for (r0, c0), (r1, c1) in zip(tiles, tiles[1:]):
    assert max(abs(r1 - r0), abs(c1 - c0)) == 1, "consecutive blocks must be neighbours"


@needs_library
def test_hilbert_rejects_out_of_range():
  with pytest.raises(ValueError, match="outside"):
    cuda.hilbert_tile(15, 5, 3)


# --- Config -------------------------------------------------------------------------------


def test_config_default_is_the_seed_kernel():
  assert cuda.Config().astuple() == (256, 128, 8, 64, 64, 8, 16, 4)


def test_config_fills_unspecified_fields():
  assert cuda.Config(block_m=128, block_n=64) == cuda.CONFIGS[2]
  assert cuda.Config(block_m=32).is_textbook


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_m=96), "block_m=96 is not compiled"),
    (dict(stages=3), "stages=3 is not compiled"),
    (dict(block_m=256, block_n=64), "not a combination compiled"),
    (dict(thread_n=0), "thread_n must be a positive int"),
    (dict(block_k=8.0), "block_k must be a positive int"),
    (dict(warp_m=True), "warp_m must be a positive int"),
])
def test_config_validation_errors(kwargs, match):
  with pytest.raises(ValueError, match=match) as info:
    cuda.Config(**kwargs)
  if "compiled" in match:
    assert "Config(block_m=256, block_n=128" in str(info.value)  # lists the valid ones


def test_config_is_frozen_and_keyword_only():
  config = cuda.Config()
  with pytest.raises(AttributeError):
    config.block_m = 128
  with pytest.raises(TypeError):
    cuda.Config(256)


@pytest.mark.parametrize("m,n,expected", [
    (4096, 4096, (128, 128)), (2048, 2048, (128, 128)), (1024, 2048, (128, 128)),
    (1024, 1024, (128, 64)), (16, 8192, (128, 64)),
    (4097, 4097, (128, 128)),  # 4.1 waves of 2 per SM: stream-K evens out the last
])
def test_default_config_fills_the_gpu(m, n, expected):
  config = cuda.default_config(m, n, 512, np.float32)
  assert (config.block_m, config.block_n) == expected


def test_supports_float32_only():
  assert cuda.supports(np.float32, jax.lax.Precision.HIGHEST) is None
  assert cuda.supports(np.float32, None) is None
  assert "float32 only" in cuda.supports(jax.numpy.bfloat16, None)
  assert "float32 only" in cuda.supports(np.float16, None)


def test_gemm_rejects_what_it_cannot_do():
  a = jax.ShapeDtypeStruct((1, 8, 8), jax.numpy.bfloat16)
  with pytest.raises(ValueError, match="a.dtype"):
    cuda.gemm(a, a, None, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
              precision=None, out_dtype=np.dtype(np.float32), config=cuda.Config(),
              interpret=False)
  f32 = jax.ShapeDtypeStruct((1, 8, 8), np.float32)
  with pytest.raises(ValueError, match="interpret"):
    cuda.gemm(f32, f32, None, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
              precision=None, out_dtype=np.dtype(np.float32), config=cuda.Config(),
              interpret=True)


@pytest.mark.parametrize("transpose_a,transpose_b,a_shape,b_shape,a_want,b_want", [
    (False, False, (1, 5, 7), (1, 7, 9), (1, 5, 8), (1, 8, 12)),  # K and N padded
    (True, False, (1, 7, 5), (1, 7, 9), (1, 7, 8), (1, 7, 12)),   # K is a row count: kept
    (False, True, (1, 5, 7), (2, 9, 7), (1, 5, 8), (2, 9, 8)),    # K in both, batch kept
    (True, True, (1, 7, 5), (1, 9, 7), (1, 8, 8), (1, 9, 8)),
])
def test_align_rows_pads_to_16_bytes(transpose_a, transpose_b, a_shape, b_shape, a_want, b_want):
  a = jnp.ones(a_shape, jnp.float32)
  b = jnp.ones(b_shape, jnp.float32)
  a2, b2 = cuda._align_rows(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
  assert (a2.shape, b2.shape) == (a_want, b_want)
  # The padding is zeros and the matrices themselves are unchanged.
  assert float(a2.sum()) == a.size and float(b2.sum()) == b.size


def test_align_rows_leaves_aligned_operands_alone():
  a = jnp.ones((2, 8, 12), jnp.float32)
  b = jnp.ones((1, 12, 16), jnp.float32)
  a2, b2 = cuda._align_rows(a, b, transpose_a=False, transpose_b=False)
  assert a2 is a and b2 is b


# --- The work schedule (stream-K) ------------------------------------------------------


@needs_library
@pytest.mark.parametrize("tiles,slices,slots,expected", [
    # expected (dp_tiles, sk_slices, grid) with stream-K on
    (1024, 512, 264, (528, 253952, 264)),   # 4096^3, 128x128 on an H200: 3.88 waves
    (4096, 1024, 264, (3696, 409600, 264)),  # 8192^3
    (1089, 129, 264, (792, 38313, 264)),    # 4097^3
    (4, 2048, 264, (0, 8192, 256)),         # 256x256x16384: split-K, 64 pieces per tile
    (66, 98, 264, (0, 6468, 202)),          # a quarter wave: ~3 pieces per tile
    (4, 1 << 28, 264, (0, 1 << 30, 264)),   # K = 2^31: 64-bit slice counts
    (300, 40, 132, (132, 6720, 132)), (133, 40, 132, (0, 5320, 132)), (5, 40, 132, (0, 200, 6)),
    (135, 98, 264, None),   # half a wave: whole tiles (cutting every tile measured slower)
    (7, 3, 264, None),      # too little K to cut
    (528, 64, 264, None),   # whole waves
    (300, 3, 132, None),    # fewer than kMinStreamKSlices per block
    (1, 1, 1, None), (3, 100, 1, None)])
@pytest.mark.parametrize("stream_k", [False, True])
def test_schedule_computes_every_slice_once_and_waits_only_backwards(tiles, slices, slots,
                                                                     expected, stream_k):
  dp_tiles, sk_slices, grid = cuda.schedule(tiles, slices, slots, stream_k)
  assert sk_slices % slices == 0 and dp_tiles + sk_slices // slices == tiles
  assert (dp_tiles, sk_slices, grid) == (expected if stream_k and expected else (tiles, 0, tiles))
  assert 1 <= grid <= (slots if sk_slices else tiles)
  starts, work, pieces = {}, {}, {}
  for block in range(grid):
    starts[block], items = cuda.work_items(dp_tiles, sk_slices, slices, block, grid)
    work[block] = sum(end - begin for _, begin, end in items)
    for position, (tile, begin, end) in enumerate(items):
      assert 0 <= begin < end <= slices
      if end < slices:  # a piece the tile's finisher adds: published before any wait
        assert sk_slices and all(t < dp_tiles for t, _, _ in items[:position])
      pieces.setdefault(tile, []).append((begin, end, block))
  # Every K-slice of every tile exactly once.
  assert sorted(pieces) == list(range(tiles))
  for tile, parts in pieces.items():
    parts.sort()
    assert parts[0][0] == 0 and parts[-1][1] == slices
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    # The finisher (the piece with the last slice) waits, as the kernel does, for blocks
    # finisher-1, finisher-2, ... down to the first whose range starts at or before the
    # tile: exactly the blocks holding the tile's other pieces, all with lower indices.
    finisher = parts[-1][2]
    waits, c = [], finisher - 1
    while len(parts) > 1:
      waits.append(c)
      if starts[c] <= tile * slices:
        break
      c -= 1
    assert sorted(waits) == sorted(block for _, _, block in parts[:-1])
    assert all(c < finisher for c in waits)
  if sk_slices:  # the point of it: every block gets the same work, to a slice
    assert max(work.values()) - min(work.values()) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, False),
                                                     (False, True), (True, True)])
@pytest.mark.parametrize("m,n,k,batch,config", [
    (256, 256, 16384, 1, 1),   # split-K: each 128x128 tile cut among 64 blocks
    (387, 260, 2777, 3, 1),    # a seventh of a wave, cut across batch entries; ragged K
    (4097, 4097, 1031, 1, 1),  # whole waves, then stream-K; ragged everything
    (300, 200, 5000, 2, 0),    # 256x128 blocks, 1 per SM
    (1000, 300, 3001, 1, 2),   # 128x64 blocks, 3 per SM
])
def test_stream_k_matches_the_reference(m, n, k, batch, config, transpose_a, transpose_b):
  # Each case against float64, with stream-K on and off, through a NaN-poisoned
  # allocator (unwritten outputs show), with an epilogue that reads C.
  from pallas_gemm.testing.reference import reference, relative_error, tolerance  # noqa: PLC0415
  rng = np.random.default_rng(m * n + k)
  a = rng.standard_normal((batch,) + ((k, m) if transpose_a else (m, k)), dtype=np.float32)
  b = rng.standard_normal((batch,) + ((n, k) if transpose_b else (k, n)), dtype=np.float32)
  c = rng.standard_normal((batch, m, n), dtype=np.float32)
  ref = reference(a, b, c, alpha=0.5, beta=-2.0, transpose_a=transpose_a,
                  transpose_b=transpose_b)
  a_dev, b_dev, c_dev = jnp.asarray(a), jnp.asarray(b), jnp.asarray(c)
  for stream_k in (True, False):
    # Poisoned last, so that the output (not an input) likely reuses the NaN block.
    jnp.full((batch * m * n + 1,), jnp.nan, jnp.float32).block_until_ready().delete()
    out = cuda.gemm(a_dev, b_dev, c_dev, alpha=0.5, beta=-2.0,
                    transpose_a=transpose_a, transpose_b=transpose_b, precision=None,
                    out_dtype=jnp.float32,
                    config=cuda.CONFIGS[config].replace(stream_k=stream_k), interpret=False)
    err = relative_error(out, ref)
    assert err <= tolerance(np.float32, jax.lax.Precision.HIGHEST, k), (stream_k, err)


@pytest.mark.gpu
def test_handler_refuses_rows_that_are_not_16_byte_aligned(monkeypatch):
  # cuda.gemm pads rows to 16 bytes; the kernels have no other path, so the handler must
  # refuse a call that skips the padding rather than read misaligned memory.
  monkeypatch.setattr(cuda, "_align_rows", lambda a, b, **_: (a, b))
  a = jnp.ones((1, 8, 7), jnp.float32)
  b = jnp.ones((1, 7, 8), jnp.float32)
  with pytest.raises(Exception, match="16-byte aligned rows"):
    jax.block_until_ready(cuda.gemm(
        a, b, None, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
        precision=None, out_dtype=jnp.float32, config=cuda.CONFIGS[1], interpret=False))
