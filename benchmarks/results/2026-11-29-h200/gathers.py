"""The layer's row movements at training sizes, XLA's forms against alternatives, kernel
time (CUPTI) and wall clock, rounds in turns: the gather x[token] (as is, through u32 words), the combine and the dx sum over k (an einsum / a k-term reduction, or k gathers
summed in one loop fusion), and d topk_weights. PYTHONPATH=. ; prints a table."""
import statistics, sys
import jax, jax.numpy as jnp
import numpy as np
from benchmarks import probe
from benchmarks.timing import PipelinedTimer, ratio_stats, rounds_ms

F32 = jnp.float32


def words(x, dtype):
  t, d = x.shape
  n = jnp.dtype(dtype).itemsize // x.dtype.itemsize
  return jax.lax.bitcast_convert_type(x.reshape(t, d // n, n), dtype)


def unwords(w, like):
  t = w.shape[0]
  return jax.lax.bitcast_convert_type(w, like).reshape(t, -1)


def gather_words(x, idx, dtype):
  return unwords(words(x, dtype)[idx], x.dtype)


def combine_einsum(rows, inv, w):
  t, k = w.shape
  picked = rows[inv].reshape(t, k, -1).astype(F32)
  return jnp.einsum("tk,tkd->td", w.astype(F32), picked).astype(rows.dtype)


def combine_loop(rows, inv, w):
  t, k = w.shape
  inv = inv.reshape(t, k)
  acc = w[:, 0:1].astype(F32) * rows[inv[:, 0]].astype(F32)
  for j in range(1, k):
    acc = acc + w[:, j:j + 1].astype(F32) * rows[inv[:, j]].astype(F32)
  return acc.astype(rows.dtype)


def sum_einsum(rows, inv, k):
  return combine_einsum(rows, inv, jnp.ones((inv.shape[0] // k, k), F32))


def sum_loop(rows, inv, k):
  t = inv.shape[0] // k
  inv = inv.reshape(t, k)
  acc = rows[inv[:, 0]].astype(F32)
  for j in range(1, k):
    acc = acc + rows[inv[:, j]].astype(F32)
  return acc.astype(rows.dtype)


def dweights_einsum(rows, inv, g, k):
  t = g.shape[0]
  picked = rows[inv].reshape(t, k, -1).astype(F32)
  return jnp.einsum("tkd,td->tk", picked, g.astype(F32))


def dweights_loop(rows, inv, g, k):
  inv = inv.reshape(g.shape[0], k)
  gf = g.astype(F32)
  return jnp.stack([jnp.sum(rows[inv[:, j]].astype(F32) * gf, axis=-1) for j in range(k)], 1)


def ab(label, fns, args):
  c = {k: jax.jit(f).lower(*args).compile() for k, f in fns.items()}
  outs = {k: f(*args) for k, f in c.items()}
  base = list(c)[0]
  for k, o in outs.items():
    err = float(jnp.max(jnp.abs(o.astype(F32) - outs[base].astype(F32))))
    assert err < 1e-2 * (1 + float(jnp.max(jnp.abs(outs[base].astype(F32))))), (label, k, err)
  t = rounds_ms(PipelinedTimer(), {k: (lambda f=f: f(*args)) for k, f in c.items()}, [()], 9, 20)
  line = f"== {label}:"
  for k, f in c.items():
    kern = probe.ranked_kernels(f, args, 5)
    r = ratio_stats(t[base], t[k])
    line += (f"  {k} {statistics.median(t[k]) * 1e3:.1f} us wall, {kern['kernel_ms'] * 1e3:.1f} us"
             f" kernels in {kern['launches']:.0f} ({r.median:.2f}x ±{r.spread:.2f});")
  print(line, flush=True)


for name, t, k, d in (("qwen3", 8192, 8, 2048), ("gpt-oss", 8192, 4, 2880)):
  key = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(key[0], (t, d), jnp.bfloat16)
  r = t * k
  perm = jax.random.permutation(key[1], r).astype(jnp.int32)   # inverse: a permutation
  token = (jnp.argsort(perm) // k).astype(jnp.int32)
  rows = jax.random.normal(key[2], (r, d), jnp.bfloat16)
  w = jax.random.uniform(key[3], (t, k), F32)
  g = jax.random.normal(key[3], (t, d), jnp.bfloat16)
  ab(f"{name} gather x[token]", {"as is": lambda x, i: x[i],
                                 "u32": lambda x, i: gather_words(x, i, jnp.uint32)}, (x, token))
  ab(f"{name} combine", {"einsum": combine_einsum, "loop": combine_loop}, (rows, perm, w))
  ab(f"{name} dx sum", {"einsum": lambda a, b: sum_einsum(a, b, k),
                        "loop": lambda a, b: sum_loop(a, b, k)}, (rows, perm))
  ab(f"{name} d weights", {"einsum": lambda a, b, c: dweights_einsum(a, b, c, k),
                           "loop": lambda a, b, c: dweights_loop(a, b, c, k)}, (rows, perm, g))
