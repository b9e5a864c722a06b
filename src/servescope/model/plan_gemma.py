"""Gemma 2 / Gemma 3's parts of the C++ decode plan (model/transforms.cpu_decode_plan): a layer's sandwich norms,
GELU-tanh MLP, attention soft-cap and local rotary tables, as csrc/decode_plan_gemma.h's PlanGemmaLayer set by
DecodePlan.set_gemma. The module's own weights and attributes (no copies): Gemma's (1 + w) norms hold the 1 added
at load (loader/build.py), so they are plain RMSNorm weights; the scaled embeddings and the final logit soft-cap
are the model's embed and compute_logits, outside the layers the plan runs."""

from __future__ import annotations

import torch
from torch import nn

from servescope.kernels import fused_ops


def layer_norms(layer: nn.Module) -> list:
    """The layer's RMSNorms in the plan's order: its first norm, the norm before the MLP (post_attention_layernorm
    of a pre-norm layer, pre_feedforward_layernorm of the sandwich), then the sandwich's post_attention_layernorm
    and post_feedforward_layernorm."""
    if getattr(layer, "sandwich", False):
        return [layer.input_layernorm, layer.pre_feedforward_layernorm, layer.post_attention_layernorm,
                layer.post_feedforward_layernorm]
    return [layer.input_layernorm, layer.post_attention_layernorm]


def gemma_parts(model: nn.Module, layer: nn.Module) -> tuple | None:
    """DecodePlan.set_gemma's arguments after the layer index (post_attn, post_ff, gelu_tanh, softcap, local_rope)
    for a layer with any of Gemma's parts, () for a layer with none, None where the plan cannot compute the layer
    as the module does (an MLP activation other than silu and GELU-tanh, a local rotary base and no local
    tables)."""
    attn, mlp = layer.self_attn, layer.mlp
    act = getattr(mlp, "act_mul", fused_ops.silu_mul)  # (a sparse MLP's experts: silu, or the fused op's own)
    if act not in (fused_ops.silu_mul, fused_ops.gelu_tanh_mul):
        return None
    gelu, softcap = act is fused_ops.gelu_tanh_mul, float(getattr(attn, "softcap", 0.0))
    local = bool(layer.spec.attention.rope_theta)  # the module rotates such a layer with model.rotary_local
    if local and getattr(model, "rotary_local", None) is None:
        return None
    norms = layer_norms(layer)
    if not (len(norms) > 2 or gelu or softcap or local):
        return ()
    empty = torch.empty(0)
    post = [n.weight.detach() for n in norms[2:]] or [empty, empty]
    return (*post, gelu, softcap, local)
