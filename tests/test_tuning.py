"""The autotune cache, the shipped tuned table, autotune's refusals, and the benchmark CLI.

All CPU: nothing here times a kernel. The cache is pointed at tmp_path through
PALLAS_GEMM_CACHE so a developer's real cache is never read or written.
"""

import dataclasses
import importlib
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_gemm.matmul import tuning
from pallas_gemm.matmul.auto import BACKENDS

DEVICE = "NVIDIA H100 80GB HBM3"
F32, BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True, kw_only=True)
class FakeConfig:
  """A stand-in backend Config with the contract's shape: frozen, kw_only, validated."""
  block_m: int = 128
  block_n: int = 128
  layout: tuple = (1, 2)

  def __post_init__(self):
    if self.block_m % 16:
      raise ValueError(f"Config.block_m must be a multiple of 16, got {self.block_m}")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
  monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path / "cache.json"))
  tuning.clear_memory_cache()
  yield tmp_path / "cache.json"
  tuning.clear_memory_cache()


def _store(config, m=4096, n=4096, k=4096, dtype=BF16, precision=None, backend="fake"):
  key = tuning._cache_key(DEVICE, backend, dtype, precision, m, n, k)
  return tuning._store_cache_entry(key, {"config": tuning.config_to_json(config), "ms": 1.0})


def _lookup(m=4096, n=4096, k=4096, dtype=BF16, precision=None, device=DEVICE, cls=FakeConfig):
  return tuning.lookup_config("fake", cls, m, n, k, dtype, precision, device)


# ----------------------------------------------------------------------------- cache


def test_cache_round_trip_survives_restart(isolated_cache):
  config = FakeConfig(block_m=64, block_n=256, layout=(3, 4))
  path = _store(config)
  assert path == isolated_cache and path.exists()
  tuning.clear_memory_cache()  # a new process: nothing in memory, only the file
  assert _lookup() == config  # tuples survive the JSON round trip
  # The key is exact: another shape, dtype, precision class or device misses.
  assert _lookup(m=4097) is None
  assert _lookup(dtype=F32) is None
  assert _lookup(device="NVIDIA H200") is None


def test_precision_class_is_part_of_the_key():
  _store(FakeConfig(block_m=32), dtype=F32, precision=HIGHEST)
  assert _lookup(dtype=F32, precision=HIGHEST) == FakeConfig(block_m=32)
  assert _lookup(dtype=F32, precision=None) is None  # TF32 entry is a different problem
  assert tuning.precision_class(F32, "highest") == "ieee"
  assert tuning.precision_class(F32, jax.lax.Precision.DEFAULT) == "tf32"
  assert tuning.precision_class(BF16, HIGHEST) == "-"
  assert tuning.precision_class(F32, None, "cuda") == "ieee"  # cuda is IEEE fp32 always


def test_env_var_override(tmp_path, monkeypatch):
  monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path / "elsewhere" / "mine.json"))
  assert tuning.cache_path() == tmp_path / "elsewhere" / "mine.json"
  _store(FakeConfig(block_m=48))
  assert (tmp_path / "elsewhere" / "mine.json").exists()
  monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path / "dir"))  # a directory: autotune.json in it
  assert tuning.cache_path() == tmp_path / "dir" / "autotune.json"
  assert _lookup() is None  # a different cache file knows nothing of the first
  monkeypatch.delenv(tuning.ENV_VAR)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert tuning.cache_path() == tmp_path / "xdg" / "pallas_gemm" / "autotune.json"


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]),
                                     json.dumps({"version": 99, "entries": {}})])
def test_corrupted_cache_file_is_ignored_with_warning(isolated_cache, content):
  isolated_cache.write_text(content)
  with pytest.warns(RuntimeWarning, match="ignoring"):
    assert _lookup() is None
  # Writing afterwards works, and keeps the unreadable file aside instead of clobbering it.
  _store(FakeConfig(block_m=64))
  tuning.clear_memory_cache()
  assert _lookup() == FakeConfig(block_m=64)
  assert isolated_cache.with_suffix(".json.bad").read_text() == content


@pytest.mark.parametrize("fields", [{"block_m": 64, "warp_count": 4},  # field renamed away
                                    {"block_m": 50},                    # fails validation
                                    "not a dict"])
def test_stale_cache_entry_is_ignored_with_warning(isolated_cache, fields):
  key = tuning._cache_key(DEVICE, "fake", BF16, None, 4096, 4096, 4096)
  isolated_cache.write_text(json.dumps(
      {"version": 1, "entries": {key: {"config": fields} if fields != "not a dict" else fields}}))
  with pytest.warns(RuntimeWarning, match="ignoring"):
    assert _lookup() is None
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # warned once per entry, not at every trace
    assert _lookup() is None


# ----------------------------------------------------------------------------- shipped table


def test_shipped_table_parses_and_validates():
  data = json.loads(tuning.TABLE_PATH.read_text())
  assert data["version"] == tuning.CACHE_VERSION and isinstance(data["entries"], list)
  assert tuning.validate_table() == []
  for entry in data["entries"]:
    module = importlib.import_module(f"pallas_gemm.matmul.{entry['backend']}")
    assert isinstance(module.Config(**tuning._decode(module.Config, entry["config"])),
                      module.Config)


def test_table_lookup_by_family_and_bucket(tmp_path, monkeypatch):
  table = tmp_path / "table.json"
  table.write_text(json.dumps({"version": 1, "entries": [
      {"family": "sm_90", "backend": "fake", "dtype": "bfloat16", "precision": "-",
       "bucket": [12, 12, 12], "ragged": False, "config": {"block_m": 256}},
      {"family": "sm_90", "backend": "fake", "dtype": "bfloat16", "precision": "-",
       "bucket": [13, 13, 13], "ragged": True, "config": {"block_m": 7}}]}))  # invalid
  monkeypatch.setattr(tuning, "TABLE_PATH", table)
  assert _lookup(3000, 4096, 2056) == FakeConfig(block_m=256)  # all in (2048, 4096], mult. of 8
  assert _lookup(device="NVIDIA H200") == FakeConfig(block_m=256)   # same family
  assert _lookup(device="NVIDIA A100-SXM4-80GB") is None            # other family
  assert _lookup(4096, 4096, 4100) is None                          # other bucket
  with pytest.warns(RuntimeWarning, match="ignoring"):
    assert _lookup(4097, 4097, 4097) is None                        # invalid entry
  # The user's cache beats the shipped table.
  _store(FakeConfig(block_m=32))
  assert _lookup() == FakeConfig(block_m=32)
  assert tuning.validate_table(table)  # the invalid entry is reported


def test_buckets():
  assert tuning.shape_bucket(4096, 4097, 1) == [12, 13, 0]
  assert tuning.shape_bucket(1000, 1024, 1025) == [10, 10, 11]
  assert not tuning.is_ragged(4096, 1000, 64) and tuning.is_ragged(4096, 4097, 64)
  assert tuning.device_family("NVIDIA H100 80GB HBM3") == "sm_90"
  assert tuning.device_family("NVIDIA H200") == "sm_90"
  assert tuning.device_family("cpu") is None


def test_default_candidates_validate_against_backend_configs():
  """Every default grid yields candidates its backend accepts (else the grid is stale)."""
  for backend in BACKENDS:
    try:
      module = importlib.import_module(f"pallas_gemm.matmul.{backend}")
    except ImportError:
      continue  # backend not built here
    for width in getattr(module, "TUNING_GRID", {}):
      dtype = BF16 if width == "16bit" else F32
      precision = "float32_accurate" if width == "split" else None
      configs = tuning._build_candidates(
          module, tuning.default_candidates(backend, dtype, precision), 4096, 4096, 4096,
          dtype, precision)
      assert len(configs) > 1, (backend, width)  # more than just the default survives


def test_split_candidates_and_tuned_entries_fit_the_split(monkeypatch):
  """float32 from bf16 pieces: the default split config competes, every candidate fits
  the pieces' ring and two accumulators, and a cached config that does not (e.g. tuned
  for an earlier kernel) falls back to the default instead of failing the call."""
  from pallas_gemm.matmul import mosaic  # noqa: PLC0415
  fa = "float32_accurate"
  split = tuning.precisions.split_of(fa, F32)
  configs = tuning._build_candidates(
      mosaic, tuning.default_candidates("mosaic", F32, fa), 4096, 4096, 4096, F32, fa)
  assert configs[0] == mosaic.default_config(4096, 4096, 4096, F32, precision=fa)
  assert len(configs) > 4
  for cfg in configs:
    mosaic.check_split(cfg, split)
    mosaic.check_smem_budget(cfg, F32, F32, None, 4096, split)
  stale = mosaic.default_config(4096, 4096, 4096, F32, precision=fa).replace(
      block_m=64, block_n=256, wg_split="n", cluster_n=1, stages=3)  # 64x256: two accumulators too large
  with pytest.raises(ValueError):
    mosaic.check_fits(stale, F32, F32, None, 4096, fa)
  monkeypatch.setattr(tuning, "lookup_config", lambda *args, **kwargs: stale)
  assert tuning.resolve_config("mosaic", 4096, 4096, 4096, F32, fa) == configs[0]


# ----------------------------------------------------------------------------- autotune


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU refusal")
def test_autotune_refuses_on_cpu():
  with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
    tuning.autotune(256, 256, 256, BF16, backend="triton")


def test_autotune_refuses_inside_jit():
  @jax.jit
  def f(x):
    tuning.autotune(256, 256, 256, BF16, backend="triton")
    return x

  with pytest.raises(RuntimeError, match="inside jax.jit"):
    f(1.0)
  with pytest.raises(RuntimeError, match="inside jax.jit"):
    jax.vmap(lambda x: tuning.autotune(256, 256, 256, BF16, backend="triton") or x)(
        jnp.ones(2))


# ----------------------------------------------------------------------------- benchmarks


def test_benchmark_shapes_are_well_formed():
  from benchmarks import shapes
  for table in (shapes.FULL, shapes.MEDIUM, shapes.SMALL):
    pairs = shapes.plan(table)
    assert pairs and all(s.flops == 2 * s.batch * s.m * s.n * s.k for s, _ in pairs)
  assert shapes.parse_dtypes("f32,bf16") == ["f32-highest", "f32-default", "bf16"]
  custom = shapes.plan(shapes.FULL, "8x64x32x16", ["bf16"])
  assert [(s.batch, s.m, s.n, s.k, d.name) for s, d in custom] == [(8, 64, 32, 16, "bf16")]
  with pytest.raises(ValueError, match="unknown shape"):
    shapes.plan(shapes.FULL, "nonsense")


def test_benchmark_main_writes_json_and_markdown(tmp_path, capsys):
  from benchmarks.__main__ import main
  rc = main(["--shapes", "16x32x8,2x8x16x24", "--dtypes", "f32-highest,bf16",
             "--backends", "xla", "--iterations", "2", "--out", str(tmp_path)])
  assert rc == 0
  data = json.loads((tmp_path / "results.json").read_text())
  assert data["meta"]["jax"] == jax.__version__ and data["meta"]["timer"]
  rows = data["rows"]
  assert {r["backend"] for r in rows} == {"jnp.dot", "xla"} and len(rows) == 8
  for r in rows:
    assert r["status"] == "ok" and r["correct"] is True and r["median_ms"] > 0
    assert r["ratio_vs_dot"] is not None and r["tflops"] > 0
  md = (tmp_path / "results.md").read_text()
  assert "| xla |" in md and "Summary" in md
  assert capsys.readouterr().out.rstrip().endswith(md.rstrip().splitlines()[-1])  # table last
