"""Stream-K: the last, partly idle round of output tiles cut into equal ranges of K
steps, one per CTA, so that all CTAs finish together.

`stream_k_schedule` decides per launch whether to cut and which steps each CTA runs
(`StreamK`); `finish_cut_piece` is the kernel side: a tile cut between CTAs is summed
through an f32 buffer in global memory, ordered by Pallas global semaphores.
"""

from __future__ import annotations

import dataclasses

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.mgpu import hw
from pallas_gemm.matmul.mosaic.config import Config, _sub_tiles

# K steps that cutting the last round must save each CTA (see stream_k_schedule).
_STREAM_K_MIN_SAVED_STEPS = 24


@dataclasses.dataclass(frozen=True)
class StreamK:
  """Which steps each CTA runs when the last tiles are cut along K.

  Tiles are numbered g = batch entry * tiles per batch entry + planar-snake index.
  CTA c first runs the whole tiles c + r * num_ctas for r < dp_rounds, then its range
  [c * sk_iters // num_ctas, (c + 1) * sk_iters // num_ctas) of the remaining
  (tile, K block) steps, numbered (g - dp_rounds * num_ctas) * k_iters + kk.
  The remaining tiles number between half a round and 1.5 rounds, so every range
  holds at least k_iters // 2 steps (a tile is cut among at most three consecutive
  CTAs) and at most three pieces (the end of a tile begun by an earlier CTA, a whole
  tile, the beginning of a tile that later CTAs end), or one piece from the middle
  of a tile.
  """

  num_ctas: int
  k_iters: int
  dp_rounds: int
  sk_iters: int

  def range(self, cta):
    """[start, end) of the CTA's stream-K steps (ints or int32 arrays)."""
    return (lax.div(cta * self.sk_iters, self.num_ctas),
            lax.div((cta + 1) * self.sk_iters, self.num_ctas))

  def piece(self, start, end, i):
    """Piece i (0, 1, 2) of the range: (tile g, k0, k1, first step); empty if k0 >= k1.

    Pieces end on tile boundaries: piece i spans [p_i, p_i+1) with
    p_i = clamp((start // k_iters + i) * k_iters, start, end).
    """
    first_tile = lax.div(start, self.k_iters)
    lo = lax.max(start, lax.min((first_tile + i) * self.k_iters, end))
    hi = lax.max(start, lax.min((first_tile + i + 1) * self.k_iters, end))
    tile = lax.div(lo, self.k_iters)
    k0 = lo - tile * self.k_iters
    return (self.dp_rounds * self.num_ctas + tile, k0, k0 + hi - lo,
            self.dp_rounds * self.k_iters + lo - start)


def stream_k_schedule(config: Config, tiles: int, k_iters: int, num_ctas: int,
                      interpret: bool) -> StreamK | None:
  """The stream-K schedule of a launch, or None to run whole tiles only.

  tiles: CTA (cluster) tiles over all batch entries; num_ctas: CTAs (clusters).
  Cut only the last, partial round when it holds at least half a round of tiles,
  else it and the last full round: CTAs at different K offsets of their tiles
  share fewer operand tiles in L2, so the cut part is kept small (on the H200,
  cutting the last full round too cost 4% at bf16 4096^3 and 12% at 4097^3,
  where the operands' whole K extent no longer fit in L2).
  None when stream-K is off, in interpret mode (no global semaphores), when the
  grid has more CTAs than the device has SMs (a CTA may then wait for one that is
  not scheduled yet: CUDA does not promise the order), when the
  tiles fill whole rounds or are under half a round, or when it would save each
  CTA fewer than _STREAM_K_MIN_SAVED_STEPS K steps: the idle share of the last
  round times k_iters. The hand-over of the cut tiles (their f32 partials written
  and read through L2 by all CTAs at once, and the zeroing of the semaphores) cost
  ~12 us per call on the H200, ~17 K steps of a 256x128 bf16 tile (bf16 8192^3
  saves 0.48 * 128 = 62 steps and ran 2% faster, 6144^3 0.27 * 96 = 26 steps, 1%
  faster; 4096^3 0.12 * 64 = 8 steps, 4% slower).
  """
  rest = tiles % num_ctas
  if (not config.uses_stream_k or interpret or rest == 0
      or num_ctas * config.cluster_size > hw.num_sms()
      or (num_ctas - rest) * k_iters < _STREAM_K_MIN_SAVED_STEPS * num_ctas
      or (2 * rest < num_ctas and tiles < num_ctas)):
    return None
  sk_tiles = rest if 2 * rest >= num_ctas else rest + num_ctas
  sk_iters = sk_tiles * k_iters
  if (num_ctas + 1) * sk_iters >= 2**31:  # the int32 range arithmetic
    return None
  return StreamK(num_ctas=num_ctas, k_iters=k_iters,
                 dp_rounds=(tiles - sk_tiles) // num_ctas, sk_iters=sk_iters)


def finish_cut_piece(acc, partials_gmem, semaphores, *, write, config: Config, cta, rank,
                     wg, k0, k1, k_iters: int) -> None:
  """Ends a consumer warpgroup's stream-K piece [k0, k1) of a tile: its epilogue, or the
  hand-over of its f32 sum to the CTA that writes the tile.

  A tile cut among CTAs c < c + 1 (< c + 2): c runs its first K blocks as the last
  piece of its range, the others the rest, each as its first piece. The last of them
  stores its f32 accumulator to partials_gmem and signals a global semaphore
  (release); a middle one waits for it (acquire), adds it and hands the sum on the
  same way; c waits for c + 1's, adds it in its epilogue and writes the tile. Waits go
  only from a CTA to the first piece of the next one, the ones that wait for nothing
  come last, and all CTAs are resident (one per SM; `stream_k_schedule` refuses a grid
  larger than the device), so there is no cycle; a first piece ends at about the time
  the previous CTA's range does, so a partial is normally ready when it is needed.

  acc: the warpgroup's (wg_block_m, wg_block_n) f32 sum of the piece.
  partials_gmem: (num_ctas * cluster_size * num_compute_wgs, wg_block_m, wg_block_n) f32,
    semaphores: as many global semaphores; entry (CTA, cluster rank, warpgroup) is the
    one this warpgroup hands over through.
  write: the tile's epilogue for acc; write(partial=ref) adds the ref's f32 sum first.
  """
  num_wgs = config.num_compute_wgs
  mine = (cta * config.cluster_size + rank) * num_wgs + wg
  nexts = mine + config.cluster_size * num_wgs  # same warpgroup of CTA cta + 1
  begins_tile, ends_tile = k0 == 0, k1 == k_iters

  def hand_over(add_next):  # this piece's sum (+ the next CTA's) to the tile's
    if add_next:            # earlier CTAs
      plgpu.semaphore_wait(semaphores.at[nexts], 1, memory_scope="gpu")
    for es in _sub_tiles(config):
      val = acc[es]
      if add_next:
        val = val + plgpu.load(partials_gmem.at[(nexts, *es)],
                               layout=plgpu.Layout.WGMMA, optimized=False)
      partials_gmem[(mine, *es)] = val
    plgpu.semaphore_signal(semaphores.at[mine], 1, memory_scope="gpu")

  # An earlier CTA ends this tile. A piece from the middle of the tile first
  # adds what CTA cta + 1 did of the rest: the tile's first CTA reads one sum.
  pl.when(~begins_tile & ends_tile)(lambda: hand_over(False))
  pl.when(~begins_tile & ~ends_tile)(lambda: hand_over(True))

  @pl.when(begins_tile & ~ends_tile)  # CTA cta + 1 has (the sum of) the rest
  def _finish():
    plgpu.semaphore_wait(semaphores.at[nexts], 1, memory_scope="gpu")
    write(partial=partials_gmem.at[nexts])

  @pl.when(begins_tile & ends_tile)
  def _whole():
    write()
