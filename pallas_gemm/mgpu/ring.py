"""The warp-specialized TMA ring every Mosaic GPU kernel of the package runs (the GEMM,
the grouped forward and weight gradient, the scaled fp8 GEMM).

A CTA runs num_wgs consumer warpgroups (wg < num_wgs) and one producer warpgroup (wg ==
num_wgs). Shared memory holds a ring of `stages` slots; the CTA's K steps, counted over
all of its tiles, use slot step % stages in turn. Two arrays of barriers, one per slot,
tie the two sides together:
  * produced[slot]: completes when the step's TMA loads have landed (num_arrivals = the
    loads per step); the consumers wait on it before their wgmma reads the slot.
  * consumed[slot]: completes when every consumer warpgroup reading the step released
    the slot (num_arrivals = those warpgroups; with a cluster multicast, those of both
    CTAs); the producer waits on it before loading the slot again.
A barrier's phase is tracked by each waiting thread through the waits it makes, so a
thread has to wait on every completion of a barrier, in order. The producer does so on
consumed: `fill` waits once for each step from the stages-th on (for the release of the
step `stages` earlier), `drain` for the last min(steps, stages) releases: as many waits
as the CTA's steps, which is the number of completions.

The kernels differ in what a step loads (operands, scales, a multicast, per-warpgroup
`produced` barriers), in how they count steps, and in their consumers' K loops; those
stay in the kernels. This module holds what is the same: the register split, the
producer warp, the wait before each step's loads and the drain before the CTA exits.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Registers per thread left to the producer warpgroup (setmaxnreg): it only computes
# addresses and issues TMA copies.
PRODUCER_REGISTERS = 40


def consumer_registers(num_wgs: int) -> int:
  """Registers per thread of each of num_wgs consumer warpgroups: what the producer
  leaves of the 512 per thread a warpgroup would have with the whole 64K register file,
  shared evenly, at most 256 and a multiple of 8 (setmaxnreg's range and granularity).
  The split Pallas's emit_pipeline_warp_specialized makes."""
  return min(256, (512 - PRODUCER_REGISTERS) // num_wgs) // 8 * 8


def producer_warp(wg, num_wgs: int):
  """Decorator: runs body() at once on one warp of the producer warpgroup (wg ==
  num_wgs), after that warpgroup lowered its registers to PRODUCER_REGISTERS (which
  the consumers' `consumer_warpgroups` then take). A TMA copy is issued by a single
  thread, so one warp issues all of the ring's loads; the other three warps idle."""

  def run(body):
    @pl.when(wg == num_wgs)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      @plgpu.warp_map
      def _per_warp(warp):
        pl.when(warp == 0)(body)

  return run


def consumer_warpgroups(wg, num_wgs: int):
  """Decorator: runs body() at once on the consumer warpgroups (wg < num_wgs), after
  they raised their registers to `consumer_registers(num_wgs)` for the accumulators."""

  def run(body):
    @pl.when(wg < num_wgs)
    def _consumers():
      plgpu.set_max_registers(consumer_registers(num_wgs), action="increase")
      body()

  return run


def fill(consumed, start, stop, *, step, stages: int, load):
  """The producer's loop over a piece of its steps: for kk in [start, stop), ring step
  s = step(kk) goes to slot s % stages; from s = stages on, the slot still holds step
  s - stages, so the producer first waits for that step's release (consumed[slot]) lest
  the TMA overwrite tiles a wgmma is reading. Then load(kk, slot) issues the step's
  copies, each arriving on the slot's `produced` barrier."""

  @pl.loop(start, stop)
  def _step(kk):
    s = step(kk)
    slot = lax.rem(s, stages)

    @pl.when(s >= stages)
    def _():
      plgpu.barrier_wait(consumed.at[slot])

    load(kk, slot)


def drain(consumed, steps, *, stages: int):
  """After the producer's last loads (steps in all): waits for the last min(steps,
  stages) releases, which `fill` never waited for. Then no arrival on this CTA's
  barriers (from its consumers or, with a multicast, the cluster peer's) is pending
  when the CTA exits, and the producer has waited on every completion of consumed."""

  @pl.loop(jnp.maximum(steps - stages, 0), steps)
  def _drain(s):
    plgpu.barrier_wait(consumed.at[lax.rem(s, stages)])
