"""Speed-ups applied after the model is built and loaded (gpt-fast style): they change module
structure, never the checkpoint names the loader copies into.

- fuse_projections: q/k/v -> one qkv_proj, gate/up -> one gate_up_proj (fewer, larger matmuls;
  each output element is the same dot product, so results match the unfused model).
- int8 weight-only quantization (quantize.py), when asked for.
- on the CPU, small-M matmuls (decode) through an AVX-512 GEMV (cpu_kernels.py).
"""

from __future__ import annotations

import torch
from torch import nn

from servescope.model.llama import LlamaAttention, LlamaMLP


def _fused_linear(parts: list, bias: bool) -> nn.Linear:
    w = torch.cat([p.weight for p in parts], dim=0)  # [sum(out), in]
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(torch.cat([p.bias for p in parts]))
    lin.requires_grad_(False)
    return lin


def fuse_projections(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, LlamaAttention) and m.qkv_proj is None:
            m.qkv_proj = _fused_linear([m.q_proj, m.k_proj, m.v_proj], bias=m.q_proj.bias is not None)
            del m.q_proj, m.k_proj, m.v_proj
        elif isinstance(m, LlamaMLP) and m.gate_up_proj is None:
            m.gate_up_proj = _fused_linear([m.gate_proj, m.up_proj], bias=False)
            del m.gate_proj, m.up_proj
    return model


def use_cpu_gemv(model: nn.Module) -> nn.Module:
    """On the CPU, route the decoder's small-M matmuls to the AVX-512 GEMV (csrc/cpu_gemv.cpp) and
    the larger ones (prefill, big decode batches) to oneDNN's GEMM on prepacked weights."""
    from servescope.model import cpu_kernels, cpu_ops

    cpu_ops.load()  # build both extensions now (once, ~30 s each), not inside the first step's timing
    if not cpu_kernels.available():
        return model
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, cpu_kernels.CpuLinear(child))
    model.cpu_gemv = True
    if model.int8_head is None:
        model.cpu_head_packed = cpu_kernels.pack_for_onednn(model.lm_head_weight())
    return model


def optimize_model(model: nn.Module, quantization: str | None = None) -> nn.Module:
    model = fuse_projections(model)
    if quantization == "int8":
        from servescope.model.quantize import quantize_int8

        model = quantize_int8(model)
    if next(model.parameters()).device.type == "cpu":
        model = use_cpu_gemv(model)
    return model
