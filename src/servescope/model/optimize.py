"""Speed-ups applied after the model is built and loaded (gpt-fast style): they change module
structure, never the checkpoint names the loader copies into.

- fuse_projections: q/k/v -> one qkv_proj, gate/up -> one gate_up_proj (fewer, larger matmuls;
  each output element is the same dot product, so results match the unfused model).
- int8 weight-only quantization (quantize.py), when asked for.
- on the CPU, small-M matmuls (decode) through an AVX-512 GEMV (cpu_kernels.py), and decode-only
  steps through one C++ call for all layers (build_decode_plan).
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
    """On the CPU, route the decoder's small-M matmuls to the AVX-512 GEMV (csrc/cpu_ops.cpp) and
    the larger ones (prefill, big decode batches) to oneDNN's GEMM on prepacked weights."""
    from servescope.kernels import cpu_kernels, cpu_ops

    cpu_ops.load()  # build the extension now (once, ~40 s), not inside the first step's timing
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
    model.cpu_decode_plan, model.cpu_decode_max_rows = build_decode_plan(model)
    return model


def build_decode_plan(model: nn.Module) -> tuple:
    """(the C++ DecodePlan over the model's layers, the most tokens per step it serves), or (None, 0)
    where a layer has a part the plan does not cover.

    The plan issues the same kernels as the modules' forward with the same weights (no copies) and
    the same choice between them (the GEMV up to MAX_ROWS rows, oneDNN's prepacked GEMM above), so
    it serves decode-only steps up to any batch when every projection has a prepacked weight, and up
    to MAX_ROWS where one has not (int8: its larger-M path is eager dequantisation)."""
    from servescope.kernels import cpu_kernels, cpu_ops
    from servescope.model.quantize import Int8Linear

    mod = cpu_ops.load()
    if mod is None:
        return None, 0
    empty = torch.empty(0)

    def opt(t):
        return empty if t is None else t.detach()

    def linear(m):
        """[w, scale, bias f32, packed, bias], the GEMV's row limit, the most rows served"""
        if type(m) is cpu_kernels.CpuLinear and m.weight.dtype == dtype:
            rows = cpu_kernels.MAX_ROWS.get(m.weight.dtype, 0)
            served = rows if m._packed is None else 1 << 30
            return [m.weight.detach(), empty, opt(m._bias_f32), opt(m._packed), opt(m.bias)], rows, served
        if type(m) is Int8Linear:
            rows = cpu_kernels.MAX_ROWS[torch.int8]
            return [m.weight_int8, m._scale_f32, opt(m._bias_f32), empty, empty], rows, rows
        return None

    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    norms_of, layers, gemv_rows, served = [], [], [], []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None:
            return None, 0
        parts = [linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in parts):
            return None, 0
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if hasattr(attn, "q_norm"):
            norms += [attn.q_norm, attn.k_norm]
        norms_of += norms
        qk = [n.weight.detach() for n in norms[2:]] or [empty, empty]
        layers.append([norms[0].weight.detach(), norms[1].weight.detach(), *qk] + [t for p in parts for t in p[0]])
        gemv_rows.append([p[1] for p in parts])
        served += [p[2] for p in parts]
    norms_of.append(model.model.norm)
    if any(n.weight.dtype != dtype or n.eps != cfg.rms_norm_eps for n in norms_of) or dtype not in cpu_ops.DTYPES:
        return None, 0
    plan = mod.DecodePlan(layers, gemv_rows, model.model.norm.weight.detach(), cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.head_dim ** -0.5)
    return plan, min(served)


def optimize_model(model: nn.Module, quantization: str | None = None) -> nn.Module:
    model = fuse_projections(model)
    if quantization == "int8":
        from servescope.model.quantize import quantize_int8

        model = quantize_int8(model)
    if next(model.parameters()).device.type == "cpu":
        model = use_cpu_gemv(model)
    return model
