"""gemm under jax.jit with shardings: the partitioning rules of `pallas_gemm/matmul/op.py`.

On a CPU, conftest gives the process 8 host devices (XLA_FLAGS), so these run in CI: the
Triton kernel in interpret mode goes through the same custom_partitioning rule as every
GPU kernel (the rule does not depend on the backend; only the local call does). The cuda
and mosaic GPU kernels cannot compile here: for them the test checks that the lowering for
CUDA carries the partitioning custom call and its Shardy rule. Mosaic GPU's interpreter
is not partitioned (ordered io_callbacks; see `op.partitioned`): a test pins that it
stays correct. On a machine with >= 2 GPUs the same tests run the real kernels.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import ON_GPU, random, skip_reason
from pallas_gemm.matmul import cuda, op
from pallas_gemm import gemm
from pallas_gemm.testing.reference import gated_gradient, reference, relative_error, tolerance

HIGHEST = jax.lax.Precision.HIGHEST
# Where a cross-device operand movement would show in compiled HLO.
GATHERS = re.compile(r"\b(all-gather|all-to-all|collective-permute)(-start)?\(")
REDUCES = re.compile(r"\b(all-reduce|reduce-scatter)(-start)?\(")


def _gathered_operands(hlo: str) -> list[str]:
  """The cross-device movements in compiled HLO beyond one all-gather per reduce-scatter.
  A split K with a 16-bit result is summed by a reduce-scatter of the f32 partials, then
  its finished rows are all-gathered (`op._plan_sharding`'s gather): that all-gather moves
  the result. Any other one moves an operand. (A count, so a program with both an operand
  gather and a result gather would pass: the forward tests above check strictly.)"""
  found = [x.group(0) for x in GATHERS.finditer(hlo)]
  scatters = len(re.findall(r"\breduce-scatter(-start)?\(", hlo))
  return found if len(found) > scatters else []

# name: (a spec, b spec, a batch, b batch, the mesh axis K is split over). Axes x and y.
LAYOUTS = {
    "M": (P("x", None), P(), (), (), None),
    "N": (P(), P(None, "x"), (), (), None),
    "MN": (P("x", None), P(None, "y"), (), (), None),
    "batch": (P("x"), P("x"), (4,), (4,), None),
    "batch-shared-b": (P("x"), P(), (4,), (), None),
    "K": (P(None, "x"), P("x", None), (), (), "x"),
    "MK": (P("x", "y"), P("y", None), (), (), "y"),
}

# The custom call each GPU kernel lowers to.
KERNEL_CALL = {"cuda": "pallas_gemm_", "mosaic": "mosaic_gpu"}


def _mesh():
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip(f"needs >= 2 devices; this process has {len(devices)}")
  shape = (2, len(devices) // 2) if len(devices) >= 4 else (len(devices), 1)
  return jax.make_mesh(shape, ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=devices[: shape[0] * shape[1]])


def _partitioned_backend():
  """The backend whose partitioned kernel runs here: mosaic on a GPU, triton on a CPU."""
  name, dtype = ("mosaic", jnp.bfloat16) if ON_GPU else ("triton", np.float32)
  reason = skip_reason(name, dtype)
  if reason:
    pytest.skip(reason)
  return name, dtype


def _hlo(f, *args) -> str:
  return jax.jit(f).lower(*args).compile().as_text()


def _put(x, mesh, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_call_runs_locally(layout, rng):
  """No operand is gathered, the output is sharded like jnp.dot's, K-sharded sums once."""
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  spec_a, spec_b, batch_a, batch_b, k_axis = LAYOUTS[layout]
  reductions = int(k_axis is not None and mesh.shape[k_axis] > 1)  # y has size 1 on 2 devices
  m, n, k = 16, 24, 32
  a = _put(random(rng, batch_a + (m, k), dtype), mesh, spec_a)
  b = _put(random(rng, batch_b + (k, n), dtype), mesh, spec_b)
  f = lambda a, b: gemm(a, b, backend=backend, out_dtype=np.float32)
  ref_f = lambda a, b: jnp.matmul(a, b, preferred_element_type=np.float32)
  out, expected = jax.jit(f)(a, b), jax.jit(ref_f)(a, b)
  assert out.sharding.is_equivalent_to(expected.sharding, out.ndim), (out.sharding, expected.sharding)
  hlo = _hlo(f, a, b)
  assert not GATHERS.search(hlo), GATHERS.search(hlo).group(0)
  assert len(REDUCES.findall(hlo)) == reductions == len(REDUCES.findall(_hlo(ref_f, a, b)))
  assert relative_error(out, reference(a, b)) <= tolerance(dtype, None, k, np.float32)


def test_k_sharded_adds_c_once_and_casts_after_the_sum(rng):
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  m, n, k = 16, 8, 64
  a, b = random(rng, (m, k), dtype), random(rng, (k, n), dtype)
  c = random(rng, (m, n), np.float32)
  f = jax.jit(lambda a, b, c: gemm(a, b, c, alpha=0.5, beta=2.0, backend=backend))
  args = (_put(a, mesh, P(None, "x")), _put(b, mesh, P("x")), _put(c, mesh, P()))
  out = f(*args)
  assert out.dtype == np.dtype(dtype)
  assert relative_error(out, reference(a, b, c, alpha=0.5, beta=2.0)) <= tolerance(dtype, None, k)
  assert len(REDUCES.findall(_hlo(f, *args))) == 1


@pytest.mark.parametrize("layout", ["K", "MK"])
def test_k_sharded_16bit_result_reduce_scatters_f32_and_gathers_16bit(layout, rng):
  """A replicated 16-bit result of a split K: the f32 partials are reduce-scattered, each
  device finishes its rows (beta*C, bias, activation, cast), the rows are all-gathered in
  the output dtype: 3/4 of the bytes of an f32 all-reduce."""
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  spec_a, spec_b, _, _, k_axis = LAYOUTS[layout]
  if mesh.shape[k_axis] == 1:
    pytest.skip(f"mesh axis {k_axis} has size 1 here")
  m, n, k = 32, 24, 64
  a, b = random(rng, (m, k), dtype), random(rng, (k, n), dtype)
  c, bias = random(rng, (m, n), np.float32), random(rng, (n,), np.float32)
  f = jax.jit(lambda a, b, c, bias: gemm(a, b, c, beta=2.0, bias=bias, activation="relu",
                                         out_dtype=jnp.bfloat16, backend=backend))
  args = (_put(a, mesh, spec_a), _put(b, mesh, spec_b), _put(c, mesh, P(spec_a[0])),
          _put(bias, mesh, P()))
  out = f(*args)
  expected = reference(a, b, c, beta=2.0, bias=bias, activation="relu")
  assert out.dtype == jnp.bfloat16
  assert relative_error(out, expected) <= tolerance(jnp.bfloat16, None, k)
  hlo = _hlo(f, *args)
  assert [r[0] for r in REDUCES.findall(hlo)] == ["reduce-scatter"], REDUCES.findall(hlo)
  gathers = [line.split("all-gather")[0] for line in hlo.splitlines() if GATHERS.search(line)]
  assert len(gathers) == 1, gathers
  # XLA:CPU widens 16-bit collectives to f32 (a plain shard_map all_gather of bf16 shows
  # the same), so the gathered dtype is checked where the kernels run.
  assert "bf16[" in gathers[0] or not ON_GPU, gathers


def test_grad_of_a_sharded_loss(rng):
  """Reverse mode under shardings: the cotangent GEMMs are partitioned too (dB contracts
  over the sharded M: one all-reduce, as jnp.dot's backward)."""
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  m, n, k = 32, 16, 24
  a, b, w = random(rng, (m, k), dtype), random(rng, (k, n), dtype), random(rng, (m, n), dtype)
  loss = lambda a, b, w: jnp.sum(gemm(a, b, backend=backend).astype(np.float32) * w)
  grad = jax.grad(loss, argnums=(0, 1))
  args = (_put(a, mesh, P("x")), _put(b, mesh, P()), _put(w, mesh, P("x")))
  da, db = jax.jit(grad)(*args)
  w64 = w.astype(np.float64)
  tol = tolerance(dtype, None, m)
  assert relative_error(da, w64 @ b.astype(np.float64).T) <= tol
  assert relative_error(db, a.astype(np.float64).T @ w64) <= tol
  assert not _gathered_operands(_hlo(grad, *args))


def test_out_shardings_alone_shard_the_work(rng):
  """Replicated inputs and a requested output sharding: each device slices its rows."""
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  a, b = random(rng, (32, 16), dtype), random(rng, (16, 24), dtype)
  f = jax.jit(lambda a, b: gemm(a, b, backend=backend), out_shardings=NamedSharding(mesh, P("x")))
  out = f(a, b)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 2)
  assert relative_error(out, reference(a, b)) <= tolerance(dtype, None, 16)
  hlo = _hlo(f, a, b)
  assert not GATHERS.search(hlo) and not REDUCES.search(hlo)


def test_inside_shard_map(rng):
  """shard_map: gemm is the local GEMM of each shard; the user's psum does the reduction."""
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  a, b = random(rng, (16, 32), dtype), random(rng, (32, 8), dtype)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P())
  def f(a, b):
    return jax.lax.psum(gemm(a, b, backend=backend, out_dtype=np.float32), "x")

  assert relative_error(f(a, b), reference(a, b)) <= tolerance(dtype, None, 32, np.float32)


def test_mosaic_interpreter_stays_correct_under_shardings(rng):
  """Mosaic GPU's interpreter is not partitioned (see op.partitioned): still right."""
  if ON_GPU or skip_reason("mosaic", jnp.bfloat16):
    pytest.skip("the CPU interpreter path only")
  mesh = _mesh()
  a, b = random(rng, (64, 32), jnp.bfloat16), random(rng, (32, 16), jnp.bfloat16)
  out = jax.jit(lambda a, b: gemm(a, b, backend="mosaic"))(_put(a, mesh, P("x")), b)
  assert relative_error(out, reference(a, b)) <= tolerance(jnp.bfloat16, None, 32)


@pytest.mark.parametrize("backend,dtype,precision", [
    ("cuda", np.float32, HIGHEST), ("mosaic", jnp.bfloat16, None)])
def test_gpu_kernels_lower_through_the_partitioner(backend, dtype, precision):
  """Lowered for CUDA (no GPU needed), each GPU kernel sits inside custom_partitioning's
  custom call with its Shardy rule, so XLA partitions it as the tests above show for the
  Triton kernel (whose CUDA lowering needs a GPU's description, so it is not here)."""
  if backend == "cuda" and cuda.library_error() is not None:
    pytest.skip(f"CUDA library not built: {cuda.library_error()}")
  mesh = _mesh()
  plan = op.Plan(backend, _default_config(backend, dtype), 1.0, 0.0, False, True, precision,
                 np.dtype(dtype), False)
  assert op.partitioned(plan)
  sharded = NamedSharding(mesh, P("x"))
  a = jax.ShapeDtypeStruct((2, 256, 128), dtype, sharding=sharded)
  b = jax.ShapeDtypeStruct((2, 192, 128), dtype, sharding=sharded)
  text = jax.jit(lambda a, b: op.bind(plan, a, b)).trace(a, b).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "CustomSPMDPartitioning" in text
  # a (b m k), b (b n k) -> (b m n), k a reduction factor.
  rule = re.search(r"sdy.sharding_rule = #sdy.op_sharding_rule<(.*)>", text)
  assert rule and rule.group(1).startswith("([i, j, k], [i, l, k])->([i, j, l])"), rule
  assert "reduction={k}" in rule.group(1), rule.group(1)
  # On one device the same call is the kernel itself.
  local = jax.jit(lambda a, b: op.bind(plan, a, b)).trace(
      *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (a, b))).lower(
          lowering_platforms=("cuda",)).as_text()
  assert KERNEL_CALL[backend] in local and "CustomSPMDPartitioning" not in local


def _default_config(backend, dtype):
  from pallas_gemm.matmul import tuning  # noqa: PLC0415
  config = tuning.resolve_config(backend, 256, 192, 128, dtype, None, device_kind="cpu")
  # Mosaic reads the SM count from the device, which a CPU lacks: the H100/H200's.
  return dataclasses.replace(config, num_sms=132) if backend == "mosaic" else config


def test_k_sharded_into_a_row_sharded_output_reduce_scatters(rng):
  """K split over x and the output wanted on x by rows: one reduce-scatter, nothing else."""
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  a, b = random(rng, (32, 64), dtype), random(rng, (64, 16), dtype)
  c = random(rng, (32, 16), np.float32)
  f = jax.jit(lambda a, b, c: gemm(a, b, c, beta=-1.0, backend=backend, out_dtype=np.float32),
              out_shardings=NamedSharding(mesh, P("x")))
  args = (_put(a, mesh, P(None, "x")), _put(b, mesh, P("x")), c)
  out = f(*args)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 2)
  assert relative_error(out, reference(a, b, c, beta=-1.0)) <= tolerance(dtype, None, 64, np.float32)
  hlo = _hlo(f, *args)
  assert not GATHERS.search(hlo)
  assert [r[0] for r in REDUCES.findall(hlo)] == ["reduce-scatter"], REDUCES.findall(hlo)


@pytest.mark.parametrize("layout", ["N", "K"])
def test_sharded_bias_and_activation(layout, rng):
  """The bias follows N's sharding; with K split, bias and activation apply after the sum."""
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  spec_a, spec_b, *_ = LAYOUTS[layout]
  a, b, bias = random(rng, (16, 32), dtype), random(rng, (32, 24), dtype), random(rng, (24,), dtype)
  f = jax.jit(lambda a, b, bias: gemm(a, b, bias=bias, activation="gelu", backend=backend,
                                      out_dtype=np.float32))
  args = (_put(a, mesh, spec_a), _put(b, mesh, spec_b), bias)
  out = f(*args)
  ref = reference(a, b, bias=bias, activation="gelu")
  assert relative_error(out, ref) <= tolerance(dtype, None, 32, np.float32)
  hlo = _hlo(f, *args)
  assert not GATHERS.search(hlo)
  assert len(REDUCES.findall(hlo)) == (layout == "K")


@pytest.mark.parametrize("layout", ["M", "N", "batch"])
def test_explicit_mode_types_like_jnp_dot(layout, rng):
  """Explicit-sharding meshes: gemm runs XLA's dot and types its result (and gradients)
  as jnp.dot does; a Pallas backend asked for by name is refused."""
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip(f"needs >= 2 devices; this process has {len(devices)}")
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=devices[:2])
  a_spec, b_spec, a_batch, b_batch, _ = LAYOUTS[layout]
  a = random(rng, a_batch + (16, 24), np.float32)
  b = random(rng, b_batch + (24, 8), np.float32)
  with jax.set_mesh(mesh):
    a_s = jax.device_put(a, NamedSharding(mesh, a_spec))
    b_s = jax.device_put(b, NamedSharding(mesh, b_spec))
    out = jax.jit(lambda a, b: gemm(a, b, precision=HIGHEST))(a_s, b_s)
    assert jax.typeof(out) == jax.typeof(jax.jit(jnp.matmul)(a_s, b_s))
    assert relative_error(out, reference(a, b)) <= tolerance(np.float32, HIGHEST, 24)
    grads = jax.jit(jax.grad(lambda a, b: gemm(a, b).sum(), (0, 1)))(a_s, b_s)
    assert [jax.typeof(g) for g in grads] == [jax.typeof(a_s), jax.typeof(b_s)]
    with pytest.raises(ValueError, match="Explicit mesh axes"):
      gemm(a_s, b_s, backend="triton")


@pytest.mark.parametrize("layout", ["M", "K"])
def test_sharded_gated_gradient(layout, rng):
  """The layer after an activation (a_activation) under shardings: act(a) and the gate
  act'(a) are elementwise, so each device applies them to its own shard of a (K-sharded
  too); the gradient runs partitioned with no operand gathered."""
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  spec_a, spec_b, *_ = LAYOUTS[layout]
  m, n, k = 32, 16, 24
  a, b, w = random(rng, (m, k), dtype), random(rng, (k, n), dtype), random(rng, (m, n), dtype)
  f = lambda a, b: gemm(a, b, a_activation="gelu", backend=backend, out_dtype=np.float32)
  loss = lambda a, b, w: jnp.sum(f(a, b) * w)
  args = (_put(a, mesh, spec_a), _put(b, mesh, spec_b), _put(w, mesh, P(spec_a[0])))
  # act(a) is rounded to a's dtype before the product (as gemm(act(a), b)): the tolerance
  # of a's dtype, though the result is f32.
  tol = 2 * tolerance(dtype, None, k)
  assert relative_error(jax.jit(f)(*args[:2]), reference(a, b, a_activation="gelu")) <= tol
  da = jax.jit(jax.grad(loss))(*args)
  assert relative_error(da, gated_gradient(a, b, w, "gelu")) <= tol
  hlo = _hlo(jax.grad(loss, argnums=(0, 1)), *args)
  assert not _gathered_operands(hlo)


@pytest.mark.parametrize("layout", ["data", "megatron"])
def test_sharded_mlp(layout, rng):
  """mlp under shardings: its hidden layer returns (act(z), z) from one partitioned call
  (two results, laid out alike). Data parallel (x on rows) runs every GEMM locally;
  Megatron-style (w1 on hidden columns, w2 on hidden rows) sums the second layer's K
  shards once. Values and gradients match float64, and no operand is gathered."""
  from pallas_gemm import mlp  # noqa: PLC0415
  from pallas_gemm.testing.reference import ACTIVATIONS  # noqa: PLC0415
  backend, dtype = _partitioned_backend()
  mesh = _mesh()
  m, d, hidden, n = 16, 24, 32, 8
  x, w1, b1 = random(rng, (m, d), dtype), random(rng, (d, hidden), dtype), random(rng, (hidden,), dtype)
  w2, b2, cot = random(rng, (hidden, n), dtype), random(rng, (n,), dtype), random(rng, (m, n), dtype)
  specs = {"data": (P("x", None), P(), P(), P(), P(), P("x", None)),
           "megatron": (P(), P(None, "x"), P("x"), P("x", None), P(), P())}[layout]
  args = [_put(v, mesh, s) for v, s in zip((x, w1, b1, w2, b2, cot), specs)]
  f = lambda x, w1, b1, w2, b2: mlp(x, w1, b1, w2, b2, "gelu", backend=backend)
  loss = lambda x, w1, b1, w2, b2, cot: jnp.sum(f(x, w1, b1, w2, b2) * cot)
  with jax.enable_x64(True):
    f64 = lambda x, w1, b1, w2, b2: (ACTIVATIONS["gelu"](x @ w1 + b1)) @ w2 + b2
    args64 = [np.asarray(v, np.float64) for v in (x, w1, b1, w2, b2, cot)]
    value = np.asarray(f64(*args64[:5]))
    want = jax.grad(lambda *a: jnp.sum(f64(*a[:5]) * a[5]), argnums=(0, 1, 2, 3))(*args64)
  tol = 4 * tolerance(dtype, None, hidden)
  assert relative_error(jax.jit(f)(*args[:5]), value) <= tol
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
  for got, ref in zip(grads, want):
    assert relative_error(got, np.asarray(ref)) <= tol
  hlo = _hlo(jax.grad(loss, argnums=(0, 1, 2, 3)), *args)
  assert not _gathered_operands(hlo)


def _two_gpus():
  """The mesh of the pair-kernel tests: they need two real GPUs (peer memory)."""
  if not ON_GPU or len(jax.devices()) < 2:
    pytest.skip(f"needs 2 GPUs; this process has {jax.devices()}")
  if skip_reason("mosaic", jnp.bfloat16):
    pytest.skip(skip_reason("mosaic", jnp.bfloat16))
  return _mesh()


def _collectives(hlo: str) -> list[str]:
  return [x.group(0) for x in (*GATHERS.finditer(hlo), *REDUCES.finditer(hlo))]


@pytest.mark.parametrize("out_spec", [P(), P("x")])
def test_gpu_k_split_over_two_gpus_exchanges_partials_in_the_kernels(out_spec, rng):
  """mosaic's pair_gemm (a K split over two GPUs): each device stores the other's rows of
  its f32 partial product into the other's memory from the kernel, so the compiled
  program has no collective at all, replicated (P()) or by rows (P("x")). Three calls
  with fresh inputs: a partial left over from an earlier call, or one read before the
  peer wrote it, would show in the values."""
  mesh = _two_gpus()
  m, n, k = 512, 384, 2048
  f = jax.jit(lambda a, b, bias: gemm(a, b, bias=bias, activation="gelu", backend="mosaic"),
              out_shardings=NamedSharding(mesh, out_spec))
  for _ in range(3):
    a, b = random(rng, (m, k), jnp.bfloat16), random(rng, (k, n), jnp.bfloat16)
    bias = random(rng, (n,), np.float32)
    args = (_put(a, mesh, P(None, "x")), _put(b, mesh, P("x", None)), _put(bias, mesh, P()))
    out = f(*args)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 2)
    expected = reference(a, b, bias=bias, activation="gelu")
    assert relative_error(out, expected) <= tolerance(jnp.bfloat16, None, k)
  hlo = _hlo(f, *args)
  assert not _collectives(hlo), _collectives(hlo)
  assert hlo.count('custom_call_target="mosaic_gpu') == 2


def test_gpu_data_parallel_weight_gradient_runs_on_the_pair_kernels(rng):
  """Rows of x sharded over two GPUs: the weight gradient x^T @ g contracts over the
  sharded rows, a K split with a transposed a, summed by the pair kernels; the input
  gradient is local. The whole backward pass compiles to no collective at all."""
  mesh = _two_gpus()
  m, k, n = 1024, 512, 384
  x, w, cot = (random(rng, s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n)))
  loss = lambda x, w, cot: jnp.sum(gemm(x, w, backend="mosaic").astype(np.float32)
                                   * cot.astype(np.float32))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  args = (_put(x, mesh, P("x", None)), _put(w, mesh, P()), _put(cot, mesh, P("x", None)))
  dx, dw = grad(*args)
  c64 = cot.astype(np.float64)
  assert relative_error(dx, c64 @ w.astype(np.float64).T) <= tolerance(jnp.bfloat16, None, n)
  assert relative_error(dw, x.astype(np.float64).T @ c64) <= tolerance(jnp.bfloat16, None, m)
  hlo = _hlo(jax.grad(loss, argnums=(0, 1)), *args)
  assert not _collectives(hlo), _collectives(hlo)
