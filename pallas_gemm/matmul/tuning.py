"""Per-shape kernel configs: a persistent autotune cache, a shipped table, and `autotune`.

`pallas_gemm.gemm(..., config=None)` asks `lookup_config` for a config, in this order:

1. The user's autotune cache (written by `autotune`), exact key
   (device_kind, backend, dtype, precision class, m, n, k). File:
   ``$PALLAS_GEMM_CACHE`` if set (a .json file, or a directory holding autotune.json), else
   ``$XDG_CACHE_HOME/pallas_gemm/autotune.json``, else ``~/.cache/pallas_gemm/autotune.json``::

     {"version": 1,
      "entries": {"<device_kind>|<backend>|<dtype>|<precision class>|<m>|<n>|<k>":
                    {"config": {<Config field>: value, ...}, "ms": 0.31, "default_ms": 0.40,
                     "jax": "0.11.2", "date": "2025-01-01T00:00:00"}}}

2. The table shipped with the package, ``pallas_gemm/matmul/tuned_configs.json``, keyed by device
   *family* (not the exact device) and a coarse shape bucket, so a few measured entries
   cover every shape near them::

     {"version": 1,
      "entries": [{"family": "sm_90", "backend": "mosaic", "dtype": "bfloat16",
                   "precision": "-", "bucket": [12, 12, 12], "ragged": false,
                   "config": {<Config field>: value, ...},
                   "note": "free text, e.g. measured TFLOP/s and date"}]}

   family: `device_family(device_kind)` ("sm_90" for H100/H200/H800/GH200, "sm_80" for
   A100-class, "sm_100" for B200-class). precision: `precision_class` ("ieee" for f32 with
   Precision.HIGHEST, "tf32" for other f32, "-" for 16-bit inputs). bucket:
   `shape_bucket(m, n, k)` = [ceil(log2 m), ceil(log2 n), ceil(log2 k)], i.e. a size in
   (2^(b-1), 2^b] lands in bucket b (4096 -> 12, 4097 -> 13). ragged: any of m, n, k not a
   multiple of 8 (the kernels then need masked edge tiles, which favours other tiles).
   Only an exact (family, backend, dtype, precision, bucket, ragged) match is used:
   no nearest-neighbour guessing, because a tile that wins at 4096^3 can lose badly at
   M=16. `validate_table()` lists the entries that do not build a valid Config.

3. None: the caller falls back to the backend's `default_config` heuristic.

Invalid entries (unknown fields, values failing the Config's validation, corrupted JSON)
are ignored with a `warnings.warn` (once per entry), never an exception: a stale cache
from an older version must not break a user's program.

The cache key ignores batch and transposes (lookup_config is called with m, n, k only):
tiles that win for one (M, N, K) problem win for its batched/transposed variants too,
closely enough for a cache.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import importlib
import itertools
import json
import math
import os
import pathlib
import statistics
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.core import precision as precisions
from pallas_gemm.testing import reference as _reference

CACHE_VERSION = 1
TABLE_PATH = pathlib.Path(__file__).with_name("tuned_configs.json")
ENV_VAR = "PALLAS_GEMM_CACHE"


# ----------------------------------------------------------------------------- keys


def precision_class(dtype, precision, backend: str | None = None) -> str:
  """"ieee" (f32, HIGHEST), "tf32" (f32, anything else) or "-" (16-bit: always exact products).

  The cuda backend computes IEEE fp32 whatever precision asks for: always "ieee".
  """
  if np.dtype(dtype) != np.float32:
    return "-"
  if backend == "cuda":
    return "ieee"
  split = precisions.split_of(precision, dtype)
  if split is not None:  # an FP32 emulation from bf16 pieces: its own tuning class
    return split.name
  if isinstance(precision, (tuple, list)):
    precision = precision[0] if precision else None
  if isinstance(precision, str):
    precision = jax.lax.Precision(precision)
  return "ieee" if precision == jax.lax.Precision.HIGHEST else "tf32"


def device_family(device_kind: str) -> str | None:
  """Maps a jax device_kind ("NVIDIA H100 80GB HBM3") to the shipped table's family key."""
  kind = device_kind.upper()
  if kind.startswith("SM_"):  # already a family (tests, tools)
    return kind.lower()
  for family, names in (("sm_90", ("H100", "H200", "H800", "GH200", "H20")),
                        ("sm_100", ("B200", "B100", "GB200")),
                        ("sm_80", ("A100", "A800", "A30"))):
    if any(name in kind for name in names):
      return family
  return None


def shape_bucket(m: int, n: int, k: int) -> list[int]:
  """[ceil(log2 m), ceil(log2 n), ceil(log2 k)]: sizes in (2^(b-1), 2^b] share bucket b."""
  return [max(0, math.ceil(math.log2(x))) for x in (m, n, k)]


def is_ragged(m: int, n: int, k: int) -> bool:
  return any(x % 8 for x in (m, n, k))


def _cache_key(device_kind, backend, dtype, precision, m, n, k) -> str:
  return "|".join(str(x) for x in (device_kind, backend, np.dtype(dtype).name,
                                    precision_class(dtype, precision, backend), m, n, k))


def cache_path() -> pathlib.Path:
  override = os.environ.get(ENV_VAR)
  if override:
    path = pathlib.Path(override).expanduser()
    return path / "autotune.json" if path.is_dir() or not path.suffix else path
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "pallas_gemm" / "autotune.json"


# ----------------------------------------------------------------------------- storage

# In-memory copies, loaded once per path: lookup_config runs at every trace, so it must
# not re-read files. `clear_memory_cache()` forgets them (tests use it as a "restart").
_cache_entries: dict[pathlib.Path, dict[str, Any]] = {}
_warned: set[str] = set()


def clear_memory_cache() -> None:
  _cache_entries.clear()
  _load_table_at.cache_clear()
  _warned.clear()


def _warn_once(key: str, message: str) -> None:
  if key not in _warned:
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _read_json(path: pathlib.Path, what: str) -> Any | None:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    _warn_once(f"file:{path}", f"pallas_gemm: ignoring unreadable {what} {path}: {e}")
    return None


def _cache_entries_of(data) -> dict | None:
  """The entries of a parsed cache file, or None when it is not a cache we can read."""
  if (isinstance(data, dict) and data.get("version") == CACHE_VERSION
      and isinstance(data.get("entries"), dict)):
    return data["entries"]
  return None


def _load_cache(path: pathlib.Path) -> dict[str, Any]:
  if path not in _cache_entries:
    data = _read_json(path, "autotune cache")
    entries = {} if data is None else _cache_entries_of(data)
    if entries is None:
      _warn_once(f"file:{path}", f"pallas_gemm: ignoring autotune cache {path} "
                 f"(not a version-{CACHE_VERSION} cache; delete it or re-run autotune)")
      entries = {}
    _cache_entries[path] = entries
  return _cache_entries[path]


def _store_cache_entry(key: str, entry: dict[str, Any]) -> pathlib.Path:
  """Merges one entry into the cache file (re-read first: another process may have written)."""
  path = cache_path()
  _cache_entries.pop(path, None)
  entries = dict(_load_cache(path))
  try:
    readable = _cache_entries_of(json.loads(path.read_text())) is not None
  except FileNotFoundError:
    readable = True
  except (OSError, ValueError):
    readable = False
  if not readable:  # corrupted or foreign: keep it aside for inspection, do not clobber it
    path.replace(path.with_suffix(path.suffix + ".bad"))
  entries[key] = entry
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
  tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1,
                            sort_keys=True))
  tmp.replace(path)  # atomic: a concurrent reader sees the old or the new file, never half
  _cache_entries[path] = entries
  return path


def _load_table() -> dict[tuple, dict]:
  return _load_table_at(TABLE_PATH)  # looked up at call time, so tests can point elsewhere


@functools.lru_cache(maxsize=None)
def _load_table_at(path: pathlib.Path) -> dict[tuple, dict]:
  data = _read_json(path, "tuned table")
  index = {}
  if data is None:
    return index
  if not (isinstance(data, dict) and data.get("version") == CACHE_VERSION
          and isinstance(data.get("entries"), list)):
    _warn_once(f"file:{path}", f"pallas_gemm: ignoring tuned table {path}: bad structure")
    return index
  for i, e in enumerate(data["entries"]):
    try:
      key = (e["family"], e["backend"], e["dtype"], e["precision"], tuple(e["bucket"]),
             bool(e["ragged"]))
      index[key] = dict(e["config"])
    except (KeyError, TypeError, ValueError) as err:
      _warn_once(f"table:{i}", f"pallas_gemm: ignoring tuned table entry #{i}: {err!r}")
  return index


def _build(config_cls, fields: dict, where: str):
  """config_cls(**fields), or None with a warning (a stale field set must never crash)."""
  try:
    return config_cls(**_decode(config_cls, fields))
  except (TypeError, ValueError, KeyError) as e:
    _warn_once(where, f"pallas_gemm: ignoring {where}: {config_cls.__qualname__}"
               f"(**{fields}) is invalid: {e}")
    return None


def _decode(config_cls, fields: dict) -> dict:
  """JSON has no tuples/enums: turn lists back into tuples, names back into enum members."""
  defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
  out = dict(fields)
  for name, value in out.items():
    if isinstance(value, list):
      out[name] = tuple(value)
    elif isinstance(defaults.get(name), enum.Enum) and isinstance(value, str):
      out[name] = type(defaults[name])[value]  # KeyError for an unknown name
  return out


def config_to_json(config) -> dict:
  """asdict with JSON-safe values (enums by name, tuples as lists)."""
  def enc(v):
    if isinstance(v, enum.Enum):
      return v.name
    if isinstance(v, (tuple, list)):
      return [enc(x) for x in v]
    if isinstance(v, (np.integer, np.floating)):
      return v.item()
    return v
  return {k: enc(v) for k, v in dataclasses.asdict(config).items()}


# ----------------------------------------------------------------------------- lookup


def _current_device_kind() -> str:
  return jax.devices()[0].device_kind


def lookup_config(backend_name: str, config_cls, m: int, n: int, k: int, dtype, precision,
                  device_kind: str | None = None):
  """The tuned Config for this problem, or None (then use the backend's default_config).

  Cache (exact shape) first, then the shipped table (device family + shape bucket).
  device_kind defaults to the first JAX device's kind.
  """
  device_kind = device_kind or _current_device_kind()
  dtype = np.dtype(dtype)
  key = _cache_key(device_kind, backend_name, dtype, precision, m, n, k)
  entry = _load_cache(cache_path()).get(key)
  if entry is not None:
    fields = entry.get("config") if isinstance(entry, dict) else None
    if isinstance(fields, dict):
      config = _build(config_cls, fields, f"autotune cache entry {key!r}")
      if config is not None:
        return config
    else:
      _warn_once(f"cache:{key}", f"pallas_gemm: ignoring malformed autotune cache entry {key!r}")
  family = device_family(device_kind)
  if family is None:
    return None
  tkey = (family, backend_name, dtype.name, precision_class(dtype, precision, backend_name),
          tuple(shape_bucket(m, n, k)), is_ragged(m, n, k))
  fields = _load_table().get(tkey)
  if fields is None:
    return None
  return _build(config_cls, fields, f"tuned table entry {tkey}")


def resolve_config(backend_name: str, m, n, k, dtype, precision, device_kind=None, *,
                   out_dtype=None, c_dtype=None):
  """What gemm(config=None) runs: lookup_config, else the backend's default_config.

  A tuned entry that does not fit this call's output/C dtypes (mosaic's epilogue buffers
  depend on them) is passed over for the heuristic, which adapts to them.
  """
  module = importlib.import_module(f"pallas_gemm.matmul.{backend_name}")
  dtype = np.dtype(dtype)
  tuned = lookup_config(backend_name, module.Config, m, n, k, dtype, precision, device_kind)
  fits = getattr(module, "check_fits", None)
  if tuned is not None and fits is not None:
    try:
      fits(tuned, dtype, np.dtype(out_dtype or dtype), c_dtype, k, precision)
    except ValueError:
      tuned = None
  if tuned is not None:
    return tuned
  return _default_config(module, m, n, k, dtype, precision, out_dtype, c_dtype)


def _default_config(module, m, n, k, dtype, precision, out_dtype=None, c_dtype=None):
  # Every backend's default_config takes the epilogue's dtypes and the precision (mosaic's
  # tiles depend on them; the others ignore them).
  return module.default_config(m, n, k, dtype, out_dtype=out_dtype, c_dtype=c_dtype,
                               precision=precision)


def validate_table(path: pathlib.Path | None = None) -> list[str]:
  """Problems with the shipped table (empty list when every entry builds its backend's Config)."""
  path = TABLE_PATH if path is None else pathlib.Path(path)
  data = json.loads(path.read_text())
  problems = []
  if data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), list):
    return [f"{path}: needs {{'version': {CACHE_VERSION}, 'entries': [...]}}"]
  required = {"family", "backend", "dtype", "precision", "bucket", "ragged", "config"}
  seen = set()
  for i, e in enumerate(data["entries"]):
    missing = required - set(e)
    if missing:
      problems.append(f"entry #{i}: missing {sorted(missing)}")
      continue
    key = (e["family"], e["backend"], e["dtype"], e["precision"], tuple(e["bucket"]), e["ragged"])
    if key in seen:
      problems.append(f"entry #{i}: duplicate key {key}")
    seen.add(key)
    if e["precision"] not in ("ieee", "tf32", "-") or len(e["bucket"]) != 3:
      problems.append(f"entry #{i}: bad precision/bucket {e['precision']!r} {e['bucket']!r}")
    try:
      cls = importlib.import_module(f"pallas_gemm.matmul.{e['backend']}").Config
      cls(**_decode(cls, e["config"]))
    except Exception as err:  # noqa: BLE001 - report every kind of failure, keep going
      problems.append(f"entry #{i} ({e['backend']}): {type(err).__name__}: {err}")
  return problems


# ----------------------------------------------------------------------------- numerics


def random_inputs(shape_a, shape_b, dtype, count: int, seed: int = 0):
  """`count` distinct (a, b) pairs, standard normal (never zeros: zeros make fast kernels lie)."""
  key = jax.random.key(seed)
  sets = []
  for _ in range(count):
    key, ka, kb = jax.random.split(key, 3)
    sets.append((jax.random.normal(ka, shape_a, jnp.float32).astype(dtype),
                 jax.random.normal(kb, shape_b, jnp.float32).astype(dtype)))
  return sets


def input_set_count(bytes_per_set: int, l2_bytes: int = 60 << 20, cap: int = 16) -> int:
  """Distinct input sets to cycle so that one pass over them overflows L2 (at least 2)."""
  return int(min(cap, max(2, math.ceil(2 * l2_bytes / max(bytes_per_set, 1)))))


# ----------------------------------------------------------------------------- GPU timing


def time_gpu_ms(fn, arg_sets, iterations: int, warmup: bool = True) -> list[float]:
  """Device time (ms) of `iterations` calls of fn, cycling through arg_sets, via CUPTI.

  One call may launch several kernels (pad, GEMM, epilogue): their times are summed,
  so the figure is what a user pays per call. `profiler.measure` itself would call fn
  with the same arguments every iteration (hot L2 for small problems), so this drives
  the same CUPTI hooks it uses, with rotating inputs.
  """
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # noqa: PLC0415 - GPU-only import
  ext = mosaic_gpu_lib._mosaic_gpu_ext
  if warmup:
    for args in arg_sets:  # compile + first-touch every set
      jax.block_until_ready(fn(*args))
  ext._cupti_init()
  try:
    outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(iterations)]
    jax.block_until_ready(outs)
  finally:
    timings = ext._cupti_get_timings(True)
  del outs
  if not timings or len(timings) % iterations:
    raise RuntimeError(f"CUPTI saw {len(timings or [])} kernels for {iterations} calls")
  per_call = len(timings) // iterations
  return [sum(t for _, t in timings[i * per_call:(i + 1) * per_call])
          for i in range(iterations)]


# ----------------------------------------------------------------------------- autotune

# A backend's candidate grid is its module's TUNING_GRID: per input width ("16bit", "f32",
# and "split" for float32 from 16-bit pieces), Config fields. A key that is a tuple of
# field names takes the listed value tuples together (tile shapes whose fields must
# agree); the grid is the cartesian product of the keys. Each backend's own validation
# filters it (ValueError/TypeError skips a candidate), so a grid may over-approximate.
# ~15-25 candidates each: one compile costs 1-4 s, so a grid autotunes in about a minute.


def default_candidates(backend: str, dtype, precision=None) -> list[dict]:
  """The candidate field dicts for (backend, dtype, precision); may include invalid ones
  (filtered later)."""
  grids = getattr(importlib.import_module(f"pallas_gemm.matmul.{backend}"), "TUNING_GRID", {})
  if precisions.split_of(precision, dtype) is not None and "split" in grids:
    grid = grids["split"]
  else:
    grid = grids.get("f32" if np.dtype(dtype) == np.float32 else "16bit", {})
  axes = [[dict(zip(key, v)) if isinstance(key, tuple) else {key: v} for v in values]
          for key, values in grid.items()]
  return [{k: v for part in combo for k, v in part.items()}
          for combo in itertools.product(*axes)]


def _build_candidates(module, candidates, m, n, k, dtype, precision=None) -> list:
  """Valid, de-duplicated Config objects; the heuristic default always competes (first)."""
  fields = {f.name for f in dataclasses.fields(module.Config)}
  # A backend may offer a resource check beyond Config validation (mosaic: shared memory,
  # the FP32 split); running it here skips a candidate without paying for a failed compile.
  check = getattr(module, "check_fits", None)
  out = [_default_config(module, m, n, k, dtype, precision)]
  seen = {repr(out[0])}
  for cand in candidates:
    if not isinstance(cand, dict):
      cand = config_to_json(cand)
    # Drop fields this backend's Config does not have, so one grid survives field renames
    # (the de-duplication below removes the resulting repeats).
    cand = {name: v for name, v in cand.items() if name in fields}
    try:
      cfg = module.Config(**_decode(module.Config, cand))
      if check is not None:
        check(cfg, dtype, dtype, k=k, precision=precision)
    except (TypeError, ValueError, KeyError):
      continue
    if repr(cfg) not in seen:
      seen.add(repr(cfg))
      out.append(cfg)
  return out


def _check_can_autotune():
  from jax._src import core  # noqa: PLC0415 - trace_state_clean has no public alias in 0.11
  if not core.trace_state_clean():
    raise RuntimeError(
        "pallas_gemm.autotune cannot run inside jax.jit/vmap/grad tracing (it times real "
        "kernel launches); call it once outside any transformation, then gemm() uses the "
        "cached config at trace time")
  if jax.default_backend() != "gpu":
    raise RuntimeError(
        f"pallas_gemm.autotune needs an NVIDIA GPU (JAX's default backend is "
        f"{jax.default_backend()!r}); timings on a CPU say nothing about GPU tiles")
  try:  # the CUPTI hooks come with jaxlib's Mosaic GPU bindings
    from jax._src.lib import mosaic_gpu  # noqa: F401, PLC0415
  except ImportError as e:
    raise RuntimeError(f"pallas_gemm.autotune times kernels with CUPTI, which needs "
                       f"jaxlib's Mosaic GPU bindings: {e}") from e


def autotune(m: int, n: int, k: int, dtype, *, backend: str, precision=None, batch: int = 1,
             transpose_a: bool = False, transpose_b: bool = False, candidates=None,
             iterations: int = 10, verbose: bool = False):
  """Times candidate configs on this GPU, stores the fastest correct one in the cache, returns it.

  candidates: Config objects or field dicts; default
    `default_candidates(backend, dtype, precision)`.
  The backend's `default_config` always competes, so the result is never slower than it
  (up to timing noise). A candidate that fails to compile or fails the correctness check
  is skipped. Raises RuntimeError on CPU, inside a trace, or when nothing valid remains.
  """
  _check_can_autotune()
  dtype = np.dtype(dtype)
  module = importlib.import_module(f"pallas_gemm.matmul.{backend}")
  reason = module.unavailable_reason() or module.supports(dtype, precision)
  if reason:
    raise RuntimeError(f"backend {backend!r} cannot run {dtype} here: {reason}")
  if candidates is None:
    candidates = default_candidates(backend, dtype, precision)
  configs = _build_candidates(module, candidates, m, n, k, dtype, precision)

  shape_a = (batch, k, m) if transpose_a else (batch, m, k)
  shape_b = (batch, n, k) if transpose_b else (batch, k, n)
  set_bytes = dtype.itemsize * batch * (m * k + k * n + m * n)
  arg_sets = random_inputs(shape_a, shape_b, dtype, input_set_count(set_bytes), seed=1)
  ref = _reference.reference(*arg_sets[0], transpose_a=transpose_a, transpose_b=transpose_b)
  tol = _reference.tolerance(dtype, precision, k)

  results = []  # (median ms, config)
  for cfg in configs:
    fn = jax.jit(functools.partial(
        module.gemm, c=None, alpha=1.0, beta=0.0, transpose_a=transpose_a,
        transpose_b=transpose_b, precision=precision, out_dtype=dtype, config=cfg,
        interpret=False))
    try:
      err = _reference.relative_error(fn(*arg_sets[0]), ref)
      if not err <= tol:  # also catches NaN
        if verbose:
          print(f"  {cfg}: wrong (rel err {err:.2e} > {tol:.0e}), skipped", flush=True)
        continue
      ms = statistics.median(time_gpu_ms(fn, arg_sets, iterations))
    except Exception as e:  # noqa: BLE001 - compile failures (SMEM overflow, ...) skip the candidate
      if verbose:
        print(f"  {cfg}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
      continue
    if verbose:
      print(f"  {cfg}: {ms:.4f} ms", flush=True)
    results.append((ms, cfg))
  if not results:
    raise RuntimeError(f"autotune({m}, {n}, {k}, {dtype}, backend={backend!r}): no candidate "
                       f"of {len(configs)} compiled and passed the correctness check")
  best_ms, best = min(results, key=lambda r: r[0])
  default_ms = results[0][0] if results[0][1] is configs[0] else None
  key = _cache_key(_current_device_kind(), backend, dtype, precision, m, n, k)
  _store_cache_entry(key, {
      "config": config_to_json(best), "ms": best_ms, "default_ms": default_ms,
      "candidates": len(configs), "jax": jax.__version__,
      "date": datetime.datetime.now().isoformat(timespec="seconds")})
  return best
