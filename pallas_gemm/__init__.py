"""pallas_gemm: the fastest GEMM on NVIDIA GPUs as one jittable JAX function.

    out = pallas_gemm.gemm(a, b)                    # picks the fastest backend here
    pallas_gemm.backends()                          # {name: None | why it cannot run}
    pallas_gemm.dot_general(x, w, dims)             # lax.dot_general's signature (Flax, einsum)
    pallas_gemm.dense(x, w, bias, "gelu")           # a layer with the fused epilogue
    pallas_gemm.dense(z, w, bias, input_activation="gelu")  # the layer after GELU: gelu'
                                                    # fused into its backward GEMM
    pallas_gemm.mlp(x, w1, b1, w2, b2, "gelu")      # both: GELU and GELU' in epilogues

Backends, one module each: `xla` (jnp.dot; reference and CPU path), `triton` (Pallas,
Triton lowering; Ampere and newer), `mosaic` (Pallas Mosaic GPU: TMA + wgmma; Hopper),
`cuda` (hand-written register-tiled SGEMM as an XLA FFI custom call).
"""

from pallas_gemm.matmul.api import gemm
from pallas_gemm.matmul.auto import BACKENDS, BackendUnavailableError, backends
from pallas_gemm.matmul.layers import dense, mlp
from pallas_gemm.matmul.lax_dot import dot_general
# The function takes its package's name as an attribute: the package's modules stay
# importable with `from pallas_gemm.fp8 import api` (not `import ... as`).
from pallas_gemm.grouped import ragged_dot, ragged_dot_general
from pallas_gemm.fp8 import (dequantize, fp8_dot_general, quantize, scaled_matmul,
                              scaled_ragged_dot)
from pallas_gemm.matmul.tuning import autotune
from pallas_gemm.moe import moe_mlp

__all__ = ["BACKENDS", "BackendUnavailableError", "autotune", "backends", "dense", "dequantize",
           "dot_general", "fp8_dot_general", "gemm", "mlp", "moe_mlp", "quantize", "ragged_dot",
           "ragged_dot_general", "scaled_matmul", "scaled_ragged_dot"]
__version__ = "0.1.0"
