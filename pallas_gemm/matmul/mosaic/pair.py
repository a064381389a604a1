"""A GEMM with K split over the two GPUs of a mesh axis, summed by the kernels
themselves: the peer-memory parts of the Mosaic kernel (`Peer`, the rows a kernel
computes and where it stores them, the closing handshake) and when the pair applies
(`pair_reason`). `mosaic.pair_gemm` runs the two kernels."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.matmul.mosaic.config import Config, default_config
from pallas_gemm.matmul.mosaic.epilogue import to_own

@dataclasses.dataclass(frozen=True)
class Peer:
  """One of the two kernels of a K split over the two devices of mesh axis ``axis``
  (`pair_gemm`): each device holds a K half of a and b, and owns one half of the rows.

  send=True: the device computes the *other* device's rows of its partial product and
  the kernel stores them, f32, into the other device's output (over NVLink, TMA
  stores to a peer address) instead of its own. send=False: the device computes its
  own rows, adds what the other device sent (C, f32) and runs the epilogue; with
  gather, it stores the finished rows into both devices' (M, N) outputs, so both end
  with the whole result and no collective runs. A kernel that stores to the peer
  ends with a handshake (`handshake`): every warpgroup waits for its stores, adds 1
  to its CTA's semaphore on the other device and takes 1 from its own CTA's. A CTA
  finishes only once its twin CTA's warpgroups have all signalled, so a finished
  kernel means the peer's stores into this device are complete (the next kernel may
  read them). Both devices must run the same grid (the same SM count).
  """
  axis: str
  send: bool
  gather: bool = False

  def __post_init__(self):
    if self.send and self.gather:
      raise ValueError("Peer: a send kernel stores its partial rows to the peer only")

  @property
  def stores_remote(self) -> bool:
    return self.send or self.gather


def placement(peer: Peer | None, m: int):
  """(the first of a's rows the kernel computes, destinations): destinations(ref) lists
  where each output sub-tile of ref goes, as (ref, row offset or None). m: the rows the
  kernel computes (a has 2 * m with a peer)."""
  if peer is None:
    return 0, to_own
  me = lax.axis_index(peer.axis)
  other = {peer.axis: 1 - me}
  a_row0 = (1 - me if peer.send else me) * m

  def destinations(ref):
    if peer.send:
      return [(plgpu.remote_ref(ref, other), None)]
    if peer.gather:
      return [(ref, a_row0), (plgpu.remote_ref(ref, other), a_row0)]
    return [(ref, None)]

  return a_row0, destinations


def handshake(peer: Peer, config: Config, num_ctas: int) -> None:
  """The end of a kernel that stores into the other device (see `Peer`): each warpgroup
  waits until its stores are written, adds 1 to its twin's semaphore on the other
  device (one per CTA of the grid) and waits to take 1 from its own. A CTA's twins
  signal as many times as it waits, so the semaphores end every call at 0."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=False)
  cta = lax.axis_index("sm")
  if config.cluster_size > 1:
    cta = cta * config.cluster_size + lax.axis_index("cluster")
  sems = pl.get_global(plgpu.SemaphoreType.REGULAR((num_ctas * config.cluster_size,)))
  me = lax.axis_index(peer.axis)
  plgpu.semaphore_signal(sems.at[cta], 1, device_id={peer.axis: 1 - me})
  plgpu.semaphore_wait(sems.at[cta], 1)


def pair_configs(m: int, n: int, k: int, dtype, out_dtype, num_sms) -> tuple[Config, Config]:
  """The configs of `pair_gemm`'s two kernels: the shape defaults for one device's half
  of the rows, with an f32 output (send) and an f32 C (finish)."""
  send = default_config(m // 2, n, k, dtype, out_dtype=jnp.float32)
  finish = default_config(m // 2, n, k, dtype, out_dtype=out_dtype, c_dtype=jnp.float32)
  return send.replace(num_sms=num_sms), finish.replace(num_sms=num_sms)


def shape_reason(m: int, n: int, k: int, dtype, interpret: bool) -> str | None:
  """What keeps a local problem from the pair kernels whatever their configs, or None:
  they are kept to what needs no padding and no stream-K."""
  if interpret:
    return "the interpreter has no peer memory or global semaphores"
  if jnp.dtype(dtype).itemsize != 2:
    return f"needs 16-bit operands, got {jnp.dtype(dtype)}"
  if m % 256 or n % 128 or k % 128:
    return f"needs M a multiple of 256, N and K of 128, got {(m, n, k)}"
  return None


def tiles_reason(m: int, n: int, config: Config) -> str | None:
  """Why one device's half of the rows (M/2 x N) is not whole tiles of config, or None."""
  if (m // 2) % (config.block_m * config.cluster_m) or n < config.block_n:
    return f"M/2={m // 2} rows are not whole tiles of {config}"
  return None


def pair_reason(m: int, n: int, k: int, dtype, out_dtype, interpret: bool,
                num_sms: int | None = None) -> str | None:
  """Why `pair_gemm` cannot run this local problem, or None: 16-bit operands, M a
  multiple of 256, N and K of 128, each device's half of the rows a whole number of
  tiles of both kernels' configs."""
  if why := shape_reason(m, n, k, dtype, interpret):
    return why
  for cfg in pair_configs(m, n, k, dtype, out_dtype, num_sms):
    if why := tiles_reason(m, n, cfg):
      return why
  return None
