"""Expert parallelism: `moe_mlp` with the experts split over one mesh axis.

Each of the n devices of the axis holds T/n of the tokens and E/n of the experts (E_l,
the experts of device j being j*E_l ... (j+1)*E_l - 1). Tokens travel, each once to each
device that holds one of its experts (however many of its k experts are there, as
DeepEP's dispatch does); experts stay:
  1. dispatch locally: a (token, device) pair for each device that holds one of the
     token's experts, sorted by device (`destinations`); the rows gathered, at most
     T/n * n rows, one slice per device.
  2. the counts: every device's rows per destination, all-gathered ((n, n) int32s).
  3. exchange: each slice goes to its device, packed there by source; the token's k
     weights and k global ids travel beside it (one array of 2k floats per row). The
     fp8 inference form sends the rows quantized, as bytes (`layer.Form.send`).
  4. each device runs the one-device layer (`layer.layer`) on the rows it received,
     their ids for other devices' experts routing nowhere: a partial sum per row of
     topk_weights times its experts' outputs here.
  5. the same exchange backwards: each partial sum returns to its row of step 1.
  6. out[t] = the sum of token t's partial sums (at most n), in f32; each partial sum was
     rounded to the result's dtype on its device, to travel back in it.
Against one row per (token, slot) pair, steps 3 and 5 move up to min(k, n) rows per token
instead of k (Qwen3-like, top-8 over 2 devices: 2 instead of 8), for a local sort and
gather on the receiver. Reverse mode differentiates through it: the exchanges are linear
(their transposes are the exchanges the other way), and the layer's pieces keep their
gather-only backwards.

The receive buffer holds n * T/n rows, the most a device can receive (every token of
every device), so nothing is dropped whatever the routing. Rows past what arrived have
weight 0 and id -1: they route nowhere. Their k slots (n * T/n * k) are what step 4's
per-pair passes would run over, n times a device's share of the pairs under even
routing; so step 4 keeps the pairs of this device's experts in PAIR_HEADROOM times that
share where they fit, and runs every slot where they do not (a branch each device takes
on its own count; the full branch recomputes its forward in the backward rather than
store it, from the weights as the form prepares them outside the branch: the fp8
form's quantized copies, not the bf16 weights): the same values either way, dropless.

Two exchanges do steps 3 and 5 (the `exchange` argument):
- "ragged": `jax.lax.ragged_all_to_all`, which moves exactly the rows routed (XLA:GPU; XLA's
  CPU backend does not implement it).
- "padded": the same slices through a dense `jax.lax.all_to_all` of (n, T/n) rows per
  device (each peer's chunk as large as the most a device can send it): up to n times
  the bytes, on any backend.
"auto" picks "ragged" on a GPU and "padded" elsewhere. On two H200s (training step,
benchmarks/moe_parallel.py, docs/performance.md) the two ran within 4% of each other:
padded 1.04x ragged at Qwen3-like weak scaling (+-0.01), ragged 1.04x padded at
Mixtral-like (+-0.02). XLA's ragged-all-to-all copies one slice per unit of work; few
large slices per peer ran it 5x slower than padded, so each slice is cut into
RAGGED_SLICES_PER_PEER pieces.

Chunks (moe_mlp's `exchange_chunks`, `local`): each device's tokens in chunks that are
dispatched, exchanged and computed on their own, so that a scheduler may run one chunk's
exchanges under another's GEMMs. Two H200s with XLA's default flags: 2 chunks made the
training step 1.2-1.3x slower (strong scaling; no overlap came of it, and each chunk pays
its own dispatch and smaller GEMMs), so the default is one chunk.

The same module runs data parallelism (`run` without an expert axis: each device its
tokens through every expert) and both together on a (data, expert) mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_gemm.core import sharding
from pallas_gemm.moe import layer

EXCHANGES = ("auto", "ragged", "padded")
# The fast path of step 4 holds this many times a device's share of the pairs (routing
# within 25% of even); more, and that device runs the layer on every slot it received.
PAIR_HEADROOM = 1.25


def _exclusive_cumsum(v, axis=-1):
  return jnp.cumsum(v, axis=axis) - v


def _covering(pos, starts, sizes, shifts):
  """For each position (P,), the slice along starts' last axis with starts <= pos <
  starts + sizes (slices do not overlap): (pos + that slice's shift, whether one covers
  pos), each of shape starts.shape[:-1] + (P,)."""
  hit = ((pos[:, None] >= starts[..., None, :])
         & (pos[:, None] < (starts + sizes)[..., None, :]))
  return (jnp.sum(jnp.where(hit, shifts[..., None, :] + pos[:, None], 0), axis=-1),
          jnp.any(hit, axis=-1))


def _padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
            axis_name: str, capacity: int | None):
  """(result, received): `padded_all_to_all`'s result and the mask of output rows that
  a slice was written to."""
  n = jax.lax.axis_size(axis_name)
  rows, cap = output.shape[0], capacity or operand.shape[0]
  per = input_offsets.shape[0] // n
  sizes = send_sizes.reshape(n, per)
  starts = _exclusive_cumsum(sizes)                          # slice starts in its chunk
  # chunk j, row q: the operand row of the slice of j that covers q
  src, filled = _covering(jnp.arange(cap, dtype=jnp.int32), starts, sizes,
                          input_offsets.reshape(n, per) - starts)  # (n, cap)
  packed = jnp.where(filled[..., None], operand[jnp.clip(src, 0, operand.shape[0] - 1)], 0)
  packed = packed.astype(operand.dtype)
  received = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=False)  # [src, q]
  landing = jax.lax.all_to_all(output_offsets.reshape(n, per), axis_name, 0, 0)
  rsizes = recv_sizes.reshape(n, per)
  rstarts = _exclusive_cumsum(rsizes)                        # slice starts in src's chunk
  # output row p: the row of `received` (flattened) of the slice that landed over p
  shifts = jnp.arange(n, dtype=jnp.int32)[:, None] * cap + rstarts - landing
  index, got = _covering(jnp.arange(rows, dtype=jnp.int32), landing.reshape(-1),
                         rsizes.reshape(-1), shifts.reshape(-1))  # (rows,)
  got = got.reshape(-1, *([1] * (operand.ndim - 1)))
  taken = received.reshape(n * cap, *operand.shape[1:])[jnp.clip(index, 0, n * cap - 1)]
  return jnp.where(got, taken, output), got


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def padded_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                      recv_sizes, axis_name: str, capacity: int | None = None):
  """`jax.lax.ragged_all_to_all`'s result through a dense `all_to_all`, for slices that
  do not overlap in the operand: each device packs its slices for device j into one
  chunk of `capacity` rows (zero-filled; default operand's length, the most a device
  can send one peer, which a caller who knows a smaller bound passes: rows of a slice
  beyond it are not sent), the chunks are
  exchanged, and each received row is gathered to its place in output. Moves
  n * capacity rows per device; runs wherever all_to_all does. Its gradient is the
  exchange the other way (a slice has the same size both ways, so the same capacity),
  as ragged_all_to_all's (autodiff of the gathers would scatter-add)."""
  return _padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                 axis_name, capacity)[0]


def _padded_fwd(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                axis_name, capacity):
  result, got = _padded(operand, output, input_offsets, send_sizes, output_offsets,
                        recv_sizes, axis_name, capacity)
  rows = jnp.zeros((operand.shape[0], 0), operand.dtype)  # operand's rows and dtype only
  return result, (rows, got, input_offsets, send_sizes, output_offsets, recv_sizes)


def _padded_bwd(axis_name, capacity, residuals, ct):
  rows, got, input_offsets, send_sizes, output_offsets, recv_sizes = residuals
  zero = jnp.zeros((rows.shape[0], *ct.shape[1:]), rows.dtype)
  # Where each received slice landed here, and where it came from on its sender.
  landed = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  came_from = jax.lax.all_to_all(input_offsets, axis_name, 0, 0, tiled=True)
  d_operand = _padded(ct, zero, landed, recv_sizes, came_from, send_sizes, axis_name,
                      capacity)[0]
  d_output = jnp.where(got, jnp.zeros_like(ct), ct)
  return d_operand, d_output, None, None, None, None


padded_all_to_all.defvjp(_padded_fwd, _padded_bwd)


# XLA:GPU's ragged-all-to-all copies its slices in parallel, one block of 128 threads
# per piece (8 bytes a thread and step): uncut, at 4 slices per peer, it moved the rows 5x
# slower than a dense all_to_all of twice the bytes. Cut into 64 pieces per peer it ran
# on par with it; at 512 (1024 blocks on two GPUs, against 128) the Qwen3-like training
# step ran 1.04x faster and its forward 1.09x than at 64 (two H200s, docs/performance.md).
RAGGED_SLICES_PER_PEER = 512


def _pieces(offsets, sizes, pieces: int):
  """Each (offset, size) slice cut into `pieces` consecutive ones (some maybe empty), in
  slice order: a receiver that cuts the same sizes the same way sees the same pieces."""
  if pieces == 1:
    return offsets, sizes
  i = jnp.arange(pieces + 1, dtype=sizes.dtype)
  bounds = sizes[:, None] * i[None, :] // pieces                 # (K, pieces + 1)
  return ((offsets[:, None] + bounds[:, :-1]).reshape(-1),
          (bounds[:, 1:] - bounds[:, :-1]).reshape(-1))


def move(name: str, capacity: int | None = None):
  """The exchange function of that name, with ragged_all_to_all's signature; capacity:
  the most rows a device sends one peer, if less than the operand's (`padded_all_to_all`)."""
  if name == "ragged":
    return jax.lax.ragged_all_to_all
  return lambda *args, axis_name: padded_all_to_all(*args, axis_name, capacity)


def ragged_available() -> bool:
  """Whether XLA implements ragged-all-to-all on this backend (GPUs only)."""
  return jax.default_backend() == "gpu"


def _offsets(counts, me, n: int):
  """The exchange's offsets (int32, each (n,)) from counts (n, n) = rows device s sends
  device j, each device's rows sorted by destination and each receiver's packed by
  source: send_offsets, send_sizes (where this device's slice for j starts, its rows);
  out_offsets (where it lands on j); recv_sizes, recv_offsets (what arrives from s, and
  where); return_offsets (where a result row goes back to on s: s's send offsets)."""
  send_sizes = counts[me]
  by_source = _exclusive_cumsum(counts, axis=0)    # [s, j]: rows before s's on j
  return (_exclusive_cumsum(send_sizes), send_sizes, by_source[me], counts[:, me],
          by_source[:, me], _exclusive_cumsum(counts, axis=1)[:, me])


def exchange_plan(counts, me, n: int, exchange: str):
  """(exchange, the offsets of `_offsets`) for the exchange that runs: "auto"
  resolved, and for "ragged" each slice cut into RAGGED_SLICES_PER_PEER pieces."""
  offsets = _offsets(counts, me, n)
  if exchange == "auto":
    exchange = "ragged" if ragged_available() else "padded"
  if exchange == "ragged":
    if not ragged_available():
      raise ValueError("exchange='ragged' runs on GPUs (XLA implements ragged-all-to-all"
                       f" there only); this backend is {jax.default_backend()!r}: use"
                       " 'padded' or 'auto'")
    send_off, send_sizes, out_off, recv_sizes, recv_off, return_off = offsets
    send_off, send_cut = _pieces(send_off, send_sizes, RAGGED_SLICES_PER_PEER)
    out_off, _ = _pieces(out_off, send_sizes, RAGGED_SLICES_PER_PEER)
    recv_off, recv_cut = _pieces(recv_off, recv_sizes, RAGGED_SLICES_PER_PEER)
    return_off, _ = _pieces(return_off, recv_sizes, RAGGED_SLICES_PER_PEER)
    offsets = (send_off, send_cut, out_off, recv_cut, recv_off, return_off)
  return exchange, offsets


def destinations(topk_ids, n: int, experts_local: int):
  """(wanted, d): wanted (T_l, n) whether device j holds one of token t's experts, and
  the dispatch of those (t, j) pairs sorted by device (`layer.dispatch` with n "experts":
  d.group_sizes are the rows sent to each device, d.token the token of each row)."""
  ids = topk_ids.astype(jnp.int32)
  owner = jnp.where((ids >= 0) & (ids < experts_local * n), ids // experts_local, -1)
  devices = jnp.arange(n, dtype=jnp.int32)
  wanted = jnp.any(owner[:, :, None] == devices, axis=1)
  return wanted, layer.dispatch(jnp.where(wanted, devices, -1), n)


def pair_capacity(pairs_here: int, pairs_most: int) -> int:
  """The sorted pairs the fast path of step 4 holds: PAIR_HEADROOM times a device's share
  of the pairs (pairs_here), a multiple of 8, at most pairs_most."""
  return min(pairs_most, -(-int(PAIR_HEADROOM * pairs_here) // 8) * 8)


def _experts_here(form: layer.Form, plan, received, weights, w_gate_up, w_down, ids,
                  experts_local, *, pairs_here: int):
  """Step 4: the layer on the received rows, ids localized (-1: another device's expert).
  The rows' slots hold up to every pair of every device; routed evenly, a device gets
  about pairs_here of them. Every per-pair pass (the gathers, the activation, the
  combine and their gradients) costs its static length, so the pairs sorted to this
  device's experts run in `pair_capacity` rows where they fit, and in all the slots
  where they do not (dropless either way; each device branches on its own count, with
  no collective inside)."""
  cap = pair_capacity(pairs_here, ids.size)
  d = layer.dispatch(ids, experts_local)
  if cap >= ids.size:
    return form.call(plan, received, weights, w_gate_up, w_down, d)
  return _capped(form, plan, cap, received, weights, w_gate_up, w_down, d)


def _cut(d: layer.Dispatch, rows: int) -> layer.Dispatch:
  """d with its first `rows` sorted rows only (`layer._pick`): the same layer wherever
  sum(d.group_sizes) <= rows, the per-pair passes that much shorter."""
  return layer.Dispatch(order=d.order[:rows], token=d.token[:rows], inverse=d.inverse,
                        group_sizes=d.group_sizes)


def _fits(d: layer.Dispatch, cap: int):
  return jnp.sum(d.group_sizes) <= cap


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _capped(form, plan, cap, x, weights, w_gate_up, w_down, d):
  return jax.lax.cond(_fits(d, cap),
                      lambda: form.call(plan, x, weights, w_gate_up, w_down, _cut(d, cap)),
                      lambda: form.call(plan, x, weights, w_gate_up, w_down, d))


def _capped_fwd(form, plan, cap, x, weights, w_gate_up, w_down, d):
  # The residuals are the operands (the weights as the form prepares them: the fp8 form's
  # quantized copies) and what the capped forward saved, kept outside the branch (a
  # cond's outputs are copies: the weights would be copied every step). The full path
  # saves nothing (zeros in the capped path's shapes): its backward recomputes.
  fits, small = _fits(d, cap), _cut(d, cap)
  gate_up, down = form.prepared(w_gate_up, w_down)
  saved_shapes = jax.eval_shape(lambda *a: form.forward(plan, *a, small)[1],
                                x, weights, gate_up, down)
  vary = frozenset().union(*map(sharding.varying_axes, jax.tree.leaves(
      (x, weights, w_gate_up, w_down, d.inverse))))
  typed = lambda tree: jax.tree.map(  # noqa: E731 - one type for both branches' outputs
      lambda a: sharding.cast_varying(a, tuple(sorted(vary))), tree)

  def capped():
    return typed(form.forward(plan, x, weights, gate_up, down, small))

  def full():  # the primal alone (the bf16 layer's kernels then write no h)
    out = form.call(plan, x, weights, w_gate_up, w_down, d)
    return typed((out, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), saved_shapes)))

  out, saved = jax.lax.cond(fits, capped, full)
  return out, (x, weights, gate_up, down, d, saved)


def _capped_bwd(form, plan, cap, residuals, g):
  x, weights, gate_up, down, d, saved = residuals

  def capped():
    return form.backward(plan, x, weights, gate_up, down, _cut(d, cap), saved, g)

  def full():  # the forward again, from the prepared weights
    again = form.forward(plan, x, weights, gate_up, down, d)[1]
    return form.backward(plan, x, weights, gate_up, down, d, again, g)

  return (*jax.lax.cond(_fits(d, cap), capped, full), None)


_capped.defvjp(_capped_fwd, _capped_bwd)


def local(plan: layer.Plan, x, topk_weights, topk_ids, w_gate_up, w_down, *, axis: str,
          exchange: str, chunks: int = 1, form: layer.Form = layer.LAYER):
  """The expert-parallel layer on one device's shard, inside a manual `axis`: x (T_l, D),
  topk_* (T_l, k) with global expert ids, w_* this device's E_l experts. (T_l, D).

  chunks > 1 splits the T_l tokens into that many consecutive chunks (sizes differing by
  at most one, the same on every device, so the exchanges of a chunk pair up), each run
  through the steps on its own: no chunk's values depend on another's, so XLA may run one
  chunk's exchanges while another's GEMMs run. The weight gradients are the sum of the
  chunks'. form: the one-device layer each device runs on the rows it received
  (`layer.LAYER`, the fp8 training forms `fp8.TRAIN` and `fp8.TRAIN_CACHED`, or the fp8
  inference form `fp8.INFER`, whose rows travel quantized)."""
  t = x.shape[0]
  chunks = max(1, min(chunks, t))
  if chunks > 1:
    bounds = [t * i // chunks for i in range(chunks + 1)]
    return jnp.concatenate([
        local(plan, x[a:b], topk_weights[a:b], topk_ids[a:b], w_gate_up, w_down, axis=axis,
              exchange=exchange, form=form)
        for a, b in zip(bounds[:-1], bounds[1:])])
  n = jax.lax.axis_size(axis)
  me = jax.lax.axis_index(axis)
  t, k = topk_ids.shape
  experts_local = _experts(w_down)
  if experts_local * n > 2 ** 24:
    raise ValueError(f"expert parallelism sends expert ids as float32, exact below 2^24;"
                     f" got E = {experts_local * n}")
  ids = topk_ids.astype(jnp.int32)
  wanted, d = destinations(ids, n, experts_local)                       # step 1
  wire = x if form.send is None else form.send(x, w_gate_up)  # (T_l, D) or its fp8 bytes
  rows = layer.pair_rows(wire, d, n)                       # (T_l * n, .), sent rows first
  # The receiver's routing travels with each row: the k weights and the k global ids
  # (exact in the float dtype: E < 2^24) in one array of 2k columns.
  meta_dtype = jnp.promote_types(topk_weights.dtype, jnp.float32)
  meta = jnp.concatenate([layer.pair_rows(topk_weights.astype(meta_dtype), d, n),
                          ids[d.token].astype(meta_dtype)], axis=1)
  counts = jax.lax.all_gather(d.group_sizes, axis)                      # step 2: (n, n)
  exchange, offsets = exchange_plan(counts, me, n, exchange)
  send_off, send_sizes, out_off, recv_sizes, recv_off, return_off = offsets
  move_fn = move(exchange, capacity=t)  # a device sends a peer each token once at most
  manual = tuple(sorted(sharding.varying_axes(rows) | {axis}))
  fresh = lambda a: sharding.cast_varying(a, manual)  # noqa: E731 - vary as rows do
  arriving = n * t  # every token of every device: nothing is ever dropped
  received = move_fn(rows, fresh(jnp.zeros((arriving, rows.shape[1]), rows.dtype)),
                     send_off, send_sizes, out_off, recv_sizes, axis_name=axis)  # step 3
  if form.receive is not None:
    received = form.receive(received, x, w_gate_up)
  # Rows past those received: weight 0, id -1 (route nowhere).
  empty = jnp.concatenate([jnp.zeros((arriving, k), meta_dtype),
                           jnp.full((arriving, k), -1, meta_dtype)], axis=1)
  routing = move_fn(meta, fresh(empty), send_off, send_sizes, out_off, recv_sizes,
                    axis_name=axis)
  got_ids = routing[:, k:].astype(jnp.int32) - me * experts_local
  got_ids = jnp.where((got_ids >= 0) & (got_ids < experts_local), got_ids, -1)
  # A pair of another device's expert adds nothing here, whatever its weight.
  got_weights = layer.routed(routing[:, :k].astype(topk_weights.dtype), got_ids,
                             experts_local)
  partial = _experts_here(form, plan, received, got_weights, w_gate_up, w_down, got_ids,
                          experts_local, pairs_here=t * k)  # step 4
  back = move_fn(partial, fresh(jnp.zeros((t * n, x.shape[1]), partial.dtype)), recv_off,
                 recv_sizes, return_off, send_sizes, axis_name=axis)   # step 5
  return layer.combine_pairs(back, wanted.astype(jnp.float32), d, plan.out_dtype)  # step 6


def _experts(w_down) -> int:
  """E of w_down: an array, a `quantize_experts` pair (values, scales) or an `fp8.Master`
  (the weight its first leaf)."""
  return jax.tree.leaves(w_down)[0].shape[0]


def _dim_axes(a, dim: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the mesh axes a's type splits dim `dim` over, the Explicit axes of its mesh)."""
  type_sharding = getattr(jax.typeof(a), "sharding", None)
  spec = tuple(getattr(type_sharding, "spec", ()) or ())
  spec += (None,) * (a.ndim - len(spec))
  return (sharding.axes(spec[dim]),
          tuple(getattr(getattr(type_sharding, "mesh", None), "explicit_axes", ())))


def sharded_expert_axis(w):
  """The Explicit mesh axis w's type splits its first dim (E) over, or None."""
  first, explicit = _dim_axes(w, 0)
  return first[0] if len(first) == 1 and first[0] in explicit else None


def sharded_model_axis(w_gate_up):
  """The Explicit mesh axis w_gate_up's type splits F over, or None: its last dim, when
  that dim is F alone ((E, D, 2, F), or (E, D, F) of an ungated activation; the caller
  passes only those). A split of w_down alone, or of [gate | up]'s 2F, is a storage
  layout (e.g. FSDP's), not tensor parallelism: the weights are resharded as they are."""
  last, explicit = _dim_axes(w_gate_up, -1)
  return last[0] if len(last) == 1 and last[0] in explicit else None


def splits_last_dim(w) -> bool:
  """Whether w's type splits its last dim over a mesh axis."""
  return bool(_dim_axes(w, -1)[0])


def token_axes(x, *other) -> tuple[str, ...]:
  """The Explicit mesh axes x's type splits its tokens over, besides the other parallel
  axes (expert, model): data parallelism, each device's tokens through every expert on
  that device."""
  first, explicit = _dim_axes(x, 0)
  return tuple(a for a in first if a in explicit and a not in other)


def check_data_axes(names: tuple[str, ...], expert_axis, model_axis=None
                    ) -> tuple[str, ...]:
  """`moe_mlp`'s data_axes, checked against the mesh in context (ValueError)."""
  mesh = jax.sharding.get_abstract_mesh()
  for name in names:
    if name == expert_axis:
      raise ValueError(f"data_axes={names} names the expert axis {expert_axis!r}: the tokens"
                       " split over it already (expert parallelism)")
    if name == model_axis:
      raise ValueError(f"data_axes={names} names the model axis {model_axis!r}: every"
                       " device of it runs the same tokens (tensor parallelism over F)")
    if name not in mesh.axis_names:
      raise ValueError(f"data_axes={names}: {name!r} is not an axis of the mesh in context"
                       f" (jax.set_mesh); its axes are {tuple(mesh.axis_names)}")
    if name in mesh.manual_axes:
      raise ValueError(f"data_axes={names}: inside jax.shard_map over {name!r}, x is already"
                       " the device's tokens; leave data_axes out")
  if len(set(names)) != len(names):
    raise ValueError(f"data_axes={names} names an axis twice")
  return names


def _mesh_with(names: tuple[str, ...], arrays):
  """The mesh that holds these axes: the context's (jax.set_mesh, shard_map) or one of
  the arrays' types'."""
  meshes = [jax.sharding.get_abstract_mesh()] + [
      getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None) for a in arrays]
  for mesh in meshes:
    if mesh is not None and set(names) <= set(getattr(mesh, "axis_names", ())):
      return mesh
  missing = [a for a in names if a not in getattr(
      jax.sharding.get_abstract_mesh(), "axis_names", ())]
  raise ValueError(f"mesh axis {(missing or list(names))[0]!r} (expert_axis / model_axis)"
                   " is not an axis of the mesh in context (jax.set_mesh, jax.shard_map)"
                   " nor of the weights' sharding")


def _sharded(plan, x, weights, ids, w_gate_up, w_down, *, axis, model_axis, exchange,
             chunks, form):
  """One device's layer inside the manual axes: w_gate_up (E_l, D, G, F_l), G = 2 for
  [gate | up] and 1 otherwise (or the E_l experts' fp8 inference pairs, or their
  `fp8.Master`s: (E_l, D, W) with its fp8 copies).
  Expert-parallel over `axis` (if any); over `model_axis` (if any) each device holds F_l
  of F and all of the device group's tokens: its partial sums, in the result's dtype,
  are added over the axis (one all-reduce of (T_l, D), as a row-parallel linear layer's;
  the backward all-reduces d x)."""
  if getattr(w_gate_up, "ndim", None) == 4:  # fp8 pairs and `fp8.Master`s come as they are
    e, d, g, f = w_gate_up.shape
    w_gate_up = w_gate_up.reshape(e, d, g * f)  # this device's [gate_l | up_l]
  e = _experts(w_down)
  # One set of manual axes for every operand, the model axis included (the tokens are the
  # same on each of its devices, the products not): a weight whole on the devices of a
  # data axis (the tokens split over it) gets the sum of their gradients.
  x, weights, ids, w_gate_up, w_down = sharding.same_varying(
      x, weights, ids, w_gate_up, w_down, also=() if model_axis is None else (model_axis,))
  if axis is None:
    weights = layer.routed(weights, ids, e)
    out = form.call(plan, x, weights, w_gate_up, w_down, layer.dispatch(ids, e))
  else:
    out = local(plan, x, weights, ids, w_gate_up, w_down, axis=axis, exchange=exchange,
                chunks=chunks, form=form)
  return out if model_axis is None else jax.lax.psum(out, model_axis)


def run(plan: layer.Plan, x, topk_weights, topk_ids, w_gate_up, w_down, *,
        axis: str | None, data_axes: tuple[str, ...] = (), model_axis: str | None = None,
        exchange: str = "auto", chunks: int = 1, form: layer.Form = layer.LAYER,
        f_multiple: int = 1):
  """The layer on x (T, D) with its tokens split over data_axes + (axis,), with an
  expert axis the experts over it, and with a model axis F over it (tensor parallel).
  w_gate_up comes as (E, D, G, F): G = 2 for [gate | up], 1 otherwise, so that a split
  of F keeps each device's gate and up columns together; for the fp8 inference form
  (`fp8.INFER`) both weights are `quantize_experts` pairs, and for the fp8 training form
  on weights quantized before the call (`fp8.TRAIN_CACHED`) `fp8.Master`s, (E, D, W) and
  (E, F, D) with their copies: each split on E only. Inside a
  manual `axis` or `model_axis` (a user's jax.shard_map): this device's shard.
  Otherwise a `jax.shard_map` over those axes: expert-parallel over `axis`, each group
  of devices along data_axes on its own tokens (no communication), and without an
  expert axis each device runs form (`layer.LAYER`, `fp8.TRAIN`, `fp8.TRAIN_CACHED` or
  `fp8.INFER`), whose
  F must be a multiple of f_multiple on each device."""
  names = (*data_axes, *(() if axis is None else (axis,)))
  split = tuple(a for a in (axis, model_axis) if a is not None)
  mesh = _mesh_with(names + (() if model_axis is None else (model_axis,)),
                    (*jax.tree.leaves(w_down), *jax.tree.leaves(w_gate_up), x))
  # fp8 (values, scales) pairs and weights with their fp8 copies: E split, nothing else
  pairs = not hasattr(w_gate_up, "ndim")
  e = _experts(w_down)
  manual = [a for a in split if a in mesh.manual_axes]
  if manual:
    if len(manual) != len(split):
      raise ValueError(f"inside jax.shard_map over {manual[0]!r} but not over"
                       f" {[a for a in split if a not in manual][0]!r}: run moe_mlp inside"
                       " a shard_map over both axes (local shards), or outside over none")
    if data_axes:  # x is what this device runs: a split of it here would be another's
      raise ValueError(f"data_axes={data_axes} inside jax.shard_map over {manual[0]!r}: x"
                       " is already what this device runs (split tokens over a data axis"
                       " in your shard_map); leave data_axes out")
    return _sharded(plan, x, topk_weights, topk_ids, w_gate_up, w_down, axis=axis,
                    model_axis=model_axis, exchange=exchange, chunks=chunks,
                    form=form)
  if axis is not None and e % mesh.shape[axis]:
    raise ValueError(f"expert parallelism over {axis!r} ({mesh.shape[axis]} devices)"
                     f" splits the experts evenly; got E = {e}")
  if model_axis is not None and w_down.shape[1] % (mesh.shape[model_axis] * f_multiple):
    what = "F evenly" if f_multiple == 1 else f"F in multiples of {f_multiple} (fp8 blocks)"
    raise ValueError(f"tensor parallelism over {model_axis!r} ({mesh.shape[model_axis]}"
                     f" devices) splits {what}; got F = {w_down.shape[1]}")
  n = sharding.size(mesh, names)
  t = x.shape[0]
  topk_ids = topk_ids.astype(jnp.int32)  # -1 below must not wrap in an unsigned dtype
  pad = -t % n  # tokens padded to a multiple of n route nowhere (id -1)
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0)))
    topk_weights = jnp.pad(topk_weights, ((0, pad), (0, 0)))
    topk_ids = jnp.pad(topk_ids, ((0, pad), (0, 0)), constant_values=-1)
  P = jax.sharding.PartitionSpec
  tokens = P(sharding.entry(names))
  specs = (tokens, tokens, tokens) + ((P(axis),) * 2 if pairs else (
      P(axis, None, None, model_axis), P(axis, model_axis)))
  args = (x, topk_weights, topk_ids, w_gate_up, w_down)
  explicit = bool((set(names) | set(split)) & set(getattr(mesh, "explicit_axes", ())))
  if explicit:  # Explicit axes type every value: move them to the split they need
    args = jax.tree.map(lambda spec, arg: jax.tree.map(lambda a: jax.sharding.reshard(
        a, jax.sharding.NamedSharding(mesh, spec)), arg), specs, args,
        is_leaf=lambda s: isinstance(s, P))
  def body(x, weights, ids, w_gate_up, w_down):
    return _sharded(plan, x, weights, ids, w_gate_up, w_down, axis=axis,
                    model_axis=model_axis, exchange=exchange, chunks=chunks,
                    form=form)

  # Manual over every axis of the mesh (values are replicated over the axes not named):
  # a partly manual shard_map leaves the grouped GEMM's partitioning and lax's sharding
  # inference an abstract mesh with Explicit axes, which neither handles.
  out = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tokens)(*args)
  if not pad:
    return out
  if explicit:  # T rows do not split evenly over the axes: the result is replicated
    out = jax.sharding.reshard(out, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
  return out[:t]
