"""Tests specific to the Mosaic GPU backend (pallas_gemm/matmul/mosaic/).

Config validation, the shared-memory budget, default configs, and CPU
interpret-mode correctness on small aligned and ragged shapes. The
backend-independent suite covers the front door; these call ``mosaic.gemm``
directly so that the kernel's own paths (warpgroup split, wgmma_wait, C of
another dtype, misaligned rows) are exercised by name.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_gemm.matmul import mosaic
from pallas_gemm.mgpu import hw
from pallas_gemm.testing.reference import reference, relative_error, tolerance

Config = mosaic.Config

# ----------------------------------------------------------------------------
# Config validation and the shared-memory budget
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_m=96, num_compute_wgs=1), "block_m"),  # not 64-row wgmma
        (dict(block_n=264, num_compute_wgs=1), "block_n"),  # > 256
        (dict(block_n=24, num_compute_wgs=1, epi_block_n=16), "block_n"),
        (dict(block_k=60), "block_k"),
        (dict(stages=0), "stages"),
        (dict(stages=1, wgmma_wait=1), "stages"),
        (dict(num_compute_wgs=3), "num_compute_wgs"),
        (dict(wg_split="k"), "wg_split"),
        (dict(grid_minor_dim="x"), "grid_minor_dim"),
        (dict(grid_tile_width=0), "grid_tile_width"),
        (dict(epi_block_m=32), "epi_block_m"),
        (dict(epi_block_n=24), "epi_block_n"),
        (dict(wgmma_wait=2), "wgmma_wait"),
        (dict(num_sms=0), "num_sms"),
        (dict(cluster_m=3), "cluster_m"),
        (dict(cluster_m=2, cluster_n=2), "cluster_n"),
        (dict(cluster_n=2, num_sms=1), "num_sms"),
        (dict(pingpong=1), "pingpong"),
        (dict(block_m=128, block_n=128, pingpong=True, stream_k=True), "pingpong"),
        (dict(block_m=128, block_n=128, pingpong=True, num_compute_wgs=1), "pingpong"),
        (dict(block_m=128, block_n=256, pingpong=True), "pingpong"),  # 256 acc registers
    ],
)
def test_config_rejects_invalid_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    Config(**kwargs)


def test_config_accepts_valid_variants():
  Config(block_m=128, block_n=128, wg_split="m")  # 2 warpgroups x 64 rows
  Config(block_m=256, block_n=128, wg_split="m", stages=3)
  Config(block_m=64, block_n=16, num_compute_wgs=1, epi_block_n=16)


def test_config_is_frozen_and_keyword_only():
  cfg = Config()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.block_m = 64  # type: ignore[misc]
  with pytest.raises(TypeError):
    Config(128)  # type: ignore[misc]


def test_smem_budget_error_names_the_constraint():
  cfg = Config(block_m=256, block_n=256, block_k=64, stages=4,
               wg_split="m")  # 4 * 64 KiB ring alone exceeds 227 KiB
  with pytest.raises(ValueError, match="232448"):
    mosaic.check_smem_budget(cfg, jnp.bfloat16, jnp.bfloat16)
  a = jnp.zeros((1, 256, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="shared memory"):
    mosaic.gemm(a, a, None, alpha=1.0, beta=0.0, transpose_a=False,
                transpose_b=False, precision=None, out_dtype=np.dtype(
                    jnp.bfloat16), config=cfg, interpret=True)


def test_smem_budget_counts_short_k_and_c_buffer():
  cfg = Config(block_m=256, block_n=256, block_k=64, stages=4, wg_split="m")
  # With K = 64 the ring has one stage only, which fits.
  mosaic.check_smem_budget(cfg, jnp.bfloat16, jnp.bfloat16, k=64)
  big = Config(stages=4)  # 128x256x64: fits exactly with a bf16 epilogue
  mosaic.check_smem_budget(big, jnp.bfloat16, jnp.bfloat16)
  with pytest.raises(ValueError, match="c_dtype=float32"):
    mosaic.check_smem_budget(big, jnp.bfloat16, jnp.bfloat16, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
@pytest.mark.parametrize("c_dtype", [None, jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "mnk", [(1, 1, 1), (16, 8192, 8192), (4096, 4096, 4096), (4097,) * 3])
def test_default_config_fits(dtype, out_dtype, c_dtype, mnk):
  cfg = mosaic.default_config(*mnk, dtype, out_dtype=out_dtype,
                              c_dtype=c_dtype)
  mosaic.check_smem_budget(cfg, dtype, out_dtype or dtype, c_dtype, mnk[2])
  mosaic.check_layout(cfg, dtype, a_k_major=True, b_k_major=False)


def test_supports():
  assert mosaic.supports(jnp.bfloat16, None) is None
  assert mosaic.supports(jnp.float16, jax.lax.Precision.HIGHEST) is None
  assert mosaic.supports(jnp.float32, None) is None
  assert mosaic.supports(jnp.float32, jax.lax.Precision.DEFAULT) is None
  assert "TF32" in mosaic.supports(jnp.float32, jax.lax.Precision.HIGHEST)
  assert "int8" in mosaic.supports(jnp.int8, None)


def test_unavailable_reason_on_cpu_is_none():
  if jax.devices()[0].platform != "cpu":
    pytest.skip("checks the CPU (interpret mode) answer")
  assert mosaic.unavailable_reason() is None


# ----------------------------------------------------------------------------
# Interpret-mode correctness (CPU)
# ----------------------------------------------------------------------------


def _check(batch, m, n, k, dtype=jnp.bfloat16, *, transpose_a=False,
           transpose_b=False, alpha=1.0, beta=0.0, batch_b=None,
           out_dtype=None, c_dtype=None, config=None, seed=0, interpret=True,
           poison_bytes=None):
  rng = np.random.default_rng(seed)
  batch_b = batch if batch_b is None else batch_b
  a_shape = (batch, k, m) if transpose_a else (batch, m, k)
  b_shape = (batch_b, n, k) if transpose_b else (batch_b, k, n)
  a = jnp.asarray(rng.standard_normal(a_shape), dtype)
  b = jnp.asarray(rng.standard_normal(b_shape), dtype)
  c = None
  if beta != 0.0:
    c = jnp.asarray(rng.standard_normal((batch, m, n)), c_dtype or dtype)
  out_dtype = np.dtype(out_dtype or dtype)
  if config is None:
    config = mosaic.default_config(
        m, n, k, dtype, out_dtype=out_dtype,
        c_dtype=None if c is None else c.dtype).replace(num_sms=3)
  if not interpret:  # a NaN block freed last, so that the outputs likely reuse it
    jnp.full(((poison_bytes or batch * m * n * out_dtype.itemsize) // 4 + 1,), jnp.nan,
             jnp.float32).block_until_ready().delete()
  out = mosaic.gemm(a, b, c, alpha=alpha, beta=beta, transpose_a=transpose_a,
                    transpose_b=transpose_b, precision=None,
                    out_dtype=out_dtype, config=config, interpret=interpret)
  assert out.shape == (batch, m, n) and out.dtype == out_dtype

  f32 = lambda x: None if x is None else np.asarray(x.astype(jnp.float32))
  ref = reference(f32(a), f32(b), f32(c), alpha=alpha, beta=beta, transpose_a=transpose_a,
                  transpose_b=transpose_b)
  err = relative_error(f32(out), ref)
  assert err <= tolerance(dtype, None, k, out_dtype), (err, config)


def test_aligned_bf16():
  _check(1, 128, 128, 64)


def test_ragged_bf16_two_warpgroups():
  # 130x200x70 with a 128x256 CTA tile: ragged M, N and K (TMA fill/clip).
  _check(1, 130, 200, 70, config=Config(num_sms=3))


def test_ragged_split_m_more_tiles_than_sms():
  _check(1, 300, 150, 70, config=Config(
      block_m=128, block_n=128, wg_split="m", num_sms=2, grid_tile_width=2,
      grid_minor_dim="m"))


def test_wgmma_wait_one_deep_k():
  _check(1, 150, 150, 300, config=Config(
      block_m=128, block_n=128, stages=3, wgmma_wait=1, num_sms=2))


def test_cluster_m_odd_tile_count():
  # 3 row tiles in clusters of 2: the last cluster's second CTA gets a tile past
  # the edge, still takes part in the B multicast, and must write nothing.
  _check(1, 300, 200, 70, config=Config(block_m=128, block_n=128, cluster_m=2,
                                        num_sms=4))


def test_cluster_n_batched_shared_b():
  _check(2, 130, 300, 70, batch_b=1, config=Config(
      block_m=128, block_n=128, cluster_n=2, num_sms=2))


def test_default_uses_clusters_for_large_problems():
  cfg = mosaic.default_config(4096, 4096, 4096, jnp.bfloat16)
  assert (cfg.block_m, cfg.block_n, cfg.cluster_n) == (256, 128, 2)
  # A narrow problem keeps single-CTA tiles: a cluster would leave a CTA idle.
  assert mosaic.default_config(4096, 200, 4096, jnp.bfloat16).cluster_size == 1


@pytest.mark.parametrize("size, block_n", [(4096, 128), (4097, 192), (8192, 128)])
def test_default_tile_width_follows_the_rounds_of_tiles(size, block_n):
  # 4097^3: 5 rounds of 256x128 cluster tiles vs 3 of 256x192 (measured 543 vs 493
  # TFLOP/s on the H200); 4096^3 and 8192^3 fill their rounds with 256x128.
  if jax.default_backend() == "gpu" and jax.devices()[0].core_count != 132:
    pytest.skip("the expected choices are for 132 SMs")
  cfg = mosaic.default_config(size, size, size, jnp.bfloat16)
  assert cfg.block_n == block_n


def test_wgmma_wait_one_single_k_step():
  # K fits one block_k: the kernel must fall back to wgmma_wait=0 (the ring shrinks to
  # one stage, which cannot delay a release).
  _check(1, 300, 300, 64, config=Config(
      block_m=128, block_n=128, stages=3, wgmma_wait=1, cluster_n=2, num_sms=4))


# Shapes that stress the ring (interpret mode also checks
# that every barrier phase is observed, so a ring that leaves a phase pending fails).
_RING_CASES = [  # batch, m, n, k, stages, num_sms, cluster_n, wgmma_wait
    (1, 512, 384, 256, 4, 3, 1, 0),   # 12 tiles over 3 CTAs
    (1, 512, 256, 512, 2, 4, 1, 0),   # 8 tiles over 4 CTAs, 8 K blocks in 2 stages
    (2, 256, 512, 192, 3, 2, 2, 0),   # clusters with multicast, batch
    (1, 640, 128, 128, 2, 4, 1, 0),   # 5 tiles over 4 CTAs: one CTA runs 2, others 1
    (1, 512, 256, 320, 2, 2, 1, 0),   # 5 K blocks in 2 stages: buffers used unevenly
    (1, 128, 128, 128, 2, 4, 2, 0),   # fewer tiles than CTAs: some CTAs idle
    (1, 384, 256, 448, 3, 2, 2, 1),   # delayed release across tiles, clusters
]


@pytest.mark.parametrize("batch, m, n, k, stages, num_sms, cluster_n, wgmma_wait", _RING_CASES)
def test_ring(batch, m, n, k, stages, num_sms, cluster_n, wgmma_wait):
  _check(batch, m, n, k, config=Config(
      block_m=128, block_n=128, block_k=64, stages=stages, cluster_n=cluster_n,
      num_sms=num_sms, wgmma_wait=wgmma_wait))


# Pingpong over the same rings: the warpgroups take a CTA's tiles in turn, so a CTA with an
# odd number of tiles, one tile, or none leaves one warpgroup a tile short.
@pytest.mark.parametrize("batch, m, n, k, stages, num_sms, cluster_n, wgmma_wait", _RING_CASES)
def test_pingpong_ring(batch, m, n, k, stages, num_sms, cluster_n, wgmma_wait):
  _check(batch, m, n, k, config=Config(
      block_m=128, block_n=128, block_k=64, stages=stages, cluster_n=cluster_n,
      num_sms=num_sms, wgmma_wait=wgmma_wait, pingpong=True))


def test_pingpong_epilogue_transposed_clusters_along_m():
  # Each warpgroup's epilogue (C of another dtype, alpha/beta) on 64x256 tiles of its
  # own, transposed operands, clusters sharing B.
  _check(2, 300, 520, 200, jnp.float16, transpose_a=True, transpose_b=True, alpha=0.5,
         beta=-2.0, c_dtype=jnp.float32, out_dtype=jnp.float32, config=Config(
             block_m=64, block_n=256, stages=3, cluster_m=2, num_sms=4, pingpong=True))


@pytest.mark.gpu
@pytest.mark.parametrize("batch, m, n, k, dtype, kwargs, config", [
    # 128x128 tiles sharing A in clusters, several rounds per warpgroup, ragged K
    (1, 1000, 1000, 4111, jnp.bfloat16, {},
     dict(block_m=128, block_n=128, stages=6, cluster_n=2, num_sms=10)),
    # 64x256 tiles sharing B, batched, transposed, beta*C of another dtype, odd tile counts
    (2, 777, 1300, 1000, jnp.float16, dict(transpose_a=True, transpose_b=True, alpha=0.5,
                                           beta=-2.0, c_dtype=jnp.float32),
     dict(block_m=64, block_n=256, stages=3, cluster_m=2, num_sms=14)),
    # the whole device, delayed releases, C of the out dtype (prefetched sub-tiles)
    (1, 4096, 4096, 4096, jnp.bfloat16, dict(beta=1.0),
     dict(block_m=128, block_n=128, stages=5, wgmma_wait=1)),
])
def test_pingpong_on_the_gpu(batch, m, n, k, dtype, kwargs, config):
  _check(batch, m, n, k, dtype, config=Config(pingpong=True, **config), interpret=False,
         **kwargs)


# ----------------------------------------------------------------------------
# Stream-K schedule (the kernel's own piece arithmetic, evaluated on ints; the
# kernel itself runs it on the GPU only: interpret mode has no global semaphores)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("tiles, k_iters, num_ctas, dp_rounds", [
    (1024, 128, 66, 15),  # bf16 8192^3, 256x128 tiles in clusters of 2: 15.5 rounds
    (576, 96, 66, 8),     # bf16 6144^3: 8.73 rounds
    (144, 48, 66, 1),     # bf16 3072^3: 2.18 rounds, the last full round is cut too
    (40, 64, 66, 0),      # 0.6 rounds
    (7, 100, 4, 1),       # ranges of 75 steps: tiles cut in two at different K
    (9, 50, 4, 1),        # ranges of 62..63 steps that start mid-tile
    (133, 1000, 132, 0),  # one tile more than a round
])
def test_stream_k_pieces_cover_every_step_once(monkeypatch, tiles, k_iters, num_ctas,
                                               dp_rounds):
  monkeypatch.setattr(hw, "num_sms", lambda: 132)  # the grids above fit it
  sk = mosaic.stream_k_schedule(Config(), tiles, k_iters, num_ctas, interpret=False)
  assert (sk.dp_rounds, sk.sk_iters) == (dp_rounds, (tiles - dp_rounds * num_ctas) * k_iters)
  owner = {}  # (tile, K block) -> CTA
  pieces = {}  # CTA -> [(tile, k0, k1)] in the order the CTA runs them
  steps = []
  for cta in range(num_ctas):
    for r in range(sk.dp_rounds):
      for kk in range(k_iters):
        assert owner.setdefault((cta + r * num_ctas, kk), cta) == cta
    start, end = (int(x) for x in sk.range(cta))
    next_step = sk.dp_rounds * k_iters
    for i in range(3):
      g, k0, k1, step = (int(x) for x in sk.piece(start, end, i))
      if k0 >= k1:
        continue
      assert step == next_step  # the ring's steps continue without a gap
      next_step += k1 - k0
      pieces.setdefault(cta, []).append((g, k0, k1))
      for kk in range(k0, k1):
        assert (g, kk) not in owner
        owner[g, kk] = cta
    assert next_step == sk.dp_rounds * k_iters + end - start
    steps.append(next_step)
  assert set(owner) == {(g, kk) for g in range(tiles) for kk in range(k_iters)}
  assert max(steps) - min(steps) <= 1  # every CTA gets the same work, +-1 step
  # What the kernel's hand-over assumes of a tile cut among CTAs: consecutive CTAs,
  # at most three; the first runs the tile's beginning as its last piece, the others
  # run theirs as their first piece.
  by_tile = {}
  for cta, cta_pieces in pieces.items():
    for g, k0, k1 in cta_pieces:
      by_tile.setdefault(g, []).append((k0, k1, cta))
  for g, parts in by_tile.items():
    parts.sort()
    if len(parts) == 1:
      continue
    assert len(parts) <= 3
    (_, _, first), *rest = parts
    assert pieces[first][-1] == (g, parts[0][0], parts[0][1])
    for i, (k0, k1, cta) in enumerate(rest, 1):
      assert cta == first + i and pieces[cta][0] == (g, k0, k1)


@pytest.mark.parametrize("config, tiles, k_iters, num_ctas, interpret", [
    (Config(), 264, 64, 132, False),                # whole rounds
    (Config(), 256, 64, 66, False),                 # bf16 4096^3: saves 7.7 steps
    (Config(), 60, 64, 132, False),                 # less than half a round
    (Config(), 200, 7, 132, False),                 # K too short to save enough
    (Config(), 260, 500, 132, False),               # last round 97% full: saves 15 steps
    (Config(stream_k=False), 200, 64, 132, False),  # switched off
    (Config(), 200, 64, 132, True),                 # interpret mode
])
def test_stream_k_schedule_off(monkeypatch, config, tiles, k_iters, num_ctas, interpret):
  monkeypatch.setattr(hw, "num_sms", lambda: 132)  # off for the reason given
  assert mosaic.stream_k_schedule(config, tiles, k_iters, num_ctas, interpret) is None


@pytest.mark.gpu
@pytest.mark.parametrize("batch, m, n, k, dtype, kwargs, config", [
    # the large-shape tiles, 256x128 in clusters of 2: 16 cluster tiles on 5 clusters
    (1, 1000, 1000, 4096, jnp.bfloat16, {},
     dict(block_m=256, block_n=128, wg_split="m", cluster_n=2, num_sms=10)),
    # 128x256 tiles, batched, transposed, alpha/beta with C: 84 tiles on 8 CTAs
    (2, 777, 1300, 4000, jnp.float16, dict(transpose_a=True, transpose_b=True, alpha=0.5,
                                           beta=-2.0, out_dtype=jnp.float32),
     dict(block_m=128, block_n=256, stages=3, epi_block_n=32, num_sms=8)),
    # delayed releases (wgmma_wait=1), clusters along m with an odd tile count
    (1, 1300, 1024, 4096, jnp.bfloat16, dict(beta=1.0),
     dict(block_m=128, block_n=128, cluster_m=2, wgmma_wait=1, num_sms=10)),
    # K of 65 blocks, the last ragged; batch-shared B
    (3, 500, 600, 4111, jnp.bfloat16, dict(batch_b=1), dict(block_m=128, block_n=128, num_sms=7)),
    # f32 inputs as TF32 (K-major copies), 128x128 tiles
    (1, 640, 896, 2048, jnp.float32, {}, dict(block_m=128, block_n=128, block_k=32, num_sms=8)),
])
def test_stream_k_on_the_gpu(monkeypatch, batch, m, n, k, dtype, kwargs, config):
  # The stream-K pieces, the partials' round trip and the semaphores, on the GPU
  # (interpret mode has no global semaphores): few CTAs make several rounds of tiles
  # and cut the last ones. Checks that stream-K ran, against float32 HIGHEST, through
  # a NaN-poisoned allocator (sized for the output and the f32 partials, so that a
  # partial left from an earlier call cannot pass for one written by this call).
  schedules = []
  schedule = mosaic.stream_k_schedule
  monkeypatch.setattr(mosaic, "stream_k_schedule",
                      lambda *args: schedules.append(schedule(*args)) or schedules[-1])
  cfg = Config(**config)
  partials = cfg.num_sms * cfg.num_compute_wgs * cfg.wg_block_m * cfg.wg_block_n * 4
  _check(batch, m, n, k, dtype, config=cfg, interpret=False, **kwargs,
         poison_bytes=2 * (partials + batch * m * n * 4))
  assert schedules and schedules[-1] is not None


def test_stream_k_is_on_unless_pingpong():
  assert Config().uses_stream_k and not Config(stream_k=False).uses_stream_k
  assert not Config(block_m=128, block_n=128, pingpong=True).uses_stream_k


def test_stream_k_off_with_more_ctas_than_sms(monkeypatch):
  # Stream-K CTAs wait for each other, which needs all of them resident: a grid
  # larger than the device (Config.num_sms above its SM count) runs whole tiles.
  monkeypatch.setattr(hw, "num_sms", lambda: 132)
  a = jax.ShapeDtypeStruct((1, 8192, 8192), jnp.bfloat16)
  for num_sms, cut in ((132, True), (134, False)):
    cfg = mosaic.default_config(8192, 8192, 8192, jnp.bfloat16).replace(num_sms=num_sms)
    f = lambda a, b, cfg=cfg: mosaic.gemm(
        a, b, None, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
        precision=None, out_dtype=np.dtype(jnp.bfloat16), config=cfg, interpret=False)
    text = jax.jit(f).trace(a, a).lower(lowering_platforms=("cuda",)).as_text()
    # With stream-K the kernel has a second output: the f32 partial sums.
    partials = f"x{cfg.wg_block_m}x{cfg.wg_block_n}xf32>"
    assert (f"tensor<{num_sms * cfg.num_compute_wgs}{partials}" in text) == cut, num_sms


def test_batched_and_shared_b():
  _check(3, 70, 72, 40)
  _check(3, 70, 72, 40, batch_b=1)


@pytest.mark.parametrize("transpose_a, transpose_b",
                         [(True, False), (False, True), (True, True)])
def test_transposed_f16(transpose_a, transpose_b):
  _check(2, 130, 136, 72, jnp.float16, transpose_a=transpose_a,
         transpose_b=transpose_b)


def test_alpha_beta_c_same_dtype():
  _check(1, 100, 90, 50, alpha=0.5, beta=-1.5)


def test_alpha_beta_c_other_dtype_f32_out():
  _check(2, 100, 90, 50, alpha=1.5, beta=0.5, out_dtype=jnp.float32,
         c_dtype=jnp.bfloat16)
  _check(1, 100, 90, 50, alpha=1.5, beta=0.5, out_dtype=jnp.bfloat16,
         c_dtype=jnp.float32)


@pytest.mark.parametrize("transpose_a, transpose_b",
                         [(False, False), (True, True)])
def test_f32_as_tf32(transpose_a, transpose_b):
  _check(1, 130, 200, 70, jnp.float32, transpose_a=transpose_a,
         transpose_b=transpose_b)


def _check_keep_pre(batch, m, n, k, *, config=None, interpret=True, activation="gelu"):
  """keep_pre: act(z) and z = a @ b + bias, both stored by the epilogue (two stores per
  sub-tile through the slot ring), against float64, through a NaN-poisoned allocator on
  the GPU."""
  rng = np.random.default_rng(1)
  a, b = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((batch, m, k), (1, k, n)))
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
  config = config or mosaic.default_config(m, n, k, jnp.bfloat16).replace(num_sms=3)
  if not interpret:
    jnp.full((2 * batch * m * n // 2 + 1,), jnp.nan, jnp.float32).block_until_ready().delete()
  out, pre = mosaic.gemm(a, b, None, alpha=1.0, beta=0.0, transpose_a=False, transpose_b=False,
                         precision=None, out_dtype=np.dtype(jnp.bfloat16), config=config,
                         interpret=interpret, bias=bias, activation=activation, keep_pre=True)
  f32 = lambda x: np.asarray(x.astype(jnp.float32))
  tol = tolerance(jnp.bfloat16, None, k)
  assert relative_error(f32(pre), reference(f32(a), f32(b), bias=f32(bias))) <= tol
  want = reference(f32(a), f32(b), bias=f32(bias), activation=activation)
  assert relative_error(f32(out), want) <= 2 * tol  # act in f32 on top of the GEMM


def test_keep_pre_stores_the_pre_activation_too():
  _check_keep_pre(2, 130, 200, 72)
  _check_keep_pre(1, 300, 200, 72, config=Config(block_m=128, block_n=128, num_sms=2,
                                                 pingpong=True))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    None,  # the shape's default
    dict(block_m=128, block_n=128, num_sms=8),  # stream-K: cut tiles finish in the epilogue
    dict(block_m=128, block_n=256, epi_block_n=32, num_sms=5, stream_k=False),
    dict(block_m=128, block_n=128, stages=6, cluster_n=2, num_sms=10, pingpong=True),
    dict(block_m=64, block_n=256, stages=4, cluster_m=2, wgmma_wait=1, num_sms=132,
         pingpong=True),
])
def test_keep_pre_on_the_gpu(config):
  config = None if config is None else Config(**config)
  _check_keep_pre(1, 1031, 2051, 4111, config=config, interpret=False)


def test_misaligned_rows_are_padded():
  # bf16 rows of 67 and 97 elements are not 16-byte aligned (TMA rule).
  _check(1, 65, 67, 97, transpose_a=True)
  _check(1, 1, 1, 1, jnp.float32, alpha=2.0, beta=1.0)


def test_default_config_replaced_when_c_dtype_needs_more_smem():
  # The shape default (built for bf16 out, no C) is re-picked inside gemm for a
  # float32 C instead of failing the shared-memory budget.
  cfg = mosaic.default_config(300, 260, 256, jnp.bfloat16)
  # K = 256 fills the 4-stage ring, so the bf16-out default really does not fit with an
  # f32 C (with a small K the ring is capped and the re-pick would never run).
  assert mosaic.smem_bytes(cfg, jnp.bfloat16, jnp.bfloat16, jnp.float32, 256) > mosaic.SMEM_BYTES_PER_BLOCK
  _check(1, 300, 260, 256, alpha=1.0, beta=1.0, c_dtype=jnp.float32,
         config=cfg)


def test_swizzle_mismatch_is_rejected():
  # bf16 B tile of 32 columns gets a 64-byte swizzle, A's 64-wide K a 128-byte.
  cfg = Config(block_m=64, block_n=32, num_compute_wgs=1, epi_block_n=32)
  with pytest.raises(ValueError, match="swizzle"):
    mosaic.check_layout(cfg, jnp.bfloat16, a_k_major=True, b_k_major=False)


# ----------------------------------------------------------------------------
# Lowering for sm_90 (runs on the CPU: Mosaic GPU's layout inference, TMA and
# wgmma checks run in Python at lowering time; interpret mode skips them).
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch, m, n, k, dtype, transpose_a, transpose_b, beta, out_dtype, c_dtype",
    [
        (1, 4096, 4096, 4096, jnp.bfloat16, False, False, 0.0, None, None),
        (1, 4097, 4097, 4097, jnp.bfloat16, False, False, 0.0, None, None),
        (2, 1000, 1000, 1000, jnp.float16, True, True, 1.0, None, None),
        (1, 130, 200, 70, jnp.float32, False, False, 1.0, jnp.bfloat16,
         jnp.float32),
        (3, 16, 8192, 512, jnp.bfloat16, False, True, 0.0, jnp.float32, None),
        (1, 1, 1, 1, jnp.bfloat16, True, False, 0.0, None, None),
    ],
)
def test_lowers_for_sm90(batch, m, n, k, dtype, transpose_a, transpose_b, beta,
                         out_dtype, c_dtype):
  a = jax.ShapeDtypeStruct((batch, k, m) if transpose_a else (batch, m, k),
                           dtype)
  b = jax.ShapeDtypeStruct((1, n, k) if transpose_b else (1, k, n), dtype)
  c = None if beta == 0.0 else jax.ShapeDtypeStruct((batch, m, n),
                                                    c_dtype or dtype)
  out_dtype = np.dtype(out_dtype or dtype)
  config = mosaic.default_config(m, n, k, dtype, out_dtype=out_dtype,
                                 c_dtype=c_dtype).replace(num_sms=132)
  f = lambda a, b, c: mosaic.gemm(
      a, b, c, alpha=1.5, beta=beta, transpose_a=transpose_a,
      transpose_b=transpose_b, precision=None, out_dtype=out_dtype,
      config=config, interpret=False)
  text = jax.jit(f).trace(a, b, c).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
