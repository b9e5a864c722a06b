"""gpt-oss's experts over packed weights: PackedExperts (model/moe.py) with gpt-oss's biases and clamped SwiGLU.

The release's experts are MXFP4 (quant/mxfp4.py; loader/hf_mxfp4.py keeps them packed, one QuantLinear per
expert and projection, gate and up rows de-interleaved and concatenated); `--quantization` packs float gpt-oss
experts the same way (model/quantize.py). The biases are stacked parameters named as ClampedExperts' are
(gate_up_proj_bias [E, 2I] gate | up, down_proj_bias [E, Dm]), so the checkpoint's biases load into them by
name. `run` is the reference: the packed projection, plus the bias, clamped SwiGLU, the packed down projection
plus its bias; the fused C++ op (csrc/moe_experts.h, act MOE_ACT_CLAMPED_SWIGLU) adds each bias in float32
after the products and runs the activation in float32 (float32 models: the reference's values up to float32
rounding of the activation's exponential). `--quantization int8` makes the experts Int8Linears instead: their op is
moe_dense (csrc/moe_dense.cpp, act 1, the stacked biases in the activation dtype), equal to `run` bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from servescope.kernels import fused_ops
from servescope.model.moe import PackedExperts


class PackedClampedExperts(PackedExperts):
    """PackedExperts plus gpt-oss's biases and clamped SwiGLU (limit, alpha: config/moe.py's ExpertsSpec).
    device: where the biases are made ("meta" while the loader builds a model it allocates afterwards)."""

    act = 1  # csrc/moe_experts.h MOE_ACT_CLAMPED_SWIGLU

    def __init__(self, gate_up: list, down: list, limit: float, alpha: float, device=None):
        super().__init__(gate_up, down)
        self.limit, self.alpha = float(limit), float(alpha)
        n, width, hidden = len(gate_up), gate_up[0].out_features // 2, down[0].out_features
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(n, 2 * width, device=device), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.zeros(n, hidden, device=device), requires_grad=False)

    def run(self, e: int, xs: torch.Tensor, out: torch.Tensor) -> None:
        h = fused_ops.clamped_swiglu(self.gate_up[e](xs) + self.gate_up_proj_bias[e], self.limit, self.alpha)
        out.copy_(self.down[e](h) + self.down_proj_bias[e])

    def biases(self) -> tuple:
        return list(self.gate_up_proj_bias.float().unbind(0)), list(self.down_proj_bias.float().unbind(0))

    def expert_bytes(self) -> int:
        biases = self.gate_up_proj_bias[0].numel() + self.down_proj_bias[0].numel()
        return super().expert_bytes() + biases * self.gate_up_proj_bias.element_size()
