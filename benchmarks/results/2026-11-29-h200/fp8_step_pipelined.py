"""The fp8_mlp example's training step (Adam), pipelined: each round runs CALLS steps of a
model back to back and waits once (the host fetches no loss in between, as a training
loop that logs every few steps), the models in rotated order; ratios per round against
bf16, median and half the interquartile range. Beside it the kernels' own time (CUPTI)."""
import functools, statistics, sys, time, json, os
sys.path.insert(0, "examples")
import jax, jax.numpy as jnp
import optax
import fp8_mlp as ex
from pallas_gemm import fp8_dot_general as dg

cfg = dict(ex.FULL)
rounds, calls = int(os.environ.get("AB_ROUNDS", 15)), int(os.environ.get("AB_CALLS", 10))
V = {"bf16": None, "fp8": functools.partial(dg, wgrad="fp8"),
     "fp8-block": functools.partial(dg, wgrad="fp8-block"),
     "fp8-input": functools.partial(dg, wgrad="input")}

def trainer(d):
  kx, kt, kp = jax.random.split(jax.random.key(0), 3)
  model = ex.MLP(cfg["hidden"], cfg["d_out"], d)
  teacher = ex.MLP(cfg["hidden"], cfg["d_out"])
  x = jax.random.normal(kx, (cfg["batch"], cfg["d_in"]), jnp.float32)
  y = teacher.apply(teacher.init(kt, x), x).astype(jnp.float32)
  x = x.astype(jnp.bfloat16)
  params = ex.MLP(cfg["hidden"], cfg["d_out"]).init(kp, x)
  opt = optax.adam(1e-3); state = opt.init(params)
  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  carry = list(step(params, state))
  jax.block_until_ready(carry)
  losses = []
  def run():
    t = time.perf_counter()
    for _ in range(calls):
      carry[0], carry[1], carry[2] = step(carry[0], carry[1])
    jax.block_until_ready(carry[2])
    losses.append(float(carry[2]))
    return (time.perf_counter() - t) * 1e3 / calls
  return run, losses

fns = {v: trainer(d) for v, d in V.items()}
names = list(V)
ms = {v: [] for v in V}
for r in range(rounds):
  for v in names[r % len(names):] + names[:r % len(names)]:
    ms[v].append(fns[v][0]())
print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, {cfg}, {rounds} rounds x {calls} steps")
res = {}
for v in names:
  rat = sorted(b / m for b, m in zip(ms["bf16"][1:], ms[v][1:]))
  q = lambda p: rat[int(p * (len(rat) - 1))]
  res[v] = dict(ms=statistics.median(ms[v][1:]), x_bf16=statistics.median(rat),
                spread=(q(0.75) - q(0.25)) / 2, losses=fns[v][1])
  print(f"{v:12s} {res[v]['ms']:7.3f} ms/step  x bf16 {res[v]['x_bf16']:.3f} +-{res[v]['spread']:.3f}"
        f"  loss after {len(fns[v][1]) * calls} steps {fns[v][1][-1]:.5f}")
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/fp8_step_pipelined.json", "w"))
