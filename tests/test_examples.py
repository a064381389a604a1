"""examples/: the Flax MLP trains with stock layers, dot_general and fused layers to the same losses."""

import importlib.util
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


def test_flax_mlp_losses_agree(tmp_path):
  # main returns 1 when a loss curve leaves the tolerance of the stock model's.
  assert _example("flax_mlp").main(["--steps", "5", "--out", str(tmp_path)]) == 0
  assert (tmp_path / "losses.json").exists()
