"""examples/fp8_mlp.py: the fp8 MLP's loss curves stay within LOSS_TOL of the bf16 curve."""

import importlib.util
import json
import pathlib
import sys

import pytest

pytest.importorskip("flax", reason="flax is the optional extra: pip install '.[flax]'")
pytest.importorskip("optax", reason="optax comes with flax")


def _example(name):
  path = pathlib.Path(__file__).parent.parent / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses (Flax modules) look their module up there
  spec.loader.exec_module(module)
  return module


def test_fp8_mlp_losses_agree(tmp_path):
  # main returns 1 when an fp8 loss curve leaves the band around the bf16 curve.
  example = _example("fp8_mlp")
  assert example.main(["--steps", "8", "--out", str(tmp_path)]) == 0
  results = json.loads((tmp_path / "losses.json").read_text())["results"]
  bf16, fp8 = results["bf16"]["losses"], results["fp8"]["losses"]
  assert fp8[-1] < 0.7 * fp8[0] and bf16 != fp8  # it trains, and in a different precision
