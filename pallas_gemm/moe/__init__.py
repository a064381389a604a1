"""Mixture-of-Experts layers on the grouped GEMM.

    weights, ids = softmax_topk(x @ router, k=8)
    out = moe_mlp(x, weights, ids, w_gate_up, w_down)     # (T, D): SwiGLU experts
    aux = load_balancing_loss(x @ router, ids)

Modules: api.py (moe_mlp: checks and semantics), layer.py (the dataflow and its
gradients, gathers only), parallel.py (expert parallelism: the experts split over a mesh
axis, rows exchanged by all-to-all), fp8.py (the fp8 inference and training forms,
`quantize_experts` and `quantize_experts_for_training`), routing.py (routers and the
load-balancing loss), flax_block.py (a Flax MoE block; needs the `flax` extra, imported
on its own).
"""

from pallas_gemm.moe.api import moe_mlp
from pallas_gemm.moe.fp8 import quantize_experts, quantize_experts_for_training
from pallas_gemm.moe.routing import load_balancing_loss, sigmoid_topk, softmax_topk

__all__ = ["load_balancing_loss", "moe_mlp", "quantize_experts", "quantize_experts_for_training",
           "sigmoid_topk", "softmax_topk"]
