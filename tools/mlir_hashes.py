"""Hashes of the Mosaic GPU kernels' lowered MLIR over a fixed set of configs.

A refactoring of `pallas_gemm/matmul/mosaic/` that should not change the kernels keeps every hash:

  PYTHONPATH=. python tools/mlir_hashes.py --out before.json    # before the change
  PYTHONPATH=. python tools/mlir_hashes.py --compare before.json  # after: exit 1 on a change

Runs on a CPU: each case is lowered for CUDA (``lowering_platforms=("cuda",)``), the
Mosaic GPU module is read back from the custom call's bytecode and printed without
location info (file names and line numbers change whenever code moves), and the XLA
module around it is printed the same way with the kernel blob replaced by that text's
hash. ``--dump DIR`` writes each case's text, to diff a case whose hash changed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import sys

# The pair kernels run under shard_map over two devices: give the CPU two.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.interpreters import mlir as jax_mlir  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax.experimental.mosaic.gpu import dialect as mgpu_dialect  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

try:  # noqa: E402
  from pallas_gemm.matmul import mosaic
  from pallas_gemm.mgpu import hw as _sm_source
except ImportError:  # the layout before pallas_gemm/matmul and pallas_gemm/mgpu
  from pallas_gemm import mosaic
  from pallas_gemm import tuning as _sm_source

NUM_SMS = 132  # the H100 / H200's SM count, so that the CPU picks the target GPU's tiles
BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)


def _case(m, n, k, dtype=BF16, *, batch=1, batch_b=None, transpose_a=False,
          transpose_b=False, alpha=1.0, beta=0.0, c_dtype=None, out_dtype=None,
          precision=None, bias=False, activation=None, c_gate=None, keep_pre=False,
          **config):
  """A `mosaic.gemm` call: shapes, its keyword arguments and Config fields over the
  shape's default config (num_sms fixed to NUM_SMS)."""
  return dict(m=m, n=n, k=k, dtype=dtype, batch=batch, batch_b=batch_b or batch,
              transpose_a=transpose_a, transpose_b=transpose_b, alpha=alpha, beta=beta,
              c_dtype=c_dtype, out_dtype=out_dtype, precision=precision, bias=bias,
              activation=activation, c_gate=c_gate, keep_pre=keep_pre, config=config)


CASES = {
    "bf16_4096": _case(4096, 4096, 4096),
    "bf16_8192_stream_k": _case(8192, 8192, 8192),
    "bf16_4097_misaligned": _case(4097, 4097, 4097),
    "bf16_small": _case(64, 128, 256),
    "bf16_tiny": _case(1, 1, 1),
    "bf16_skinny": _case(16, 8192, 512, transpose_b=True, out_dtype=F32),
    "f32_tf32": _case(1024, 1024, 1024, F32),
    "f32_tf32_transposed": _case(640, 896, 2048, F32, transpose_a=True, transpose_b=True),
    "float32_accurate": _case(4096, 4096, 4096, F32, precision="float32_accurate"),
    "float32_accurate_transposed": _case(1000, 1000, 1000, F32, transpose_a=True,
                                         precision="float32_accurate"),
    "float32_f16x3": _case(4096, 4096, 4096, F32, precision="float32_f16x3"),
    "pingpong": _case(4096, 4096, 4096, block_m=128, block_n=128, pingpong=True,
                      wgmma_wait=1, cluster_n=1),
    "cluster_m": _case(1300, 1024, 4096, beta=1.0, block_m=128, block_n=128, cluster_m=2,
                       cluster_n=1, wgmma_wait=1),
    "wgmma_wait_1": _case(2048, 2048, 2048, wgmma_wait=1),
    "bias_gelu": _case(2048, 2048, 1024, bias=True, activation="gelu"),
    "bias_relu_f32_out": _case(1000, 1000, 1000, bias=True, activation="relu",
                               out_dtype=F32),
    "c_beta_alpha": _case(777, 1300, 4000, F16, batch=2, transpose_a=True, transpose_b=True,
                          alpha=0.5, beta=-2.0, out_dtype=F32),
    "c_other_dtype": _case(1024, 1024, 1024, beta=1.0, c_dtype=F32),
    "c_gate": _case(2048, 2048, 2048, beta=1.0, c_gate="gelu"),
    "keep_pre": _case(2048, 2048, 1024, bias=True, activation="silu", keep_pre=True),
    "batched": _case(500, 600, 4111, batch=3, batch_b=3),
    "batched_shared_b": _case(500, 600, 4111, batch=3, batch_b=1),
    "transposed_a": _case(2048, 1024, 512, transpose_a=True),
    "transposed_b": _case(2048, 1024, 512, transpose_b=True),
}


def _shapes(case):
  dtype, batch, m, n, k = case["dtype"], case["batch"], case["m"], case["n"], case["k"]
  a = (batch, k, m) if case["transpose_a"] else (batch, m, k)
  b = (case["batch_b"], n, k) if case["transpose_b"] else (case["batch_b"], k, n)
  args = [jax.ShapeDtypeStruct(a, dtype), jax.ShapeDtypeStruct(b, dtype)]
  needs_c = case["beta"] != 0.0 or case["c_gate"] is not None
  c_dtype = case["c_dtype"] or case["out_dtype"] or dtype
  args.append(jax.ShapeDtypeStruct((batch, m, n), c_dtype) if needs_c else None)
  args.append(jax.ShapeDtypeStruct((n,), F32) if case["bias"] else None)
  return args


def _lower_case(case):
  dtype = case["dtype"]
  out_dtype = np.dtype(case["out_dtype"] or dtype)
  needs_c = case["beta"] != 0.0 or case["c_gate"] is not None
  c_dtype = (case["c_dtype"] or out_dtype) if needs_c else None
  config = mosaic.default_config(case["m"], case["n"], case["k"], dtype, out_dtype=out_dtype,
                                 c_dtype=c_dtype, precision=case["precision"])
  config = config.replace(num_sms=NUM_SMS, **case["config"])

  def f(a, b, c, bias):
    return mosaic.gemm(a, b, c, alpha=case["alpha"], beta=case["beta"],
                       transpose_a=case["transpose_a"], transpose_b=case["transpose_b"],
                       precision=case["precision"], out_dtype=out_dtype, config=config,
                       interpret=False, bias=bias, activation=case["activation"],
                       c_gate=case["c_gate"], keep_pre=case["keep_pre"])

  return jax.jit(f).trace(*_shapes(case)).lower(lowering_platforms=("cuda",))


def _lower_pair(gather):
  """`mosaic.pair_gemm` under shard_map over two (CPU) devices, K split."""
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  m, n, k = 1024, 1024, 2048

  @jax.shard_map(mesh=mesh, in_specs=(P(None, None, "x"), P(None, "x", None), P()),
                 out_specs=P() if gather else P(None, "x"), check_vma=False)
  def f(a, b, bias):
    return mosaic.pair_gemm(a, b, axis="x", gather=gather, alpha=1.0, transpose_a=False,
                            transpose_b=False, out_dtype=BF16, num_sms=NUM_SMS, bias=bias,
                            activation="gelu")

  on = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
  args = (jax.ShapeDtypeStruct((1, m, k), BF16, sharding=on(P(None, None, "x"))),
          jax.ShapeDtypeStruct((1, k, n), BF16, sharding=on(P(None, "x", None))),
          jax.ShapeDtypeStruct((n,), F32, sharding=on(P())))
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def _attr(*paths):
  """The first of `module:attr` paths that imports: the family kernels' entry points by
  their names in this or an earlier layout, so one hash file compares the two."""
  import importlib  # noqa: PLC0415
  for path in paths:
    module, _, attr = path.partition(":")
    try:
      return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
      continue
  raise ImportError(f"none of {paths}")


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _lower_fn(fn, *args):
  def f(*a):
    with jax.enable_x64(False):
      return fn(*a)
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def _family_lowerings():
  """The grouped and fp8 kernels, called at their kernel-level entry points."""
  fwd = _attr("pallas_gemm.grouped.mosaic_forward:forward")
  wgrad = _attr("pallas_gemm.grouped.mosaic_weight_grad:weight_grad")
  scaled = _attr("pallas_gemm.fp8.mosaic_gemm:scaled_gemm", "pallas_gemm.fp8." + "mosaic:scaled_gemm")
  ragged = _attr("pallas_gemm.fp8.mosaic_ragged:ragged_gemm",
                 "pallas_gemm.fp8." + "ragged_mosaic:ragged_gemm")
  quant = _attr("pallas_gemm.fp8.mosaic_quantize:quantize_rows",
                "pallas_gemm.fp8." + "quantize_mosaic:quantize_rows")
  e4m3, i32 = jnp.float8_e4m3fn, jnp.int32
  return {
      "grouped_forward": lambda: _lower_fn(
          fwd, _sds((1000, 512), BF16), _sds((8, 512, 384), BF16), _sds((8,), i32)),
      "grouped_forward_t": lambda: _lower_fn(
          lambda a, b, g: fwd(a, b, g, transpose_rhs=True, out_dtype=F32),
          _sds((1000, 512), BF16), _sds((8, 384, 512), BF16), _sds((8,), i32)),
      "grouped_forward_offset": lambda: _lower_fn(
          lambda a, b, g, o: fwd(a, b, g, o), _sds((1000, 512), BF16),
          _sds((4, 512, 384), BF16), _sds((8,), i32), _sds((1,), i32)),
      "grouped_gated": lambda: _lower_fn(
          lambda a, b, g: _attr("pallas_gemm.grouped.mosaic_forward:gated_forward")(
              a, b, g, activation="silu"),
          _sds((1000, 512), BF16), _sds((8, 512, 384), BF16), _sds((8,), i32)),
      "grouped_gated_h": lambda: _lower_fn(
          lambda a, b, g: _attr("pallas_gemm.grouped.mosaic_forward:gated_forward")(
              a, b, g, activation="gelu", write_h=True),
          _sds((1000, 512), BF16), _sds((8, 512, 384), BF16), _sds((8,), i32)),
      "grouped_weight_grad": lambda: _lower_fn(
          wgrad, _sds((1000, 512), BF16), _sds((1000, 384), BF16), _sds((8,), i32)),
      "fp8_blocks": lambda: _lower_fn(
          scaled, _sds((1, 512, 1024), e4m3), _sds((1, 384, 1024), e4m3),
          _sds((1, 512, 8), F32), _sds((1, 3, 8), F32)),
      "fp8_per_tensor_f32": lambda: _lower_fn(
          lambda a, b, sa, sb: scaled(a, b, sa, sb, out_dtype=F32),
          _sds((1, 1000, 1024), e4m3), _sds((1, 520, 1024), e4m3),
          _sds((1, 1, 1), F32), _sds((1, 1, 1), F32)),
      "fp8_ragged": lambda: _lower_fn(
          ragged, _sds((1000, 1024), e4m3), _sds((8, 384, 1024), e4m3), _sds((8,), i32),
          _sds((1000, 8), F32), _sds((8, 3, 8), F32)),
      "quantize_rows": lambda: _lower_fn(
          lambda x: quant(x, jnp.float8_e4m3fn, num_sms=NUM_SMS), _sds((1024, 1024), BF16)),
  }


def _texts(lowered) -> tuple[str, list[str]]:
  """(the XLA module, each Mosaic GPU kernel module), printed without locations."""
  module = lowered.compiler_ir("stablehlo")
  kernels = []
  ctx = jax_mlir.make_ir_context()
  mgpu_dialect.register_dialect(ctx)  # its types appear in memrefs (barriers)
  ctx.allow_unregistered_dialects = True

  def visit(op):
    op = op.operation
    if op.name == "stablehlo.custom_call" and "mosaic_gpu" in str(op.attributes["call_target_name"]):
      config = op.attributes["mhlo.backend_config"]
      blob = ir.StringAttr(config["module"]).value_bytes
      kernel = ir.Module.parse(blob, context=ctx)
      text = kernel.operation.get_asm(enable_debug_info=False)
      # The dump name counts the kernels lowered so far in this process.
      kernels.append(re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "", text))
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          visit(inner)

  visit(module.operation)
  outer = module.operation.get_asm(enable_debug_info=False)
  outer = re.sub(r'kernel_hash = "(?:[^"\\]|\\.)*"', 'kernel_hash = "-"', outer)
  outer = re.sub(r'module = "(?:[^"\\]|\\.)*"', 'module = "-"', outer)
  return outer, kernels


def _sha(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def hashes(dump: pathlib.Path | None = None) -> dict[str, dict]:
  lowerings = {name: (lambda case=case: _lower_case(case)) for name, case in CASES.items()}
  lowerings["pair_send_finish"] = lambda: _lower_pair(gather=False)
  lowerings["pair_gather"] = lambda: _lower_pair(gather=True)
  lowerings.update(_family_lowerings())
  result = {}
  for name, lower in lowerings.items():
    try:
      outer, kernels = _texts(lower())
    except Exception as e:  # noqa: BLE001 - a case that cannot lower is recorded as such
      result[name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
      print(f"{name}: {result[name]['error']}", file=sys.stderr)
      continue
    result[name] = {"xla": _sha(outer), "kernels": [_sha(t) for t in kernels]}
    if dump is not None:
      dump.mkdir(parents=True, exist_ok=True)
      (dump / f"{name}.xla.mlir").write_text(outer)
      for i, text in enumerate(kernels):
        (dump / f"{name}.kernel{i}.mlir").write_text(text)
    print(f"{name}: {result[name]}", file=sys.stderr)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, help="write the hashes (JSON) here")
  parser.add_argument("--compare", type=pathlib.Path, help="compare with these hashes")
  parser.add_argument("--dump", type=pathlib.Path, help="write each case's MLIR here")
  args = parser.parse_args()
  _sm_source.num_sms = lambda: NUM_SMS  # the SM count the CPU lacks (default configs, stream-K)
  # The fp8 kernels refuse a CPU without interpret mode; lowering for CUDA is what this
  # tool does, so their grid takes the target GPU's SM count instead.
  launch = _attr("pallas_gemm.mgpu:launch", "pallas_gemm." + "mosaic:launch")
  grid_sms = launch.grid_sms
  launch.grid_sms = lambda num_sms, interpret, need_gpu=False: grid_sms(num_sms, interpret)
  result = hashes(args.dump)
  if args.out:
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
  if args.compare:
    before = json.loads(args.compare.read_text())
    changed = sorted(name for name in before.keys() | result.keys()
                     if before.get(name) != result.get(name))
    for name in changed:
      print(f"changed: {name}: {before.get(name)} -> {result.get(name)}")
    gone = sorted(before.keys() - result.keys())
    print(f"{len(result) - len(set(changed) - set(gone))} of {len(result)} cases unchanged"
          + (f"; cases no longer run: {', '.join(gone)}" if gone else ""))
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
  main()
