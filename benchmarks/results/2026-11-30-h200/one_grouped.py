"""One call of the block-scaled fp8 grouped kernel at M x N x K in G equal groups (for ncu)."""
import sys
import jax, jax.numpy as jnp
from pallas_gemm.fp8 import quantize, mosaic_ragged
m, n, k, g = (int(v) for v in sys.argv[1].split("x"))
kx, kw = jax.random.split(jax.random.key(0))
a8, sa = quantize(jax.random.normal(kx, (m, k), jnp.bfloat16))
b8, sb = quantize(jax.random.normal(kw, (n, k), jnp.bfloat16), block_shape=(128, 128))
w8 = jnp.broadcast_to(b8[None], (g, n, k)).copy()
sw = jnp.broadcast_to(sb[None], (g,) + sb.shape).copy()
sizes = jnp.full((g,), m // g, jnp.int32)
f = jax.jit(lambda a, b, gs, s1, s2: mosaic_ragged.ragged_gemm(a, b, gs, s1, s2))
jax.block_until_ready(f(a8, w8, sizes, sa, sw))
