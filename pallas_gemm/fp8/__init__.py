"""fp8 matmul with block scales, in jax.nn.scaled_matmul's convention.

    values, scales = quantize(x)                            # 1x128 blocks, e4m3
    xt8, xt_scales = quantize(x, transpose=True)            # x^T's, reading x in place
    w8, w_scales = quantize(w_nk, block_shape=(128, 128))   # weights, K-major (N, K)
    out = scaled_matmul(values, w8, scales, w_scales)       # (B, M, N) float32
    nn.Dense(features, dot_general=fp8_dot_general)         # training in fp8
    scaled_ragged_dot(values, w8_gnk, group_sizes, scales, w_scales)   # MoE experts
    gated_quantized(values, w8_gate_up, group_sizes, scales, w_scales, "silu")  # act, fp8

Modules, imported one way (checks -> scales; quantize -> mosaic_quantize; api -> xla):
checks.py (operand, scale and dtype checks, the backend choice), scales.py (the scale
layouts, dequantize, the power-of-two scale arithmetic), quantize.py (quantize and its
backend choice), api.py (scaled_matmul), xla.py (dequantize + float32 dot: the reference
and CPU path), mosaic_gemm.py (the Hopper kernel), mosaic_quantize.py (the Hopper kernel
of quantize: 1x128 and 128x128 blocks, x read in place or transposed),
layer.py (fp8_dot_general and its backward GEMMs), ragged.py
and mosaic_ragged.py (scaled_ragged_dot and its Hopper kernel), gated.py and
mosaic_gated.py (a gated expert MLP's first grouped GEMM, activation and quantize of its
output as one kernel: moe_mlp's fp8 inference form). The promoted K loop the kernels share
is `pallas_gemm.mgpu.scaled_k`.
"""

from pallas_gemm.fp8.api import scaled_matmul
from pallas_gemm.fp8.gated import gated_kernel_reason, gated_quantized
from pallas_gemm.fp8.layer import fp8_dot_general
from pallas_gemm.fp8.ragged import scaled_ragged_dot
from pallas_gemm.fp8.quantize import quantize
from pallas_gemm.fp8.scales import INPUT_DTYPES, dequantize  # INPUT_DTYPES: what quantize takes

__all__ = ["INPUT_DTYPES", "dequantize", "fp8_dot_general", "gated_kernel_reason",
           "gated_quantized", "quantize", "scaled_matmul", "scaled_ragged_dot"]
