"""The benchmark's problems: shape categories and dtype/precision variants (tests reuse these).

`--full` (GPU) runs FULL, `--gpu-default` MEDIUM, `--quick` (a CPU's default run, ~1-2 min
there) SMALL; a GPU's default run is the headline sweep (headline.py).
Each category lists the dtype variants it is measured in: 16-bit formats and TF32 are
what users run large GEMMs in, IEEE f32 is slow (67 TFLOP/s peak) so it gets a subset,
and f16 mirrors bf16's kernels so it gets the square + ragged sweeps only. That keeps
`--full` at ~400 measurements, each dominated by a 1-2 s kernel compile (see __main__).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
  category: str
  m: int
  n: int
  k: int
  batch: int = 1

  @property
  def flops(self) -> int:
    return 2 * self.batch * self.m * self.n * self.k

  @property
  def label(self) -> str:
    core = f"{self.m}x{self.n}x{self.k}"
    return core if self.batch == 1 else f"{self.batch}x{core}"


@dataclasses.dataclass(frozen=True)
class DType:
  name: str                        # CLI name: f32-highest, f32-default, bf16, f16
  dtype: np.dtype
  precision: jax.lax.Precision | None
  peak_label: str                  # which H100/H200 peak applies (PEAK_TFLOPS key)


DTYPES = {
    "f32-highest": DType("f32-highest", np.dtype(np.float32), jax.lax.Precision.HIGHEST, "FP32"),
    "f32-default": DType("f32-default", np.dtype(np.float32), None, "TF32"),
    "bf16": DType("bf16", np.dtype(jnp.bfloat16), None, "BF16"),
    "f16": DType("f16", np.dtype(np.float16), None, "FP16"),
}
ALIASES = {"f32": ["f32-highest", "f32-default"], "tf32": ["f32-default"],
           "ieee": ["f32-highest"], "float32": ["f32-highest", "f32-default"],
           "bfloat16": ["bf16"], "float16": ["f16"], "all": list(DTYPES)}

# Dense tensor-core (or FP32 SIMT) peaks of H100/H200 SXM, TFLOP/s.
PEAK_TFLOPS = {"FP32": 67.0, "TF32": 495.0, "BF16": 989.0, "FP16": 989.0}

ALL = list(DTYPES)
NO_IEEE = ["f32-default", "bf16", "f16"]
HALF_AND_TF32 = ["f32-default", "bf16"]

# category -> (shapes, dtype names measured for it)
FULL: dict[str, tuple[list[Shape], list[str]]] = {
    # 16384^3 in IEEE f32 is 8.8 TFLOP = ~0.2 s per call: too slow for the sweep's budget.
    "square": ([Shape("square", s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192)], ALL),
    "square-xl": ([Shape("square-xl", 16384, 16384, 16384)], NO_IEEE),
    # Primes and 2^k+1: every tile has a ragged edge, TMA needs padding or masks.
    "ragged": ([Shape("ragged", 1000, 1000, 1000), Shape("ragged", 997, 1009, 1013),
                Shape("ragged", 4097, 4097, 4097), Shape("ragged", 2047, 8191, 1023)], ALL),
    # Decode-style: a few rows against a large weight; bandwidth-bound.
    "skinny": ([Shape("skinny", m, 8192, 8192) for m in (1, 8, 32, 64)]
               + [Shape("skinny", 8192, 16, 8192)], ["f32-highest"] + HALF_AND_TF32),
    "k-heavy": ([Shape("k-heavy", 512, 512, 65536), Shape("k-heavy", 2048, 2048, 32768)],
                HALF_AND_TF32),
    "k-light": ([Shape("k-light", 8192, 8192, 64), Shape("k-light", 4096, 4096, 256)],
                HALF_AND_TF32),
    "batched": ([Shape("batched", 256, 256, 256, batch=64),
                 Shape("batched", 1024, 1024, 1024, batch=16),
                 Shape("batched", 2048, 2048, 512, batch=8)], ["f32-highest"] + HALF_AND_TF32),
}

# --quick: small enough for a laptop CPU, still covering aligned, ragged, batched.
SMALL: dict[str, tuple[list[Shape], list[str]]] = {
    "square": ([Shape("square", s, s, s) for s in (128, 256, 512)], ["f32-highest", "f32-default", "bf16"]),
    "ragged": ([Shape("ragged", 257, 129, 100)], ["f32-highest", "bf16"]),
    "batched": ([Shape("batched", 64, 64, 64, batch=8)], ["f32-highest", "bf16"]),
}

# `--gpu-default`: a ~2-minute GPU check of the regimes that matter most.
MEDIUM: dict[str, tuple[list[Shape], list[str]]] = {
    "square": ([Shape("square", s, s, s) for s in (1024, 2048, 4096, 8192)], ALL),
    "ragged": ([Shape("ragged", 4097, 4097, 4097)], ALL),
    "skinny": ([Shape("skinny", 16, 8192, 8192)], ["bf16"]),
    "batched": ([Shape("batched", 1024, 1024, 1024, batch=16)], ["bf16"]),
}

# On a CPU the Pallas backends run in the interpreter (a Python loop over grid steps):
# only shapes this small are timed for them, so the default run stays ~1-2 minutes.
INTERPRET_MAX_FLOPS = 2 * 128**3

_SHAPE_RE = re.compile(r"^(?:(\d+)x)?(\d+)x(\d+)x(\d+)$")


def parse_dtypes(spec: str | None) -> list[str] | None:
  """'bf16,f32' -> ['bf16', 'f32-highest', 'f32-default'] (None: no filter)."""
  if not spec:
    return None
  out = []
  for token in spec.split(","):
    token = token.strip().lower()
    names = ALIASES.get(token, [token])
    for name in names:
      if name not in DTYPES:
        raise ValueError(f"unknown dtype {token!r}; use {sorted(DTYPES) + sorted(ALIASES)}")
      if name not in out:
        out.append(name)
  return out


def plan(table, shapes_spec: str | None = None, dtypes: list[str] | None = None
         ) -> list[tuple[Shape, DType]]:
  """(shape, dtype) pairs of a table, filtered by --shapes and --dtypes.

  shapes_spec: comma-separated category names of `table` and/or explicit shapes
  "MxNxK" or "BxMxNxK" (explicit shapes run in every selected dtype).
  """
  chosen: list[tuple[Shape, list[str]]] = []
  tokens = [t.strip() for t in shapes_spec.split(",")] if shapes_spec else list(table)
  for token in tokens:
    if token in table:
      shapes, names = table[token]
      chosen += [(s, names) for s in shapes]
    elif match := _SHAPE_RE.match(token):
      b, m, n, k = match.groups()
      chosen.append((Shape("custom", int(m), int(n), int(k), int(b or 1)), ALL))
    else:
      raise ValueError(f"unknown shape or category {token!r}; categories: {sorted(table)}, "
                       "or MxNxK / BxMxNxK")
  return [(s, DTYPES[name]) for s, names in chosen for name in names
          if dtypes is None or name in dtypes]
