"""examples/: each example trains its model through pallas_gemm to the losses of its reference.

flax_mlp: stock layers, dot_general and fused layers reach the same losses. moe: the MoE block
trains to the same losses with jax.lax.ragged_dot, pallas_gemm.ragged_dot and moe_mlp (in fp8
within the fp8 band), and its expert-parallel form (shard_map over 8 CPU devices,
group_offset and all-to-all) computes the one-device block's loss and gradients.
moe_transformer: a small MoE transformer (attention and the Flax MoEBlock) trains to the same
losses on moe_mlp and on the ragged_dot block. fp8_mlp: the fp8 MLP's loss curves stay within
the band of the bf16 curve, its losses fetched every step or once a round of steps."""

import importlib.util
import json
import pathlib
import sys

import jax
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


def test_moe_transformer_losses_agree(tmp_path):
  assert _example("moe_transformer").main(["--steps", "4", "--out", str(tmp_path)]) == 0
  assert (tmp_path / "moe_transformer.json").exists()


def test_moe_losses_agree(tmp_path):
  # main returns 1 when the loss curves leave their band (LOSS_ATOL, LOSS_RTOL; the fp8
  # form's LOSS_ATOL_FP8, LOSS_RTOL_FP8 around moe_mlp's).
  assert _example("moe").main(["--steps", "3", "--out", str(tmp_path)]) == 0
  results = json.loads((tmp_path / "losses.json").read_text())["results"]
  bf16, fp8 = results["moe_mlp"]["losses"], results["moe_mlp_fp8"]["losses"]
  assert fp8[-1] < fp8[0] and bf16 != fp8  # it trains, and in a different precision


@pytest.mark.parametrize("impl", ["pallas_gemm", "lax", "moe_mlp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_expert_parallel_matches_one_device(dtype, impl):
  """16 experts over 8 devices (two local experts each, offsets 0, 2, ..., 14); lax's
  variant takes the local experts' counts, pallas_gemm's the global ones and group_offset;
  moe_mlp's is the library's own (expert_axis)."""
  if len(jax.devices()) < 2:
    pytest.skip(f"needs >= 2 devices; this process has {len(jax.devices())}")
  moe = _example("moe")
  cfg = dict(moe.SMALL, experts=16, tokens=128, dtype=dtype)
  assert moe.expert_parallel_check(cfg, impl=impl) <= moe.LOSS_RTOL[dtype]


def test_expert_parallel_timing_runs(tmp_path):
  """--expert-parallel checks and times the four steps and records them."""
  if len(jax.devices()) < 2:
    pytest.skip(f"needs >= 2 devices; this process has {len(jax.devices())}")
  moe = _example("moe")
  assert moe.main(["--steps", "2", "--expert-parallel", "--out", str(tmp_path)]) == 0
  timing = json.loads((tmp_path / "losses.json").read_text())["results"]["expert_parallel_step_ms"]
  assert set(timing) == {"one device, pallas_gemm", "expert parallel, pallas_gemm",
                         "expert parallel, moe_mlp", "expert parallel, lax"}
  assert all(ms > 0 for ms in timing.values())


@pytest.mark.parametrize("log_every", [1, 3])
def test_fp8_mlp_losses_agree(tmp_path, log_every):
  # main returns 1 when an fp8 loss curve leaves the band around the bf16 curve; a loss
  # per step whether the host fetches them every step or every few (the last round short).
  example = _example("fp8_mlp")
  assert example.main(["--steps", "8", "--log-every", str(log_every),
                       "--out", str(tmp_path)]) == 0
  results = json.loads((tmp_path / "losses.json").read_text())["results"]
  assert all(len(r["losses"]) == 9 and r["step_ms"] > 0 for r in results.values())
  bf16, fp8 = results["bf16"]["losses"], results["fp8"]["losses"]
  assert fp8[-1] < 0.7 * fp8[0] and bf16 != fp8  # it trains, and in a different precision
