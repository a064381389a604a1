"""The benchmark command line on a CPU: the headline sweep, --mlp's training steps, the
round-robin timing and its ratio statistics (tiny shapes; the GPU runs the same code), the
modes --help lists and where a run's results go."""

import datetime
import json
import pathlib
import re
import shutil
import subprocess

import jax
import pytest

from benchmarks import report, timing
from benchmarks.__main__ import _delegate, main


def test_ratio_stats_verdicts():
  faster = timing.ratio_stats([2.0, 2.2, 1.8, 2.0], [1.0, 1.1, 0.9, 1.0])
  assert faster.median == pytest.approx(2.0) and faster.spread == pytest.approx(0.0)
  assert faster.verdict == "faster" and faster.rounds == 4
  # Ratios 0.95..1.07 around a median of 1.005: the spread covers the difference.
  tie = timing.ratio_stats([1.0] * 5, [1 / 0.95, 1 / 0.99, 1 / 1.005, 1 / 1.02, 1 / 1.07])
  assert tie.low == pytest.approx(0.95) and tie.high == pytest.approx(1.07)
  assert tie.p25 == pytest.approx(0.99) and tie.p75 == pytest.approx(1.02)
  assert tie.verdict == "parity"
  assert timing.ratio_stats([1.0, 1.0], [1.1, 1.1]).verdict == "slower"


class _RecordingTimer:
  name = "recording"

  def __init__(self):
    self.order = []

  def sample(self, fn, arg_sets, calls):
    self.order.append(fn(*arg_sets[0]))
    return [float(len(self.order))] * calls


def test_rounds_rotate_the_order():
  timer = _RecordingTimer()
  fns = {name: (lambda x, name=name: name) for name in "abc"}
  per_round = timing.rounds_ms(timer, fns, [(0,)], rounds=3, calls=2)
  assert timer.order == list("abc" "bca" "cab")  # every function in every slot once
  assert all(len(v) == 3 for v in per_round.values())
  assert per_round["a"] == [1.0, 6.0, 8.0]  # each round's median, in round order


def test_headline_on_cpu(tmp_path):
  assert main(["--headline", "--rounds", "2", "--iterations", "2", "--out", str(tmp_path)]) == 0
  data = json.loads((tmp_path / "headline.json").read_text())
  rows = data["rows"]
  cases = {r["case"] for r in rows}
  assert any("float32_accurate" in c for c in cases) and any("dense" in c for c in cases)
  assert any("misaligned" in c for c in cases) and any("HIGHEST" in c for c in cases)
  candidates = [r for r in rows if not r["baseline"]]
  assert len(candidates) == len(cases) and len(rows) == 2 * len(cases)
  for r in candidates:
    assert r["status"] == "ok" and r["correct"], r
    assert r["low"] <= r["p25"] <= r["ratio"] <= r["p75"] <= r["high"]
    assert r["verdict"] in ("faster", "slower", "parity") and len(r["round_ms"]) == 2
  assert all("rel_err_wide" in r for r in rows if "f32" in r["case"] or "float32" in r["case"])
  text = (tmp_path / "headline.md").read_text()
  assert "| case |" in text
  # the last table: a key result for each family, from the benchmarks run beside
  for family in ("dense (`gemm`)", "grouped (`ragged_dot`)", "fp8 (`scaled_matmul`)",
                 "MoE layer (`moe_mlp`)"):
    line = next(x for x in text.splitlines() if x.startswith(f"| {family} |"))
    assert "no result" not in line and "x**" in line, line
  assert {"ragged.json", "fp8.json", "moe.json"} <= {
      f.name for f in (tmp_path / "families").iterdir()}


def test_mlp_steps_on_cpu(tmp_path):
  pytest.importorskip("optax", reason="the adamw step needs optax (the flax extra)")
  assert main(["--mlp", "--kinds", "grad,sgd,adamw", "--rounds", "2", "--steps", "1",
               "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "mlp.json").read_text())["rows"]
  steps = [r for r in rows if r["bench"] == "mlp step"]
  assert {(r["dtype"], r["kind"]) for r in steps} == {
      (d, k) for d in ("bf16", "f32-highest") for k in ("grad", "sgd", "adamw")}
  assert {r["variant"] for r in steps} == {
      "stock (XLA)", "stock again (A/A)", "pallas_gemm.mlp", "dot_general"}
  for r in steps:
    assert r["ok"] and r["ms"] > 0 and len(r["round_ms"]) == 2, r
    if r["variant"] == "stock (XLA)":
      assert r["ratio"] == 1.0 and r["loss_rel_diff"] == 0.0
    if r["kind"] == "grad":  # the gradients were compared with stock's
      assert r["update_rel_diff"] is not None and r["update_rel_diff"] <= r["bound"]
  assert any(r["bench"].startswith("alpha/beta") for r in rows)
  assert "stock again (A/A)" in (tmp_path / "mlp.md").read_text()


def test_fp8_ragged_on_cpu(tmp_path):
  # A GPU runs the small decode problem (a CPU its own tiny one), 2 rounds of 2 calls.
  assert main(["--fp8-ragged", "--problems", "decode", "--rounds", "2", "--calls", "2",
               "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "fp8_ragged.json").read_text())["rows"]
  assert [r["impl"] for r in rows] == ["bf16 pallas ragged_dot", "bf16 lax.ragged_dot",
                                       "fp8 scaled_ragged_dot", "q(x) + fp8 scaled_ragged_dot"]
  for r in rows:  # bf16 output: its rounding, ~1e-3
    assert r["ms"] > 0 and len(r["round_ms"]) == 2 and r["relerr_bf16_out"] < 1e-2, r


def test_missing_benchmark_module_exits_2(capsys):
  assert _delegate("--nope", "no_such_benchmark", ["--nope"]) == 2
  assert "benchmarks/no_such_benchmark.py" in capsys.readouterr().err


def test_help_lists_every_mode(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  for flag in ("--quick", "--headline", "--full", "--gpu-default", "--autotune", "--list",
               "--out", "--record", "--sharded", "--mlp", "--precision", "--ragged", "--fp8",
               "--fp8-ragged", "--moe"):
    # The flag, its metavar if any, then a line of help.
    assert re.search(rf"^  {re.escape(flag)}( [A-Z_]+)? +\S", text, re.MULTILINE), flag


def test_results_folder_is_date_and_device():
  day = datetime.date(2026, 11, 25)
  assert report.results_dir(device_kind="NVIDIA H100 80GB HBM3", day=day) == (
      report.SCRATCH_DIR / "2026-11-25-h100")
  assert report.results_dir(record=True, device_kind="NVIDIA H200", day=day) == (
      report.RECORDS_DIR / "2026-11-25-h200")
  assert report.device_name("cpu") == "cpu"
  assert report.device_name("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
  assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+", report.results_dir().name)


def test_a_plain_run_leaves_the_work_tree_clean():
  # A plain run writes under SCRATCH_DIR; the dated records beside it stay tracked.
  root = pathlib.Path(__file__).resolve().parents[1]
  if shutil.which("git") is None or not (root / ".git").exists():
    pytest.skip("not a git checkout")
  def ignored(path):  # git check-ignore: 0 ignored, 1 not ignored
    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=root,
                          check=False).returncode == 0

  assert ignored(report.results_dir() / "results.json")
  assert not ignored(report.results_dir(record=True, device_kind="NVIDIA H200") / "results.json")


def test_moe_benchmark_writes_its_table(tmp_path):
  from benchmarks import moe  # noqa: PLC0415
  args = ["--configs", "qwen3", "--modes", "fwd,fwd+bwd", "--variants",
          "moe_mlp,moe_mlp/fp8,moe_mlp/fp8-train,moe_mlp/fp8-train-cached,dense", "--kernels",
          "--out", str(tmp_path)]
  assert moe.main(args) == 0
  results = json.loads((tmp_path / "moe.json").read_text())["results"]
  # --kernels: each variant that ran has its kernels by name on a GPU (CUPTI), none elsewhere
  on_gpu = jax.devices()[0].platform == "gpu"
  assert all(("kernels" in v) == on_gpu for row in results for v in row["variants"].values()
             if v["status"] == "ok")
  assert [r["mode"] for r in results] == ["fwd", "fwd+bwd"]
  assert {v: row["status"] for v, row in results[0]["variants"].items()} == {
      "moe_mlp": "ok", "moe_mlp/fp8": "ok", "moe_mlp/fp8-train": "ok",
      "moe_mlp/fp8-train-cached": "ok", "dense": "ok"}
  assert results[1]["variants"]["moe_mlp/fp8"] == dict(status="failed", reason="inference only")
  assert results[1]["variants"]["moe_mlp/fp8-train"]["status"] == "ok"
  assert results[1]["variants"]["moe_mlp/fp8-train-cached"]["status"] == "ok"


def test_expert_parallel_counts_leave_out_missing_devices(capsys):
  from benchmarks import moe_parallel  # noqa: PLC0415
  many = 2 * len(jax.devices())
  assert moe_parallel._counts(f"1,{many}") == [1]
  assert f"left out: [{many}] devices" in capsys.readouterr().out


@pytest.mark.skipif(len(jax.devices()) < 2, reason="expert parallelism needs 2 devices")
def test_expert_parallel_benchmark_writes_its_table(tmp_path):
  from benchmarks import moe  # noqa: PLC0415
  args = ["--expert-parallel", "--configs", "mixtral", "--devices", "1,2", "--scaling", "weak",
          "--variants", "moe_mlp,moe_mlp/padded,moe_mlp/cb,infer,infer/fp8,infer/fp8/all-slots",
          "--rounds", "1", "--out", str(tmp_path)]
  assert moe.main(args) == 0
  results = json.loads((tmp_path / "moe_parallel.json").read_text())["results"]
  assert [(r["devices"], sorted(r["variants"])) for r in results] == [
      (1, ["infer", "infer/fp8", "moe_mlp"]),   # one device: no branch to modify
      (2, ["infer", "infer/fp8", "infer/fp8/all-slots", "moe_mlp", "moe_mlp/cb",
           "moe_mlp/padded"])]
  two = results[1]["variants"]
  assert all(v["status"] == "ok" and v["vs_one_device"] > 0 for v in two.values())
  assert "moe_mlp_speedup" in two["moe_mlp/padded"] and "moe_mlp_speedup" in two["moe_mlp/cb"]
  assert "moe_mlp_speedup" in two["infer/fp8/all-slots"]  # against infer/fp8
  assert "fp8_speedup" in two["infer/fp8"] and "moe_mlp_speedup" not in two["infer"]


def test_moe_decode_rounds_span_their_roofline():
  # A decode round runs DECODE_ROUND_MS of its roofline in calls (10 to 400): ~200 calls of
  # a 0.25 ms layer, 11 of a 4.6 ms one; 40 where no roofline is known (no GPU kind).
  from benchmarks import moe  # noqa: PLC0415
  assert moe.decode_calls(0.2516) == 199
  assert moe.decode_calls(4.61) == 11
  assert moe.decode_calls(100.0) == 10 and moe.decode_calls(0.01) == 400
  assert moe.decode_calls(None) == 40
