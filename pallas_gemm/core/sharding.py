"""PartitionSpecs as the partitioning rules read them: each dimension's mesh axes as a
tuple, and back. Shared by the dense and grouped primitives' rules."""

from __future__ import annotations

import numpy as np
from jax.sharding import NamedSharding


def axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry (None, an axis name, or a tuple of them) as a tuple."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_axes(sharding, ndim: int) -> list[tuple[str, ...]]:
  """Each of ndim dimensions' mesh axes (() where replicated) of a NamedSharding."""
  spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  return [axes(e) for e in spec + (None,) * (ndim - len(spec))]


def entry(names: tuple[str, ...]):
  """The PartitionSpec entry of a tuple of mesh axes."""
  return None if not names else names[0] if len(names) == 1 else names


def size(mesh, names) -> int:
  """The number of devices along these mesh axes."""
  return int(np.prod([mesh.shape[x] for x in names]))
