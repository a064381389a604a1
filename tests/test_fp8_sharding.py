"""The fp8 kernels' partitioning (pallas_gemm/fp8/partition.py, core/sharding.partitioned)
on 8 CPU devices: each layout's result equals the unsharded call, and the compiled program
gathers no operand (a split contraction adds one all-reduce). The Mosaic kernels run
interpreted on a CPU, which cannot be partitioned, so the shards here run the XLA path of
the same op (`backend="xla"`, the same numbers); the kernels' own lowering for CUDA is
checked to take the partitioned path."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_gemm
from pallas_gemm.fp8 import partition
from pallas_gemm.testing import reference

from conftest import random

E4M3 = jnp.float8_e4m3fn


def _mesh(kind=jax.sharding.AxisType.Auto):
  if len(jax.devices()) < 8:
    pytest.skip(f"needs 8 devices; this process has {len(jax.devices())}")
  return jax.make_mesh((2, 4), ("x", "y"), axis_types=(kind,) * 2, devices=jax.devices()[:8])


def _same_sums(got, want, k):
  """got, a float32 result of the partitioned call, against the unsharded one: the same
  products summed in another order (XLA picks its loop per shard shape), within the
  tolerance table's float32 bound over a contraction of k."""
  err = reference.relative_error(np.asarray(got), np.asarray(want))
  assert err <= reference.tolerance(jnp.float32, jax.lax.Precision.HIGHEST, k), err


def _xla_gemm(lhs, rhs, ls, rs, out_dtype):
  return pallas_gemm.scaled_matmul(lhs, rhs, ls, rs, out_dtype, backend="xla")


def _operands(rng, b, m, n, k, rhs_blocks):
  lhs8, ls = pallas_gemm.quantize(jnp.asarray(random(rng, (b, m, k), np.float32)), E4M3,
                                  block_shape=(1, 128), backend="xla")
  rhs8, rs = pallas_gemm.quantize(jnp.asarray(random(rng, (b, n, k), np.float32)), E4M3,
                                  block_shape=(128, 128) if rhs_blocks else None,
                                  backend="xla")
  return lhs8, rhs8, ls, rs


GATHER = re.compile(r" all-gather(-start)?\(")
REDUCE = re.compile(r" all-reduce(-start)?\(")


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rhs_blocks", [True, False])
@pytest.mark.parametrize("layout, split", [
    ("m", dict(lhs=P(None, "y"), ls=P(None, "y"))),
    ("n", dict(rhs=P(None, "x"), rs=P(None, "x"))),
    ("b", dict(lhs=P("x"), rhs=P("x"), ls=P("x"), rs=P("x"))),
    ("k", dict(lhs=P(None, None, "x"), rhs=P(None, None, "x"), ls=P(None, None, "x"))),
    ("m+n", dict(lhs=P(None, "y"), rhs=P(None, "x"))),
])
def test_scaled_gemm_shards(rng, layout, split, rhs_blocks, out_dtype):
  mesh = _mesh()
  args = _operands(rng, 2, 64, 256, 512, rhs_blocks)
  names = ("lhs", "rhs", "ls", "rs")
  if not rhs_blocks:  # per-tensor rhs scales: (B, 1, 1), never split
    split = {key: v for key, v in split.items() if key != "rs"}
  placed = [jax.device_put(a, NamedSharding(mesh, split.get(name, P())))
            for name, a in zip(names, args)]
  f = jax.jit(lambda *a: partition.gemm(_xla_gemm, *a, out_dtype, interpret=False))
  got = f(*placed)
  want = _xla_gemm(*args, out_dtype)
  assert got.dtype == want.dtype and got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=1e-5 if out_dtype == jnp.float32 else 1e-2, atol=1e-4)
  hlo = f.lower(*placed).compile().as_text()
  assert not GATHER.search(hlo), layout
  assert bool(REDUCE.search(hlo)) == (layout == "k"), layout
  if layout == "m":
    assert got.sharding.spec[1] == "y"


def test_splits_that_do_not_divide_are_not_made(rng):
  # N = 192 over 4 devices with 128-row weight blocks: 48 rows each would cut a block,
  # so N stays whole (gathered, as XLA would) and the result is still right.
  mesh = _mesh()
  args = _operands(rng, 1, 16, 192, 256, True)
  placed = [jax.device_put(a, NamedSharding(mesh, P(None, "y") if i == 1 else P()))
            for i, a in enumerate(args)]
  got = jax.jit(lambda *a: partition.gemm(_xla_gemm, *a, jnp.float32, interpret=False))(*placed)
  _same_sums(got, _xla_gemm(*args, jnp.float32), args[0].shape[-1])


@pytest.mark.parametrize("n, k", [(128, 512), (256, 128), (128, 128)])
def test_one_block_dims(rng, n, k):
  # N or K of exactly one 128-block: their scale dims have one entry (no compound factor
  # for Shardy), and the call still shards M.
  mesh = _mesh()
  args = _operands(rng, 1, 64, n, k, True)
  placed = [jax.device_put(a, NamedSharding(mesh, P(None, "y") if i in (0, 2) else P()))
            for i, a in enumerate(args)]
  f = jax.jit(lambda *a: partition.gemm(_xla_gemm, *a, jnp.float32, interpret=False))
  _same_sums(f(*placed), _xla_gemm(*args, jnp.float32), args[0].shape[-1])
  assert not GATHER.search(f.lower(*placed).compile().as_text())
  sizes = jnp.asarray([10, 54], jnp.int32)
  two = lambda a: jnp.concatenate([a, a])  # noqa: E731 - two groups of one weight
  rag = [args[0][0], two(args[1]), sizes, args[2][0], two(args[3])]
  placed = [jax.device_put(a, NamedSharding(mesh, P("y") if i in (0, 3) else P()))
            for i, a in enumerate(rag)]
  g = jax.jit(lambda *a: partition.ragged_gemm(_xla_ragged, *a, jnp.float32, interpret=False))
  _same_sums(g(*placed), _xla_ragged(*rag, jnp.float32), rag[0].shape[-1])
  x = jax.device_put(jnp.asarray(random(rng, (64, k), np.float32)), NamedSharding(mesh, P("y")))
  quantize = functools.partial(partition.quantize_rows, _xla_quantize, interpret=False)
  values, scales = jax.jit(quantize)(x)
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(_xla_quantize(x)[1]))


def test_per_tensor_scales_split_with_any_rows(rng):
  # A per-tensor scale (B, 1, 1) of an operand of <= 128 rows is not a 128-row block
  # scale: M = 64 still splits 4 ways, with no gather.
  mesh = _mesh()
  lhs8, ls = pallas_gemm.quantize(jnp.asarray(random(rng, (2, 64, 512), np.float32)), E4M3,
                                  block_shape=None, backend="xla")
  rhs8, rs = _operands(rng, 2, 64, 256, 512, True)[1::2]
  args = (lhs8, rhs8, ls, rs)
  placed = [jax.device_put(a, NamedSharding(mesh, P(None, "y") if i == 0 else P()))
            for i, a in enumerate(args)]
  f = jax.jit(lambda *a: partition.gemm(_xla_gemm, *a, jnp.float32, interpret=False))
  _same_sums(f(*placed), _xla_gemm(*args, jnp.float32), args[0].shape[-1])
  assert not GATHER.search(f.lower(*placed).compile().as_text())


def _xla_ragged(lhs, rhs, sizes, ls, rs, out_dtype):
  return pallas_gemm.scaled_ragged_dot(lhs, rhs, sizes, ls, rs, out_dtype, backend="xla")


@pytest.mark.parametrize("layout, split", [
    ("m", dict(lhs=P("y"), ls=P("y"))),
    ("n", dict(rhs=P(None, "x"), rs=P(None, "x"))),
    ("k", dict(lhs=P(None, "x"), rhs=P(None, None, "x"), ls=P(None, "x"))),
    ("m+n", dict(lhs=P("y"), rhs=P(None, "x"))),
    ("g: gathered", dict(rhs=P("x"), rs=P("x"))),
])
def test_scaled_ragged_gemm_shards(rng, layout, split):
  # 96 rows over 4 devices (24 each) in groups of 5, 0, 40, 30 with 21 rows past the last
  # group: groups straddle the devices' rows, one is empty, the last device's tail is
  # in no group.
  mesh = _mesh()
  m, n, k = 96, 256, 512
  lhs8, ls = pallas_gemm.quantize(jnp.asarray(random(rng, (m, k), np.float32)), E4M3,
                                  block_shape=(1, 128), backend="xla")
  rhs8, rs = pallas_gemm.quantize(jnp.asarray(random(rng, (4, n, k), np.float32)), E4M3,
                                  block_shape=(128, 128), backend="xla")
  sizes = jnp.asarray([5, 0, 40, 30], jnp.int32)
  args = dict(lhs=lhs8, rhs=rhs8, sizes=sizes, ls=ls, rs=rs)
  placed = [jax.device_put(a, NamedSharding(mesh, split.get(name, P())))
            for name, a in args.items()]
  f = jax.jit(lambda *a: partition.ragged_gemm(_xla_ragged, *a, jnp.float32, interpret=False))
  got = f(*placed)
  want = _xla_ragged(*args.values(), jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  assert not np.asarray(got)[75:].any()
  hlo = f.lower(*placed).compile().as_text()
  assert bool(GATHER.search(hlo)) == (layout == "g: gathered"), layout
  assert bool(REDUCE.search(hlo)) == (layout == "k"), layout


def _xla_gated(lhs, rhs, sizes, ls, rs):
  return pallas_gemm.fp8.gated_quantized(lhs, rhs, sizes, ls, rs, "silu", backend="xla")


@pytest.mark.parametrize("layout, split", [
    ("m", dict(lhs=P("y"), ls=P("y"))),
    ("m over both axes", dict(lhs=P(("x", "y")), ls=P(("x", "y")))),
    ("g, k: gathered", dict(lhs=P(None, "x"), rhs=P("x", None, "y"), ls=P(None, "x"))),
])
def test_gated_quantized_shards(rng, layout, split):
  # The fp8 gated kernel's partitioning (`partition.gated_gemm`): rows split with no
  # communication, groups straddling the devices' rows (as above); the groups and K
  # stay whole (a's 1x128 scales need every column of a row's block, and split groups
  # would leave fp8 rows that no all-reduce adds).
  mesh = _mesh()
  m, f, k = 96, 128, 256
  lhs8, ls = pallas_gemm.quantize(jnp.asarray(random(rng, (m, k), np.float32)), E4M3,
                                  block_shape=(1, 128), backend="xla")
  rhs8, rs = pallas_gemm.quantize(jnp.asarray(random(rng, (4, 2 * f, k), np.float32)), E4M3,
                                  block_shape=(128, 128), backend="xla")
  sizes = jnp.asarray([5, 0, 40, 30], jnp.int32)
  args = dict(lhs=lhs8, rhs=rhs8, sizes=sizes, ls=ls, rs=rs)
  placed = [jax.device_put(a, NamedSharding(mesh, split.get(name, P())))
            for name, a in args.items()]
  f_ = jax.jit(lambda *a: partition.gated_gemm(_xla_gated, *a, out_dtype=E4M3,
                                               interpret=False))
  values, scales = f_(*placed)
  want_values, want_scales = _xla_gated(*args.values())
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
  np.testing.assert_array_equal(np.asarray(values, np.float32),
                                np.asarray(want_values, np.float32))
  assert not np.asarray(values, np.float32)[75:].any()
  hlo = f_.lower(*placed).compile().as_text()
  assert not REDUCE.search(hlo), layout
  assert bool(GATHER.search(hlo)) == layout.endswith("gathered"), layout


def _xla_quantize(x):
  return pallas_gemm.quantize(x, E4M3, block_shape=(1, 128), backend="xla")


def _quantize_sharded(x, spec, local=_xla_quantize, block_rows=1):
  """(the jitted partitioned call, x placed by spec, its values and scales), checked equal
  to the unsharded call's, bit for bit."""
  placed = jax.device_put(x, NamedSharding(_mesh(), spec))
  f = jax.jit(functools.partial(partition.quantize_rows, local, block_rows=block_rows,
                                interpret=False))
  values, scales = f(placed)
  want_values, want_scales = local(x)
  np.testing.assert_array_equal(np.asarray(values, np.float32),
                                np.asarray(want_values, np.float32))
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
  return f, placed, values, scales


@pytest.mark.parametrize("spec", [P("y"), P(None, "x"), P("y", "x")])
def test_quantize_rows_shards(rng, spec):
  # K = 1024: 8 column blocks, which the 2 x 4 mesh's axes divide in either order.
  x = jnp.asarray(random(rng, (64, 1024), np.float32)).astype(jnp.bfloat16)
  f, placed, values, _ = _quantize_sharded(x, spec)
  hlo = f.lower(placed).compile().as_text()
  assert not GATHER.search(hlo) and not REDUCE.search(hlo)
  assert values.sharding.is_equivalent_to(placed.sharding, 2)


@pytest.mark.parametrize("rows, split", [(1024, True), (256, False)])
def test_quantize_weight_blocks_shard(rng, rows, split):
  # 128x128 blocks: R splits 4 ways only in whole blocks (1024 rows: 8 blocks, which the
  # mesh's axes divide in either order; no gather); 256 rows would cut them (64 each),
  # so the call takes R whole (x gathered) and still compiles.
  x = jnp.asarray(random(rng, (rows, 1024), np.float32)).astype(jnp.bfloat16)
  local = lambda x: pallas_gemm.quantize(x, E4M3, block_shape=(128, 128), backend="xla")  # noqa: E731
  f, placed, _, scales = _quantize_sharded(x, P("y", "x"), local, block_rows=128)
  assert scales.shape == (rows // 128, 8)
  assert bool(GATHER.search(f.lower(placed).compile().as_text())) != split


@pytest.mark.parametrize("shape, spec", [
    ((2, 1024, 512), P(None, "x", "y")),   # x (B, K, R): K and R split
    ((4, 256, 1024), P("y", None, "x")),   # B and R split
])
def test_transposing_quantize_shards(rng, shape, spec):
  # The transposed read splits with its blocks: no gather, no reduction, the unsharded
  # call's numbers.
  x = jnp.asarray(random(rng, shape, np.float32)).astype(jnp.bfloat16)
  local = lambda x: pallas_gemm.quantize(x, E4M3, transpose=True, backend="xla")  # noqa: E731
  placed = jax.device_put(x, NamedSharding(_mesh(), spec))
  f = jax.jit(functools.partial(partition.quantize_rows, local, layout="transposed",
                                interpret=False))
  got = f(placed)
  for a, b in zip(got, local(x), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  hlo = f.lower(placed).compile().as_text()
  assert not GATHER.search(hlo) and not REDUCE.search(hlo)


def test_transposing_quantize_keeps_whole_tiles(rng):
  # The kernel reads x's last dim (the quantized operand's rows) in whole 128-wide tiles:
  # 256 of them split 4 ways would leave 64 per device, so they stay whole (gathered),
  # and each shard the partitioned call runs sees a multiple of 128.
  x = jnp.asarray(random(rng, (1, 256, 256), np.float32)).astype(jnp.bfloat16)
  seen = []

  def local(x):
    seen.append(x.shape[-1])
    return pallas_gemm.quantize(x, E4M3, transpose=True, backend="xla")

  placed = jax.device_put(x, NamedSharding(_mesh(), P(None, None, ("x", "y"))))
  f = jax.jit(functools.partial(partition.quantize_rows, local, layout="transposed",
                                interpret=False))
  got = f(placed)
  np.testing.assert_array_equal(np.asarray(got[0], np.float32),
                                np.asarray(local(x)[0], np.float32))
  assert all(r % 128 == 0 for r in seen), seen
  assert GATHER.search(f.lower(placed).compile().as_text())


@pytest.mark.parametrize("k, spec", [(256, P(None, "y")), (512, P(None, ("x", "y"))),
                                     (512, P(None, ("y", "x")))])
def test_scale_blocks_an_axis_would_cut(rng, k, spec):
  # Column blocks that the axes splitting K do not divide in turn: 2 blocks over 4
  # devices, or 4 blocks over 2 then 4. The call compiles (no axis cut into sub-axes)
  # and gives the unsharded numbers.
  _quantize_sharded(jnp.asarray(random(rng, (64, k), np.float32)).astype(jnp.bfloat16), spec)


def test_kernels_lower_partitioned_for_the_gpu(as_on_a_gpu):
  # On a GPU, scaled_matmul and quantize run their Mosaic kernels through the partitioned
  # call: lowered here for CUDA as the GPU would, under jit with sharded operands.
  mesh = _mesh()
  rows = NamedSharding(mesh, P("y"))

  def f(x, w):
    x8, xs = pallas_gemm.quantize(x, E4M3, block_shape=(1, 128), backend="mosaic")
    w8, ws = pallas_gemm.quantize(w, E4M3, block_shape=(128, 128), backend="mosaic")
    out = pallas_gemm.scaled_matmul(x8, w8, xs, ws, jnp.bfloat16, backend="mosaic")
    grouped = pallas_gemm.scaled_ragged_dot(x8, w8[None], jnp.asarray([100], jnp.int32),
                                            xs, ws[None], jnp.bfloat16, backend="mosaic")
    return out, grouped

  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=rows)
  w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  # The kernels' own modules are lowered per shard when XLA partitions (compiling, on
  # the GPU); here each call is one partitioned custom call, the quantizes and the GEMMs.
  assert text.count("CustomSPMDPartitioning") == 4
  # Under vmap the kernels run unpartitioned (custom_partitioning has no batching rule),
  # also where vmap batches an inner jit, checkpoint or scan that holds the calls.
  batched = [jax.ShapeDtypeStruct((3, *a.shape), a.dtype) for a in (x, w)]
  scan = lambda x, w: jax.lax.scan(lambda c, _: (c, f(x, w)), 0, None, length=2)[1]  # noqa: E731
  for g in (f, jax.jit(f), jax.checkpoint(f), scan):
    text = jax.jit(jax.vmap(g)).trace(*batched).lower(lowering_platforms=("cuda",)).as_text()
    assert "CustomSPMDPartitioning" not in text
    for name in ("pallas_gemm_scaled_fp8", "pallas_gemm_scaled_ragged_fp8"):
      assert name in text, name


def test_explicit_mesh_axes_take_the_xla_path(rng, monkeypatch):
  # Under Explicit mesh axes sharding is part of the type and the Pallas kernels cannot
  # be traced on sharded Refs: "auto" takes the XLA path (GPU or not), "mosaic" asked
  # for by name is a ValueError that says so.
  from pallas_gemm.mgpu import hw  # noqa: PLC0415
  monkeypatch.setattr(hw, "on_gpu", lambda: True)
  mesh = _mesh(jax.sharding.AxisType.Explicit)
  x = jnp.asarray(random(rng, (64, 256), np.float32)).astype(jnp.bfloat16)
  w = jnp.asarray(random(rng, (128, 256), np.float32)).astype(jnp.bfloat16)
  x = jax.device_put(x, NamedSharding(mesh, P("y")))
  w8, ws = pallas_gemm.quantize(w, E4M3, block_shape=(128, 128), backend="xla")
  with jax.set_mesh(mesh):
    for call in (lambda: pallas_gemm.quantize(x, E4M3, backend="mosaic"),
                 lambda: pallas_gemm.scaled_matmul(
                     *pallas_gemm.quantize(x, E4M3, backend="xla")[:1], w8,
                     pallas_gemm.quantize(x, E4M3, backend="xla")[1], ws, backend="mosaic"),
                 lambda: pallas_gemm.scaled_ragged_dot(
                     *pallas_gemm.quantize(x, E4M3, backend="xla")[:1], w8[None],
                     jnp.asarray([64], jnp.int32), pallas_gemm.quantize(x, E4M3)[1],
                     ws[None], backend="mosaic")):
      with pytest.raises(ValueError, match="sharded over Explicit mesh axes"):
        call()
    x8, xs = jax.jit(lambda x: pallas_gemm.quantize(x, E4M3))(x)
    got = jax.jit(lambda a, s: pallas_gemm.scaled_matmul(a, w8, s, ws))(x8, xs)
  want_x8, want_xs = pallas_gemm.quantize(jnp.asarray(x), E4M3, backend="xla")
  np.testing.assert_array_equal(np.asarray(xs), np.asarray(want_xs))
  want = pallas_gemm.scaled_matmul(want_x8, w8, want_xs, ws, backend="xla")
  _same_sums(got, want, x.shape[-1])


def test_mosaic_kernels_per_shard_on_gpus(rng):
  # On 2+ GPUs: quantize (1x128 and 128x128 blocks), scaled_matmul and scaled_ragged_dot
  # with their rows split over the GPUs (256 each: whole 128-row blocks) run the Mosaic
  # kernels on each shard; the result equals the unsharded call (the same kernels on the
  # whole rows) and the program gathers nothing.
  if jax.default_backend() != "gpu" or len(jax.devices()) < 2:
    pytest.skip(f"needs 2+ GPUs; this process has {len(jax.devices())}"
                f" {jax.default_backend()} devices")
  n = min(4, len(jax.devices()))
  mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:n])
  rows, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
  m, k, groups = 256 * n, 512, 4
  x = jnp.asarray(random(rng, (m, k), np.float32)).astype(jnp.bfloat16)
  w = jnp.asarray(random(rng, (groups, 384, k), np.float32)).astype(jnp.bfloat16)
  sizes = jnp.asarray([m // 2, 0, m // 4 - 3, 7], jnp.int32)  # 3m/4 + 4 rows in groups

  def f(x, w, sizes):
    x8, xs = pallas_gemm.quantize(x, E4M3, block_shape=(1, 128), backend="mosaic")
    w8, ws = pallas_gemm.quantize(w, E4M3, block_shape=(128, 128), backend="xla")
    out = pallas_gemm.scaled_matmul(x8, w8[0], xs, ws[0], jnp.float32, backend="mosaic")
    grouped = pallas_gemm.scaled_ragged_dot(x8, w8, sizes, xs, ws, jnp.float32,
                                            backend="mosaic")
    blocks8, block_scales = pallas_gemm.quantize(x, E4M3, block_shape=(128, 128),
                                                 backend="mosaic")
    return x8, xs, out, grouped, blocks8, block_scales

  placed = (jax.device_put(x, rows), jax.device_put(w, whole), jax.device_put(sizes, whole))
  sharded = jax.jit(f)
  got = sharded(*placed)
  want = jax.jit(f)(*(jax.device_put(a, jax.devices()[0]) for a in (x, w, sizes)))
  names = ("values", "scales", "scaled_matmul", "scaled_ragged_dot", "128x128 values",
           "128x128 scales")
  for name, g, h in zip(names, got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(h, np.float32),
                               rtol=1e-6, atol=0, err_msg=name)
  assert got[2].sharding.spec[0] == "d" and got[3].sharding.spec[0] == "d"
  assert not np.asarray(got[3])[3 * m // 4 + 4:].any()  # rows of no group are zeros
  assert not GATHER.search(sharded.lower(*placed).compile().as_text())


@pytest.mark.parametrize("block_shape", [(1, 128), (128, 128)])
@pytest.mark.parametrize("spec", [P("x"), P("x", "y"), P(None, "y", "x")])
def test_batched_quantize_under_explicit_axes(rng, block_shape, spec):
  # A (B, M, K) x split over Explicit axes, as expert weights split over their experts
  # are (`quantize_experts`): the XLA path's block reshapes keep each dimension's split,
  # and the numbers are the unsharded call's.
  mesh = _mesh(jax.sharding.AxisType.Explicit)
  x = jnp.asarray(random(rng, (4, 1024, 1024), np.float32)).astype(jnp.bfloat16)
  placed = jax.device_put(x, NamedSharding(mesh, spec))
  values, scales = jax.jit(lambda x: pallas_gemm.quantize(x, E4M3, block_shape=block_shape))(
      placed)
  want_values, want_scales = pallas_gemm.quantize(x, E4M3, block_shape=block_shape,
                                                  backend="xla")
  np.testing.assert_array_equal(np.asarray(values, np.float32),
                                np.asarray(want_values, np.float32))
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
  assert tuple(jax.typeof(values).sharding.spec) == tuple(spec) + (None,) * (3 - len(spec))


@pytest.mark.parametrize("lhs_spec, rhs_spec", [(P("y"), P()), (P(), P("x")), (P("y"), P("x"))])
def test_scaled_ragged_dot_under_explicit_axes(rng, lhs_spec, rhs_spec):
  # lax infers no sharding for ragged_dot under Explicit axes; the XLA path names its
  # result's (whole on every device, as ragged_dot's), with the unsharded call's numbers.
  mesh = _mesh(jax.sharding.AxisType.Explicit)
  x = jnp.asarray(random(rng, (256, 256), np.float32)).astype(jnp.bfloat16)
  w = jnp.asarray(random(rng, (4, 128, 256), np.float32)).astype(jnp.bfloat16)
  sizes = jnp.asarray([100, 50, 0, 97], jnp.int32)

  def f(x, w):
    x8, xs = pallas_gemm.quantize(x, E4M3)
    w8, ws = pallas_gemm.quantize(w, E4M3, block_shape=(128, 128))
    return pallas_gemm.scaled_ragged_dot(x8, w8, sizes, xs, ws, jnp.float32)

  got = jax.jit(f)(jax.device_put(x, NamedSharding(mesh, lhs_spec)),
                   jax.device_put(w, NamedSharding(mesh, rhs_spec)))
  assert tuple(jax.typeof(got).sharding.spec) in ((), (None, None))
  _same_sums(got, f(x, w), x.shape[1])


@pytest.mark.parametrize("in_context", [False, True])
@pytest.mark.parametrize("spec", [P("y"), P(None, "y")])
def test_fp8_dot_general_gradients_under_explicit_axes(rng, spec, in_context):
  # x split on its rows or on K (K = 256: two 1x128 blocks, which 4 devices do not
  # divide: that split is not kept), with the mesh in context (jax.set_mesh) or only in
  # the types: the step runs, x's gradient comes back typed as x, the numbers are the
  # unsharded call's.
  mesh = _mesh(jax.sharding.AxisType.Explicit)
  x = jnp.asarray(random(rng, (256, 256), np.float32)).astype(jnp.bfloat16)
  w = jnp.asarray(random(rng, (256, 384), np.float32)).astype(jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))
  loss = lambda x, w: jnp.sum(pallas_gemm.fp8_dot_general(x, w, dims).astype(jnp.float32))  # noqa: E731
  grads = jax.grad(loss, argnums=(0, 1))
  placed = (jax.device_put(x, NamedSharding(mesh, spec)),
            jax.device_put(w, NamedSharding(mesh, P())))
  if in_context:
    with jax.set_mesh(mesh):
      got = jax.jit(grads)(*placed)
  else:
    got = jax.jit(grads)(*placed)
  assert jax.typeof(got[0]).sharding.spec == jax.typeof(placed[0]).sharding.spec
  for g, want in zip(got, grads(x, w)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))
