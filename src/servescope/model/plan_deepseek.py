"""DeepSeek-V2/V3's parts of the C++ decode plan (model/transforms.cpu_decode_plan): a latent attention layer as
csrc/decode_plan_mla.h's PlanLatentAttention, DeepSeek's routers and ungated shared experts as
csrc/decode_plan_router.h's PlanDeepseekMoe inside a PlanSparseMlp. Each takes the module's own weights (no
copies) and is built only where the plan computes the module's forward with the same kernels (else None, and the
model runs on its modules as a whole)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from servescope.model.mla import LatentAttention

_NO_PROJECTION = 1 << 62  # rows a plan entry without a projection serves (any)


def latent_attention(mod, attn: LatentAttention, dtype: torch.dtype, eps: float, covers: Callable) -> tuple | None:
    """(the PlanLatentAttention of a latent layer, the most rows it serves, its norms) or None where the plan
    cannot compute it as the module does: a projection the plan cannot issue (covers), kv_b_proj off a plain
    float nn.Linear of the activation dtype on the CPU (its weight is read as W_UK and W_UV), norms of another
    dtype or eps (the caller checks the norms it is given)."""
    lora = hasattr(attn, "q_a_proj")
    linears = ((attn.q_a_proj, attn.q_b_proj) if lora else (attn.q_proj,)) + (attn.kv_a_proj_with_mqa, attn.o_proj)
    kv_b = attn.kv_b_proj
    if (not all(covers(m, dtype) for m in linears) or type(kv_b) is not nn.Linear or kv_b.bias is not None
            or kv_b.weight.dtype != dtype or kv_b.weight.device.type != "cpu"):
        return None
    norms = [attn.q_a_layernorm, attn.kv_a_layernorm] if lora else [attn.kv_a_layernorm]
    if any(n.eps != eps for n in norms):
        return None
    parts = [m.plan_entry(dtype) for m in linears]
    w_uk, w_uv = (w.detach() for w in attn._absorbed())
    plan = mod.PlanLatentAttention([t for p in parts for t in p[0]], [n for p in parts for n in p[1]],
                                   attn.q_a_layernorm.weight.detach() if lora else torch.empty(0),
                                   attn.kv_a_layernorm.weight.detach(), w_uk, w_uv, attn.nope, attn.rope,
                                   attn.interleave, eps, attn.scale)
    return plan, min(p[2] for p in parts), norms


def no_attention_entries() -> list:
    """The qkv and o entries of a latent layer in the DecodePlan's per-layer list: (tensors, limits, rows) as
    plan_entry gives them, empty (the layer's PlanLatentAttention holds its projections)."""
    return [([torch.empty(0)] * 6, [0, 0], _NO_PROJECTION)] * 2


def deepseek_moe(mod, plan, block: nn.Module, dtype: torch.dtype, covers: Callable) -> int | None:
    """Sets DeepSeek's router and shared experts (block: a SparseMoeBlock with router "deepseek_v2" / "deepseek_v3")
    into its PlanSparseMlp `plan`; the most rows the shared experts serve (any: no shared experts), or None where the
    plan cannot compute them as the module does (a router with a bias or off the CPU, shared experts the plan
    cannot issue)."""
    e, gate = block.spec, block.gate
    if type(gate) is not nn.Linear or gate.bias is not None or gate.weight.device.type != "cpu":
        return None
    weight, bias = block._float32_router()  # the float32 copies the block routes with
    shared, limits, rows = [], [], _NO_PROJECTION
    if hasattr(block, "shared_experts"):
        linears = (block.shared_experts.gate_up_proj, block.shared_experts.down_proj)
        if not all(covers(m, dtype) for m in linears):
            return None
        parts = [m.plan_entry(dtype) for m in linears]
        shared, limits = [t for p in parts for t in p[0]], [n for p in parts for n in p[1]]
        rows = min(p[2] for p in parts)
    plan.set_deepseek(weight, torch.empty(0) if bias is None else bias, e.router == "deepseek_v3", e.top_k,
                      e.n_group, e.topk_group, e.norm_topk_prob, e.routed_scaling_factor, shared, limits)
    return rows
