"""The grouped-GEMM Hopper kernels called directly (pallas_gemm/grouped/mosaic_*.py).

The backend-independent suite (tests/test_ragged_dot.py) goes through the front door; these
exercise the kernels' own paths by name: the work-item table, straddling row tiles, zero
rows, transposed weights, group_offset, ragged M/K/N, both warpgroup splits. On the CPU
they run in Mosaic GPU's interpreter, whose fresh buffers hold NaN, so a row the kernel
never writes shows up; each kernel is also lowered for CUDA at its real tiles.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import jax_config, random
from pallas_gemm.grouped import gated, mosaic_forward, mosaic_weight_grad
from pallas_gemm.mgpu import rows as mgpu_rows
from pallas_gemm.grouped.config import Config, default_config, smem_bytes
from pallas_gemm.testing.reference import (ACTIVATIONS, gated_tolerance, reference,
                                           relative_error, tolerance)

# Small tiles for the interpreter: 64-row tiles straddle the groups of a few hundred rows.
SMALL = Config(block_m=64, block_n=128, block_k=64, stages=2, num_compute_wgs=2,
               wg_split="n", num_sms=3)
SPLIT_M = Config(block_m=128, block_n=64, block_k=64, stages=3, num_compute_wgs=2,
                 wg_split="m", grid_tile_width=2, num_sms=2)


def _bounds(group_sizes, group_offset, num_groups, m):
  """[(start, end)] of the computed groups' rows (the kernels' group_offset rule)."""
  ends = np.cumsum(group_sizes)
  starts = ends - group_sizes
  off = 0 if len(group_sizes) == num_groups else int(group_offset)
  return [(min(int(starts[off + i]), m), min(int(ends[off + i]), m))
          for i in range(num_groups)]


def forward_reference(lhs, rhs, group_sizes, group_offset=None, *, transpose_rhs=False):
  """float64 (M, N): each computed group's rows times its matrix, zeros elsewhere."""
  m, g = lhs.shape[0], rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out = np.zeros((m, n))
  for i, (s, e) in enumerate(_bounds(np.asarray(group_sizes), group_offset, g, m)):
    if e > s:
      out[s:e] = reference(lhs[s:e].astype(np.float32), rhs[i].astype(np.float32),
                           transpose_b=transpose_rhs)
  return out


def weight_grad_reference(lhs, dy, group_sizes, group_offset=None, *, num_groups=None):
  """float64 (G, K, N): lhs[rows of g].T @ dy[rows of g] per computed group."""
  g = len(group_sizes) if num_groups is None else num_groups
  out = np.zeros((g, lhs.shape[1], dy.shape[1]))
  for i, (s, e) in enumerate(_bounds(np.asarray(group_sizes), group_offset, g, lhs.shape[0])):
    if e > s:
      out[i] = reference(lhs[s:e].astype(np.float32), dy[s:e].astype(np.float32),
                         transpose_a=True)
  return out


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_m=96), "block_m"),
    (dict(block_n=96), "block_n"),
    (dict(block_k=32), "block_k"),
    (dict(block_n=512), "block_n"),
    (dict(stages=0), "stages"),
    (dict(num_compute_wgs=3), "num_compute_wgs"),
    (dict(wg_split="k"), "wg_split"),
    (dict(epi_block_m=32), "epi_block_m"),
    (dict(epi_block_n=24), "epi_block_n"),
    (dict(num_sms=0), "num_sms"),
    (dict(grid_tile_width=True), "grid_tile_width"),
    (dict(epi_slots=0), "epi_slots"),
])
def test_config_rejects_invalid_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    Config(**kwargs)


def test_config_tiles_per_kernel():
  cfg = Config(block_m=64, block_k=128, wg_split="m")
  cfg.check_tiles(cfg.block_k)  # weight grad: 128 rows of out, 64 per warpgroup
  with pytest.raises(ValueError, match="64"):
    cfg.check_tiles(cfg.block_m)  # forward: 32 rows per warpgroup
  with pytest.raises(ValueError, match="epi_block"):
    Config(epi_block_n=48).check_tiles(128)
  # 128 x 128 per warpgroup: 4 sub-tiles of 64 x 64; 3 slots would not come round evenly.
  with pytest.raises(ValueError, match="epi_slots"):
    Config(epi_slots=3).check_tiles(128)
  assert Config(epi_slots=8).epi_slots_for(128) == 4  # at most one slot per sub-tile


def test_config_is_frozen_and_keyword_only():
  with pytest.raises(dataclasses.FrozenInstanceError):
    Config().block_m = 64  # type: ignore[misc]
  with pytest.raises(TypeError):
    Config(128)  # type: ignore[misc]


@pytest.mark.parametrize("g, m, k, n", [
    (8, 16384, 4096, 14336), (32, 32768, 7168, 2048), (128, 65536, 2048, 768),
    (64, 32768, 4096, 1536), (8, 256, 4096, 14336), (4, 1, 1, 1)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_default_configs_fit(g, m, k, n, out_dtype):
  for weight_grad in (False, True):
    cfg = default_config(m, n, k, g, jnp.bfloat16, out_dtype=out_dtype,
                         weight_grad=weight_grad)
    rows = cfg.block_k if weight_grad else cfg.block_m
    cfg.check_tiles(rows)
    a_tile = (cfg.block_m, cfg.block_k)
    assert smem_bytes(cfg, a_tile=a_tile, b_tile=(cfg.block_m if weight_grad else cfg.block_k,
                                                  cfg.block_n),
                      dtype=jnp.bfloat16, out_dtype=out_dtype) <= 232448


# ----------------------------------------------------------------------------
# Work items (no kernel: the table the forward kernel walks)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [64, 128])
def test_row_items_cover_every_row_once(rng, block_m):
  g, extra, m = 7, 2, 513  # 7 local groups among 9, after 2 others

  @jax.jit
  def table(sizes, offset):
    starts, ends = mgpu_rows.local_rows(sizes, offset, g, m)
    return mgpu_rows.row_items(starts, ends, m, block_m)

  for trial in range(30):
    sizes = rng.integers(0, 3, g + extra) * rng.integers(0, 2 * m // g, g + extra)
    if trial % 3 == 0:
      sizes[rng.integers(0, g + extra)] = m  # one group holds every row (and more)
    items, count = (np.asarray(x) for x in table(jnp.asarray(sizes, jnp.int32), extra))
    count = int(count[0])
    assert count <= items.shape[1] == mgpu_rows.max_row_items(m, g, block_m)
    owner = np.full(m, -2)
    bounds = _bounds(sizes, extra, g, m)
    for group, row8, lo, hi in items[:, :count].T:
      assert 8 * row8 <= lo < hi <= min(8 * row8 + block_m, m)
      assert (owner[lo:hi] == -2).all(), "a row in two items"
      owner[lo:hi] = group
      if group >= 0:
        assert bounds[group][0] <= lo and hi <= bounds[group][1]
    expected = np.full(m, -1)
    for i, (s, e) in enumerate(bounds):
      expected[s:e] = i
    np.testing.assert_array_equal(owner, expected)


# ----------------------------------------------------------------------------
# Forward, interpret mode
# ----------------------------------------------------------------------------


def _check_forward(rng, m, k, n, sizes, *, transpose_rhs=False, dtype=jnp.bfloat16,
                   out_dtype=jnp.float32, config=SMALL, num_groups=None, group_offset=None):
  sizes = np.asarray(sizes, np.int32)
  g = len(sizes) if num_groups is None else num_groups
  lhs = random(rng, (m, k), dtype)
  rhs = random(rng, (g, n, k) if transpose_rhs else (g, k, n), dtype)
  out = mosaic_forward.forward(
      jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes),
      None if group_offset is None else jnp.int32(group_offset),
      transpose_rhs=transpose_rhs, out_dtype=out_dtype, config=config, interpret=True)
  assert out.shape == (m, n) and out.dtype == out_dtype
  ref = forward_reference(lhs, rhs, sizes, group_offset, transpose_rhs=transpose_rhs)
  out = np.asarray(out.astype(jnp.float32))
  assert not np.isnan(out).any(), "rows left unwritten"
  zero_rows = ~np.any(ref != 0, axis=1)
  assert (out[zero_rows] == 0).all(), "rows outside the groups must be zeros"
  err = relative_error(out, ref)
  assert err <= tolerance(dtype, None, k, out_dtype), err


@pytest.mark.parametrize("sizes", [
    [50, 0, 120, 30],       # zeros, tiles straddling boundaries, sum == M
    [0, 200, 0],            # one group holds every row
    [1, 1, 1, 1, 1, 60],    # groups of one row inside one tile, sum < M
    [0, 0, 0],              # no rows: all zeros
], ids=["mixed", "one_group", "ones_and_tail", "empty"])
def test_forward_group_patterns(rng, sizes):
  _check_forward(rng, 200, 70, 136, sizes)


def test_forward_single_group_ragged_shape(rng):
  _check_forward(rng, 130, 100, 72, [97], out_dtype=jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_forward_transposed_rhs(rng, dtype):
  _check_forward(rng, 190, 130, 100, [64, 3, 0, 90], transpose_rhs=True, dtype=dtype,
                 out_dtype=dtype)


def test_forward_split_m_random_sizes(rng):
  sizes = rng.multinomial(250, np.ones(5) / 5)
  _check_forward(rng, 300, 64, 200, sizes, config=SPLIT_M)


def test_forward_group_offset(rng):
  # 6 global groups, this call holds 3 of them (global 2..4): rows of groups 0, 1, 5 and
  # past the sum are zeros.
  _check_forward(rng, 220, 64, 128, [20, 45, 30, 0, 70, 25], num_groups=3, group_offset=2)


def test_forward_default_tiles(rng):
  # 128 x 256 tiles, two warpgroups split along n, 4 stages.
  _check_forward(rng, 300, 256, 256, [100, 150, 20],
                 config=default_config(300, 256, 256, 3, out_dtype=jnp.float32).replace(num_sms=3))


@pytest.mark.parametrize("epi_slots", [1, 4])
def test_forward_epilogue_slots(rng, epi_slots):
  # 128 x 128 tiles split along m: 64 x 128 per warpgroup, two 64 x 64 sub-tiles (4 slots
  # are cut to one per sub-tile).
  cfg = SPLIT_M.replace(block_n=128, epi_slots=epi_slots, num_sms=3)
  _check_forward(rng, 300, 200, 200, [70, 0, 133, 60], config=cfg, out_dtype=jnp.bfloat16)


def test_forward_rejects_bad_operands():
  lhs = jnp.zeros((8, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="K"):
    mosaic_forward.forward(lhs, jnp.zeros((2, 8, 8), jnp.bfloat16), jnp.zeros(2, jnp.int32),
                           interpret=True)
  with pytest.raises(TypeError, match="dtype"):
    mosaic_forward.forward(lhs.astype(jnp.float32), jnp.zeros((2, 16, 8), jnp.float32),
                           jnp.zeros(2, jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="group_sizes"):
    mosaic_forward.forward(lhs, jnp.zeros((2, 16, 8), jnp.bfloat16), jnp.zeros(1, jnp.int32),
                           interpret=True)
  # 64-byte epilogue rows (32 bfloat16 columns): single-row TMA stores would start on
  # addresses that are not 128-byte aligned.
  with pytest.raises(ValueError, match=r"epi_block_n=32 makes 64-byte rows.*multiple of 64"):
    mosaic_forward.forward(lhs, jnp.zeros((2, 16, 64), jnp.bfloat16), jnp.full(2, 4, jnp.int32),
                           config=Config(block_m=128, block_n=64, wg_split="m", epi_block_n=32),
                           interpret=True)


# ----------------------------------------------------------------------------
# Gated forward (SwiGLU / GeGLU epilogue), interpret mode
# ----------------------------------------------------------------------------


def gated_reference(lhs, rhs, group_sizes, activation, groups=None):
  """float64 (a, h): h per group as `forward_reference` (only the rows of `groups`, when
  given; other rows 0), a = act(h[:, :F]) * h[:, F:]."""
  m, two_f = lhs.shape[0], rhs.shape[2]
  h = np.zeros((m, two_f))
  for i, (s, e) in enumerate(_bounds(np.asarray(group_sizes), None, rhs.shape[0], m)):
    if e > s and (groups is None or i in groups):
      h[s:e] = reference(lhs[s:e].astype(np.float32), rhs[i].astype(np.float32))
  f = two_f // 2
  with jax.enable_x64(True):
    gate = np.asarray(ACTIVATIONS[activation](jnp.asarray(h[:, :f])))
  return gate * h[:, f:], h


def _check_gated(lhs, rhs, sizes, a, h, activation, groups=None):
  """a (and h unless None) against the float64 reference: every element written, rows of
  no group zeros, within the table's bounds. groups: the groups whose rows are compared
  with the reference (None: all; the reference of many real-sized groups takes minutes on
  the host); every row is still checked for being written and for zeros."""
  m, k = lhs.shape
  bounds = _bounds(np.asarray(sizes), None, len(sizes), m)
  in_group, keep = np.zeros(m, bool), np.zeros(m, bool)
  for i, (s, e) in enumerate(bounds):
    in_group[s:e] = True
    keep[s:e] = groups is None or i in groups
  a_ref, h_ref = gated_reference(lhs, rhs, sizes, activation, groups)
  for out, ref, tol in ((a, a_ref, gated_tolerance(jnp.bfloat16, k)),
                        (h, h_ref, tolerance(jnp.bfloat16, None, k, jnp.bfloat16))):
    if out is None:
      continue
    assert out.shape == ref.shape and out.dtype == lhs.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any(), "elements left unwritten"
    assert (out[~in_group] == 0).all(), "rows outside the groups must be zeros"
    assert relative_error(out[keep], ref[keep]) <= tol


@pytest.mark.parametrize("f, sizes, config", [
    (192, [50, 0, 120, 20], SPLIT_M.replace(block_n=128, num_sms=3)),  # F: 1.5 tiles
    (64, [0, 130, 1, 33], SMALL),     # F narrower than the tile (64-row tiles, split n)
    (128, [200], None),               # the default gated tiles, one group
], ids=["f_1.5_tiles", "f_narrow", "default"])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("write_h", [False, True])
def test_gated_forward(rng, f, sizes, config, activation, write_h):
  m, k = 200, 70
  sizes = np.asarray(sizes, np.int32)
  lhs = random(rng, (m, k), jnp.bfloat16)
  rhs = random(rng, (len(sizes), k, 2 * f), jnp.bfloat16)
  a, h = mosaic_forward.gated_forward(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes),
                                      activation=activation, write_h=write_h, config=config,
                                      interpret=True)
  assert (h is not None) == write_h
  _check_gated(lhs, rhs, sizes, a, h, activation)


def test_gated_forward_in_shards_of_rows_and_groups(rng):
  # What the partitioning rule (`gated.partitioned`) runs per device with rows and groups
  # both split 2 ways: each shard's rows with the groups cut to its row window, and its
  # groups by group_offset (more sizes than groups); the shards' results, each zero on
  # the others' rows, add up to the whole call's (to the last bit of a few elements: the
  # rows sit in other row tiles, whose products the interpreter may sum in another order).
  m, k, f, g = 200, 64, 64, 4
  sizes = np.asarray([50, 0, 90, 40], np.int32)
  lhs = random(rng, (m, k), jnp.bfloat16)
  rhs = random(rng, (g, k, 2 * f), jnp.bfloat16)
  call = functools.partial(mosaic_forward.gated_forward, activation="silu", write_h=True,
                           config=SMALL, interpret=True)
  whole = call(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes))
  ends = np.cumsum(sizes)
  for rows in (slice(0, 100), slice(100, 200)):
    cut = np.diff(np.clip(ends - rows.start, 0, 100), prepend=0).astype(np.int32)
    parts = [call(jnp.asarray(lhs[rows]), jnp.asarray(rhs[first:first + 2]), jnp.asarray(cut),
                  jnp.int32(first)) for first in (0, 2)]
    for i in range(2):  # a, h
      for first, p in zip((0, 2), parts):  # zeros outside the shard's own groups' rows
        mine = np.zeros(m, bool)
        mine[ends[first] - sizes[first]:ends[first + 1]] = True
        assert (np.asarray(p[i], np.float32)[~mine[rows]] == 0).all()
      got = sum(np.asarray(p[i], np.float32) for p in parts)
      assert relative_error(got, np.asarray(whole[i], np.float32)[rows]) <= 2.0**-8


def test_gated_front_door_backends_agree(rng):
  # xla computes a from h rounded to bf16, the kernel from its f32 products: both within
  # the bound; h itself is the same GEMM.
  lhs = jnp.asarray(random(rng, (150, 64), jnp.bfloat16))
  rhs = jnp.asarray(random(rng, (3, 64, 256), jnp.bfloat16))
  sizes = jnp.asarray([60, 0, 70], jnp.int32)
  for backend in ("xla", "mosaic"):
    a, h = gated.gated_ragged_dot(lhs, rhs, sizes, write_h=True, backend=backend)
    _check_gated(np.asarray(lhs), np.asarray(rhs), np.asarray(sizes), a, h, "silu")


def test_gated_rejects_bad_operands():
  lhs = jnp.zeros((8, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 64"):
    mosaic_forward.gated_forward(lhs, jnp.zeros((2, 16, 96), jnp.bfloat16),
                                 jnp.zeros(2, jnp.int32), activation="silu", interpret=True)
  with pytest.raises(ValueError, match="backend='mosaic'.*multiple of 64"):
    gated.gated_ragged_dot(lhs, jnp.zeros((2, 16, 96), jnp.bfloat16),
                           jnp.zeros(2, jnp.int32), backend="mosaic")
  with pytest.raises(ValueError, match="activation"):
    gated.gated_ragged_dot(lhs, jnp.zeros((2, 16, 128), jnp.bfloat16),
                           jnp.zeros(2, jnp.int32), activation="relu")
  with pytest.raises(ValueError, match="rhs"):
    gated.gated_ragged_dot(lhs, jnp.zeros((2, 8, 128), jnp.bfloat16), jnp.zeros(2, jnp.int32))
  with pytest.raises(TypeError, match="rhs.dtype"):
    gated.gated_ragged_dot(lhs, jnp.zeros((2, 16, 128), jnp.float16), jnp.zeros(2, jnp.int32))
  w = jnp.zeros((2, 16, 128), jnp.bfloat16)
  with pytest.raises(TypeError, match="group_sizes.dtype must be an integer type"):
    gated.gated_ragged_dot(lhs, w, jnp.zeros(2, jnp.float32), backend="mosaic")
  with pytest.raises(ValueError, match=r"group_sizes must be \(G,\) = \(2,\)"):
    gated.gated_ragged_dot(lhs, w, jnp.zeros(3, jnp.int32), backend="mosaic")
  with pytest.raises(ValueError, match="group_sizes must be >= 0"):
    gated.gated_ragged_dot(lhs, w, jnp.asarray([-4, 8], jnp.int32), backend="mosaic")
  with pytest.raises(ValueError, match="activation must be one of"):
    mosaic_forward.gated_forward(lhs, w, jnp.zeros(2, jnp.int32), activation="relu",
                                 interpret=True)
  with pytest.raises(ValueError, match="epi_block_n=128 must divide F=64"):
    mosaic_forward.gated_forward(lhs, w, jnp.zeros(2, jnp.int32), activation="silu",
                                 config=SMALL.replace(epi_block_n=128), interpret=True)


# ----------------------------------------------------------------------------
# Weight grad, interpret mode
# ----------------------------------------------------------------------------

WG_SMALL = Config(block_m=64, block_n=128, block_k=128, stages=2, num_compute_wgs=2,
                  wg_split="n", num_sms=3)


def _check_weight_grad(rng, m, k, n, sizes, *, dtype=jnp.bfloat16, out_dtype=jnp.float32,
                       config=WG_SMALL, num_groups=None, group_offset=None,
                       poison_rows=()):
  sizes = np.asarray(sizes, np.int32)
  lhs = random(rng, (m, k), dtype)
  dy = random(rng, (m, n), dtype)
  for rows in poison_rows:  # rows of no computed group: must contribute nothing
    lhs[rows] = np.nan
    dy[rows] = np.inf
  out = mosaic_weight_grad.weight_grad(
      jnp.asarray(lhs), jnp.asarray(dy), jnp.asarray(sizes),
      None if group_offset is None else jnp.int32(group_offset), num_groups=num_groups,
      out_dtype=out_dtype, config=config, interpret=True)
  g = len(sizes) if num_groups is None else num_groups
  assert out.shape == (g, k, n) and out.dtype == out_dtype
  ref = weight_grad_reference(lhs, dy, sizes, group_offset, num_groups=num_groups)
  out = np.asarray(out.astype(jnp.float32))
  assert not np.isnan(out).any(), "unwritten or contaminated elements"
  for i in range(g):
    if not ref[i].any():
      assert (out[i] == 0).all(), f"group {i} is empty: its gradient must be zeros"
  err = relative_error(out, ref)
  assert err <= tolerance(dtype, None, int(sizes.max(initial=1)), out_dtype), err


@pytest.mark.parametrize("sizes", [
    [50, 0, 120, 10],     # boundaries inside row steps, an empty group, sum < M
    [0, 200, 0],          # one group holds every row
    [1, 1, 1, 0, 1],      # single rows inside one step
], ids=["mixed", "one_group", "ones"])
def test_weight_grad_group_patterns(rng, sizes):
  m = 200
  _check_weight_grad(rng, m, 136, 130, sizes, poison_rows=[slice(sum(sizes), m)])


def test_weight_grad_all_empty(rng):
  _check_weight_grad(rng, 100, 64, 64, [0, 0])


def test_weight_grad_group_offset_ignores_other_groups(rng):
  # Global groups 1..3 of 5; rows of groups 0 and 4 hold NaN / inf.
  sizes = [30, 70, 0, 45, 40]
  _check_weight_grad(rng, 200, 128, 192, sizes, num_groups=3, group_offset=1,
                     poison_rows=[slice(0, 30), slice(145, 200)], out_dtype=jnp.bfloat16)


def test_weight_grad_split_m_f16(rng):
  cfg = Config(block_m=64, block_n=128, block_k=128, stages=3, num_compute_wgs=2,
               wg_split="m", grid_tile_width=2, num_sms=2)
  _check_weight_grad(rng, 260, 200, 100, [100, 60, 99], dtype=jnp.float16,
                     out_dtype=jnp.float16, config=cfg)


def test_weight_grad_one_warpgroup_single_group(rng):
  cfg = Config(block_m=64, block_n=64, block_k=64, stages=2, num_compute_wgs=1, num_sms=2)
  _check_weight_grad(rng, 150, 70, 72, [133], config=cfg)


@pytest.mark.parametrize("epi_slots", [1, 2])
def test_weight_grad_epilogue_slots(rng, epi_slots):
  # 4 groups x (2 K tiles x 2 N tiles) = 16 items over 3 CTAs: 5 full rounds, dealt in
  # both directions, and a partial one; one slot per 64 x 64 sub-tile (epi_slots=2) or
  # one for both.
  cfg = WG_SMALL.replace(epi_slots=epi_slots, stages=3)
  m = 260
  sizes = [90, 0, 7, 140]
  _check_weight_grad(rng, m, 136, 130, sizes, config=cfg, out_dtype=jnp.bfloat16,
                     poison_rows=[slice(sum(sizes), m)])


def test_weight_grad_traced_offset_needs_num_groups():
  x = jnp.zeros((8, 64), jnp.bfloat16)
  f = jax.jit(lambda off: mosaic_weight_grad.weight_grad(
      x, x, jnp.zeros(3, jnp.int32), off, interpret=True))
  with pytest.raises(ValueError, match="num_groups"):
    f(jnp.int32(1))


# ----------------------------------------------------------------------------
# Synchronisation: the interpreter's happens-before race detector
# ----------------------------------------------------------------------------


def _races_found() -> bool:
  # jax 0.11.2 keeps the detector's state private; the project pins that version.
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # noqa: PLC0415

  return gpu_callbacks.get_races().races_found


@pytest.fixture
def cpu_device():
  # The interpreter is a host simulation whose race verdict depends on callback scheduling;
  # pinning it to the CPU backend (process-wide: see jax_config) makes it the same on
  # every host.
  cpu = jax.devices("cpu")[0]
  with jax_config("jax_default_device", cpu):
    yield cpu


def test_no_races(rng, cpu_device):
  # Two CTAs, a 2-deep ring over many K steps and items, both warpgroups, straddling
  # tiles (forward) and masked boundary steps (weight grad).
  params = plgpu.InterpretGPUParams(detect_races=True)
  put = functools.partial(jax.device_put, device=cpu_device)
  sizes = put(jnp.asarray([50, 0, 120], jnp.int32))
  lhs = put(random(rng, (200, 136), jnp.bfloat16))
  rhs = put(random(rng, (3, 136, 136), jnp.bfloat16))
  cfg = SMALL.replace(num_sms=2)
  jax.block_until_ready(mosaic_forward.forward(lhs, rhs, sizes, None, config=cfg,
                                               interpret=params))
  assert not _races_found()
  jax.block_until_ready(mosaic_weight_grad.weight_grad(
      lhs, lhs, sizes, None, config=WG_SMALL.replace(num_sms=2), interpret=params))
  assert not _races_found()
  jax.block_until_ready(mosaic_forward.gated_forward(
      lhs, put(random(rng, (3, 136, 256), jnp.bfloat16)), sizes, activation="silu",
      write_h=True, config=SPLIT_M.replace(block_n=128, num_sms=2), interpret=params))
  assert not _races_found()


# ----------------------------------------------------------------------------
# CUDA lowering on the CPU at real tiles
# ----------------------------------------------------------------------------

SHAPES = {  # (G, M, K, N)
    "mixtral": (8, 16384, 4096, 14336),
    "deepseek": (32, 32768, 7168, 2048),
    "qwen3": (128, 65536, 2048, 768),
    "skewed": (64, 32768, 4096, 1536),
    "ragged": (5, 1000, 1000, 300),
}


def _lower(f, *args) -> str:
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("transpose_rhs, out_dtype",
                         [(False, jnp.bfloat16), (True, jnp.float32)])
def test_forward_lowers_for_sm90(shape, transpose_rhs, out_dtype):
  g, m, k, n = SHAPES[shape]
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
  cfg = default_config(m, n, k, g, out_dtype=out_dtype).replace(num_sms=132)
  text = _lower(lambda a, b, s: mosaic_forward.forward(
      a, b, s, None, transpose_rhs=transpose_rhs, out_dtype=out_dtype, config=cfg,
      interpret=False), lhs, rhs, sizes)
  assert "mosaic_gpu" in text


# The gated form's first GEMMs (G, M, D, F) of the MoE layers in benchmarks --moe.
GATED_SHAPES = {
    "qwen3": (128, 65536, 2048, 768),
    "deepseek": (256, 65536, 7168, 2048),
    "gpt-oss": (128, 32768, 2880, 2880),
    "mixtral": (8, 16384, 4096, 14336),
    "decode": (128, 1024, 2048, 768),  # 8 rows per expert: 64-row tiles
}


@pytest.mark.parametrize("shape", list(GATED_SHAPES))
@pytest.mark.parametrize("write_h", [False, True])
def test_gated_forward_lowers_for_sm90(shape, write_h):
  g, m, k, f = GATED_SHAPES[shape]
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((g, k, 2 * f), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
  cfg = default_config(m, f, k, g, gated=True).replace(num_sms=132)
  text = _lower(lambda a, b, s: mosaic_forward.gated_forward(
      a, b, s, activation="silu", write_h=write_h, config=cfg, interpret=False),
      lhs, rhs, sizes)
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_weight_grad_lowers_for_sm90(shape, out_dtype):
  g, m, k, n = SHAPES[shape]
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
  cfg = default_config(m, n, k, g, out_dtype=out_dtype, weight_grad=True).replace(num_sms=132)
  text = _lower(lambda a, b, s: mosaic_weight_grad.weight_grad(
      a, b, s, None, out_dtype=out_dtype, config=cfg, interpret=False), lhs, dy, sizes)
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("shape", ["qwen3", "skewed"])
@pytest.mark.parametrize("variant", [
    dict(epi_slots=4),
    dict(block_m=128, block_n=128, epi_slots=2),
], ids=["epi_slots_4", "128_row_steps"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_weight_grad_variants_lower_for_sm90(shape, variant, out_dtype):
  g, m, k, n = SHAPES[shape]
  cfg = default_config(m, n, k, g, out_dtype=out_dtype, weight_grad=True)
  cfg = cfg.replace(num_sms=132, stages=2, **variant)
  while smem_bytes(cfg.replace(stages=cfg.stages + 1), a_tile=(cfg.block_m, cfg.block_k),
                   b_tile=(cfg.block_m, cfg.block_n), dtype=jnp.bfloat16,
                   out_dtype=out_dtype) <= 232448:
    cfg = cfg.replace(stages=cfg.stages + 1)
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
  text = _lower(lambda a, b, s: mosaic_weight_grad.weight_grad(
      a, b, s, None, out_dtype=out_dtype, config=cfg, interpret=False), lhs, dy, sizes)
  assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------
# GPU, real sizes, NaN-poisoned outputs
# ----------------------------------------------------------------------------


def _poison(nbytes):
  """Frees a NaN block of nbytes, so that the next outputs likely reuse it."""
  jnp.full((nbytes // 4 + 1,), jnp.nan, jnp.float32).block_until_ready().delete()


def _group_sizes(rng, g, m, *, skew=False, total=None):
  total = m if total is None else total
  weights = rng.pareto(1.2, g) + 0.05 if skew else np.ones(g)
  return rng.multinomial(total, weights / weights.sum()).astype(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["mixtral", "deepseek", "qwen3", "skewed", "ragged"])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_forward_gpu(rng, shape, transpose_rhs):
  g, m, k, n = SHAPES[shape]
  # Smaller M keeps the float64 reference quick; the tiles and group counts are real.
  m = min(m, 8192)
  sizes = _group_sizes(rng, g, m, skew=shape == "skewed", total=m - 77)
  sizes[1] = 0
  lhs = random(rng, (m, k), jnp.bfloat16)
  rhs = random(rng, (g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
  _poison(m * n * 2)
  out = mosaic_forward.forward(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), None,
                               transpose_rhs=transpose_rhs, out_dtype=jnp.bfloat16,
                               config=None, interpret=False)
  out = np.asarray(out.astype(jnp.float32))
  ref = forward_reference(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
  assert not np.isnan(out).any()
  assert (out[m - 77:] == 0).all()
  assert relative_error(out, ref) <= tolerance(jnp.bfloat16, None, k, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GATED_SHAPES))
@pytest.mark.parametrize("write_h", [False, True])
def test_gated_forward_gpu(rng, shape, write_h):
  g, m, k, f = GATED_SHAPES[shape]
  # At most 32 experts (256 of DeepSeek-V3's are 15 GB of weights to draw on the host),
  # rows per expert as in the real layer.
  m, g = min(m, 8192, m * 32 // g), min(g, 32)
  sizes = _group_sizes(rng, g, m, total=m - 77)
  sizes[1] = 0
  lhs = random(rng, (m, k), jnp.bfloat16)
  rhs = random(rng, (g, k, 2 * f), jnp.bfloat16)
  _poison(m * 3 * f * 2)
  a, h = mosaic_forward.gated_forward(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes),
                                      activation="silu", write_h=write_h, interpret=False)
  # Against the reference: the first groups, the last, and a few between (tiles that
  # straddle their boundaries included).
  groups = set(range(3)) | {g - 1} | set(rng.choice(g, min(g, 5), replace=False).tolist())
  _check_gated(lhs, rhs, sizes, a, h, "silu", groups)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["mixtral", "deepseek", "qwen3", "skewed", "ragged"])
def test_weight_grad_gpu(rng, shape):
  g, m, k, n = SHAPES[shape]
  m = min(m, 8192)
  sizes = _group_sizes(rng, g, m, skew=shape == "skewed", total=m - 77)
  sizes[1] = 0
  lhs = random(rng, (m, k), jnp.bfloat16)
  dy = random(rng, (m, n), jnp.bfloat16)
  lhs[m - 77:] = np.nan  # rows past the sum must not contribute
  _poison(g * k * n * 4)
  out = mosaic_weight_grad.weight_grad(jnp.asarray(lhs), jnp.asarray(dy), jnp.asarray(sizes),
                                       None, out_dtype=jnp.float32, interpret=False)
  out = np.asarray(out)
  ref = weight_grad_reference(lhs, dy, sizes)
  assert not np.isnan(out).any()
  assert (out[1] == 0).all()
  assert relative_error(out, ref) <= tolerance(jnp.bfloat16, None, int(sizes.max()),
                                               jnp.float32)
