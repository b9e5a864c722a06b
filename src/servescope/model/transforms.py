"""Transforms applied to a built model before its first step (gpt-fast's style): they swap modules
or assemble kernels over the model's weights, never change a checkpoint name, and are chosen by the
engine's executor (engine/executor.py), not by the model.

- use_cpu_linears: on the CPU, every projection and the output head become CpuLinear (the decode
  GEMV up to a few rows, float32's panel GEMM up to a few hundred, oneDNN's GEMM on prepacked weights
  above).
- cpu_decode_plan: the C++ DecodePlan that runs all layers of a decode-only step in one call with the
  same kernels and the same weights as the modules (no copies), wrapped as DecodePlanLayers: the
  model's own `run_layers` signature, so an executor composes it with `embed` and `final_norm` as it
  composes the model's. Sparse layers are in it where their experts run on a fused op (`_sparse_mlp`: packed,
  float or per-channel int8 experts; gpt-oss's biased router and clamped experts, packed or float); gpt-oss's
  attention sinks go to the paged decode kernel, its q/k/v and o_proj biases with their projections; Gemma 2 / 3's
  sandwich norms, GELU-tanh MLP, soft-caps and local rotary tables are set per layer (model/plan_gemma.py).
Quantisation is model/quantize.py (quantize_int8), applied before these.
"""

from __future__ import annotations

import torch
from torch import nn

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears.cpu import CpuLinear
from servescope.model.linears.int8 import Int8Linear
from servescope.model.linears.packed import QuantLinear
from servescope.model.mla import LatentAttention
from servescope.model.moe import Experts, PackedExperts, SparseMoeBlock
from servescope.model.plan_deepseek import deepseek_moe, latent_attention, no_attention_entries
from servescope.model.plan_gemma import gemma_parts, layer_norms


PLAN_ROUTERS = ("softmax_topk", "gpt_oss", "deepseek_v2", "deepseek_v3")  # the routers PlanSparseMlp runs


def use_cpu_linears(model: nn.Module) -> nn.Module:
    """Route the dense projections and the head through CpuLinear (int8 modules keep their own path)."""
    for parent, name, child in model.projections():
        if type(child) is nn.Linear:
            setattr(parent, name, CpuLinear(child, float_output=name == "lm_head"))
    return model


class DecodePlanLayers:
    """The model's layers as one C++ call, for decode-only steps (one token per sequence) of up to
    max_rows sequences on a cache the C++ kernels read."""

    def __init__(self, plan, max_rows: int, rotary, segments: tuple = (), sparse: dict | None = None,
                 rotary_local=None, window: int = 0):
        """segments: (first layer, end, window, plan of those layers) for each run of consecutive layers of one
        window: a cache with a block table per group of layers (kvcache/hybrid.py) runs them in turn, each on
        its group's tables; the same kernels in the same order as the one plan of all layers. sparse: {layer
        index: its PlanSparseMlp} (what the kernel table times as the plan runs it: measure/moe_kernels.py).
        rotary_local: the tables of the layers with their own rotary base (Gemma 3's local layers), None: none."""
        self.plan, self.max_rows, self.rotary, self.segments = plan, max_rows, rotary, segments
        self.window = window  # of every layer, where there are no segments
        self.sparse, self.rotary_local = sparse or {}, rotary_local

    def serves(self, meta, num_tokens: int, kv_caches: list, backend) -> bool:
        return (meta.is_decode_only and num_tokens <= self.max_rows and backend.name == "torch"
                and not torch.is_grad_enabled() and kv_caches[0][0].dtype in cpu_ops.KV_DTYPES)

    def run_layers(self, h, residual, positions, kv_caches: list, meta, backend=None) -> tuple:
        """As CausalLM.run_layers: (h, residual) [T, Dm] in and out (residual None: h is the embeddings)."""
        cos, sin = self.rotary.table(positions)
        empty = h.new_empty(0)
        local = self.rotary_local.table(positions) if self.rotary_local is not None else (empty, empty)
        if not meta.window_groups or not self.segments:  # one table, or layers of one window (a pipeline stage
            # may hold one kind of layer): the one plan on that window's group's tables
            m = meta.for_window(self.window)
            return self.plan.run_layers(h, empty if residual is None else residual, cos, sin, kv_caches,
                                        m.slot_mapping, m.block_tables, m.context_lens, *local)
        for lo, hi, window, plan in self.segments:
            m = meta.for_window(window)
            h, residual = plan.run_layers(h, empty if residual is None else residual, cos, sin, kv_caches[lo:hi],
                                          m.slot_mapping, m.block_tables, m.context_lens, *local)
        return h, residual


def cpu_decode_plan(model: nn.Module):
    """DecodePlanLayers over the model's layers, or None where the extension is not built or a layer has
    a part the plan does not cover.

    The plan issues the same kernels as the modules' forward with the same weights and the same choice
    between them (the GEMV up to its row limit, the panel GEMM up to its own, oneDNN's prepacked GEMM
    above), so it serves decode-only steps up to any batch when every projection has a prepacked weight,
    and up to the GEMV's or the panel GEMM's limit where one has not (int8: its larger-M path is eager
    dequantisation)."""
    mod = cpu_ops.load()
    if mod is None:
        return None
    cfg = model.config
    if not all(_plan_covers_layer(layer.spec) for layer in model.model.layers):
        return None
    dtype = model.model.norm.weight.dtype  # (the embedding may be packed)
    empty = torch.empty(0)
    norms_of, layers, limits, sparse, served, latents, sinks, gemma = [], [], [], [], [], {}, [], {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        gemma[i] = gemma_parts(model, layer)  # () where the layer has none of Gemma's parts
        if gemma[i] is None:
            return None
        latent = isinstance(attn, LatentAttention)  # its PlanLatentAttention holds its projections
        own = () if latent else (attn.qkv_proj, attn.o_proj)
        sinks.append(attn.sinks.detach().float().contiguous() if hasattr(attn, "sinks") else empty)
        if isinstance(mlp, SparseMoeBlock):  # its MLP a PlanSparseMlp, the dense MLP's entries left empty
            part = _sparse_mlp(mod, mlp, dtype)
            if part is None:
                return None
            sparse.append(part[0])
            served.append(part[1])
            linears = own
        else:
            sparse.append(None)
            linears = (*own, mlp.gate_up_proj, mlp.down_proj)
        if not all(_plan_covers(m, dtype) for m in linears):
            return None
        parts = [m.plan_entry(dtype) for m in linears]
        if latent:
            part = latent_attention(mod, attn, dtype, cfg.rms_norm_eps, _plan_covers)
            if part is None:
                return None
            latents[i], norms_of = part[0], norms_of + part[2]
            served.append(part[1])
            parts = no_attention_entries() + parts
        norms = layer_norms(layer)  # (Gemma's sandwich: four; the last two go to set_gemma)
        # q/k norms: per head, or over all heads (the plan reads which from the widths)
        qk_norms = [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
        norms_of += norms + qk_norms
        qk = [n.weight.detach() for n in qk_norms] or [empty, empty]
        unused = [empty] * 6 * (4 - len(parts))
        layers.append([norms[0].weight.detach(), norms[1].weight.detach(), *qk]
                      + [t for p in parts for t in p[0]] + unused)
        limits.append([n for p in parts for n in p[1]] + [0] * (8 - 2 * len(parts)))
        served += [p[2] for p in parts]
    if any(n.weight.dtype != dtype or n.eps != cfg.rms_norm_eps for n in norms_of) or dtype not in cpu_ops.DTYPES:
        return None
    windows = [getattr(layer.self_attn, "window", 0) for layer in model.model.layers]
    args = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.attention_scale)

    def plan_of(lo: int, hi: int):  # the DecodePlan of layers lo..hi-1, their latent and Gemma parts set
        plan = mod.DecodePlan(layers[lo:hi], limits[lo:hi], windows[lo:hi], sparse[lo:hi], *args, sinks[lo:hi])
        for i in range(lo, hi):
            if i in latents:
                plan.set_latent(i - lo, latents[i])
            if gemma[i]:
                plan.set_gemma(i - lo, *gemma[i])
        return plan

    segments, lo = [], 0
    for i in range(1, len(windows) + 1):  # runs of consecutive layers of one window
        if len(set(windows)) > 1 and (i == len(windows) or windows[i] != windows[lo]):
            segments.append((lo, i, windows[lo], plan_of(lo, i)))
            lo = i
    local = any(g and g[-1] for g in gemma.values())
    return DecodePlanLayers(plan_of(0, len(layers)), min(served), model.rotary, tuple(segments),
                            {i: m for i, m in enumerate(sparse) if m is not None},
                            model.rotary_local if local else None, windows[0] if not segments else 0)


def _sparse_mlp(mod, block: SparseMoeBlock, dtype: torch.dtype):
    """(the C++ PlanSparseMlp of a sparse layer, the most rows it serves), or None where the plan cannot compute
    it as the module does: a router other than the softmax top-k, gpt-oss's and DeepSeek's, expert parallelism,
    experts off a fused op (mixed formats, the fused op switched off; packed experts above their row limit: the
    module's grouped_experts). DeepSeek's routers and ungated shared experts: plan_deepseek. The experts may be
    packed (MoePacked), float or per-channel int8 (MoeDense), gpt-oss's with their biases and clamped SwiGLU on
    either op. The plan counts each step's tokens per expert into the block's own `routed_tokens`, as the module
    does (the step record's source)."""
    experts, router = block.experts, block.spec.router
    deepseek, gpt_oss = router in ("deepseek_v2", "deepseek_v3"), router == "gpt_oss"
    if (router not in PLAN_ROUTERS or block.expert_parallel is not None
            or (hasattr(block, "shared_experts") and not deepseek)
            or not (deepseek or _plain_router(block.gate, dtype, biased=gpt_oss))
            or not isinstance(experts, (Experts, PackedExperts))):
        return None
    op, rows = experts.fused_op(), experts.fused_rows(dtype)
    if op is None or rows < 1:
        return None
    if deepseek:  # its router routes in float32 (the block's own float32 copy of the weight)
        plan = mod.PlanSparseMlp(block._float32_router()[0], block.top_k, False, op, block.routed_tokens, [], [],
                                 torch.empty(0))
        shared_rows = deepseek_moe(mod, plan, block, dtype, _plan_covers)
        return None if shared_rows is None else (plan, min(rows, shared_rows))
    shared, limits, gate = [], [], torch.empty(0)
    if hasattr(block, "shared_expert"):  # Qwen2-MoE's, scaled by sigmoid(shared_expert_gate(x))
        linears = (block.shared_expert.gate_up_proj, block.shared_expert.down_proj)
        if not all(_plan_covers(m, dtype) for m in linears) or not _plain_router(block.shared_expert_gate, dtype):
            return None
        parts = [m.plan_entry(dtype) for m in linears]
        shared, limits = [t for p in parts for t in p[0]], [n for p in parts for n in p[1]]
        rows = min(rows, *(p[2] for p in parts))
        gate = block.shared_expert_gate.weight.detach()
    plan = mod.PlanSparseMlp(block.gate.weight.detach(), block.top_k, block.renormalise, op, block.routed_tokens,
                             shared, limits, gate)
    if gpt_oss:
        plan.use_gpt_oss_router(block.gate.bias.detach())
    return plan, rows


def _plain_router(m: nn.Module, dtype: torch.dtype, biased: bool = False) -> bool:
    """An nn.Linear in the activation dtype on the CPU (a router, the shared expert's gate), with a bias where
    `biased` (gpt-oss's router), else without."""
    return (type(m) is nn.Linear and (m.bias is not None) == biased and m.weight.dtype == dtype
            and m.weight.device.type == "cpu" and (m.bias is None or m.bias.dtype == dtype))


def _plan_covers_layer(spec) -> bool:
    """A layer the plan computes as the modules do: pre-norm or Gemma's sandwich, a dense silu or GELU-tanh MLP or
    silu experts behind the softmax top-k router, gpt-oss's or DeepSeek's (`_sparse_mlp` checks the modules), the
    model's rotary tables or the local ones (Gemma 3), a softmax with or without sinks, with or without soft-capped
    scores, q/k norms per head or over all heads, biases on q/k/v and o_proj, DeepSeek's latent attention
    (plan_deepseek; Gemma's parts: plan_gemma)."""
    m = spec.mlp
    if spec.norm not in ("pre", "sandwich"):
        return False
    if m.kind == "moe":
        return m.activation == "silu" and m.experts.router in PLAN_ROUTERS
    return m.kind == "dense" and m.activation in ("silu", "gelu_pytorch_tanh")


def _plan_covers(m: nn.Module, dtype: torch.dtype) -> bool:
    """A module the plan can issue itself: a CpuLinear of the activation dtype, or an int8 / packed linear."""
    return (type(m) is CpuLinear and m.weight.dtype == dtype) or type(m) in (Int8Linear, QuantLinear)
