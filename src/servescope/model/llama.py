"""The Llama family in plain PyTorch: Llama 2/3, Mistral, SmolLM; Qwen2 and Qwen3 add small flags.

Shape legend:
  T   tokens in the step (flat, all sequences)     Dm  model width (hidden_size)
  H   query heads, Hkv KV heads, D head dim        I   MLP width (intermediate_size)
  V   vocabulary                                   N, S  KV blocks, block size

Parameter names follow the Hugging Face checkpoint keys (model.layers.{i}.self_attn.q_proj...),
so loading is a straight copy. Speed-ups that change the module structure (fused q/k/v and
gate/up projections, int8 weights) are applied after loading by `optimize.py`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from servescope.config import ModelConfig
from servescope.kernels import cpu_kernels, cpu_ops, fused_ops
from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.layers import RMSNorm, RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's D features of q and k, before rotary
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qkv_proj: Optional[nn.Linear] = None  # set by optimize.fuse_projections

    def project_qkv(self, x: torch.Tensor):
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return qkv.split([q_size, kv_size, kv_size], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, cos_sin: tuple, x, kv_cache, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project_qkv(x)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H*D] -> [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv*D] -> [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = RotaryEmbedding.apply(cos_sin, q, k)
        k_cache, v_cache = kv_cache
        backend.store_kv(k, v, k_cache, v_cache, meta)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))  # [T, H*D] -> [T, Dm]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: Optional[nn.Linear] = None  # set by optimize.fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj(fused_ops.silu_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, Dm]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, cos_sin, h, residual, kv_cache, meta, backend):
        """h: this layer's input before the residual add of the previous layer's MLP output
        (residual None for the first layer). Returns (mlp output, residual stream) so that each
        residual add is fused into the following norm."""
        ln = self.input_layernorm
        if residual is None:
            residual, x = h, ln(h)
        else:
            x, residual = fused_ops.add_rms_norm(h, residual, ln.weight, ln.eps)
        attn = self.self_attn(cos_sin, x, kv_cache, meta, backend)
        ln = self.post_attention_layernorm
        x, residual = fused_ops.add_rms_norm(attn, residual, ln.weight, ln.eps)
        return self.mlp(x), residual


class LlamaBackbone(nn.Module):
    """`model.*` in the checkpoint: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: Optional[int] = None):
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.int8_head: Optional[nn.Module] = None  # set by quantize.quantize_int8
        self.cpu_gemv = False  # set by optimize.use_cpu_gemv
        self.cpu_head_packed = None  # the output head in oneDNN's layout (optimize.use_cpu_gemv)
        # all layers of a decode-only step in one C++ call (optimize.build_decode_plan), up to this many tokens
        self.cpu_decode_plan = None
        self.cpu_decode_max_rows = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, Dm] after the final norm."""
        h = self.model.embed_tokens(input_ids)  # [T] -> [T, Dm]
        cos_sin = self.rotary.table(positions)  # once per step, shared by all layers
        if (self.cpu_decode_plan is not None and meta.is_decode_only and h.shape[0] <= self.cpu_decode_max_rows
                and backend.name == "torch" and not torch.is_grad_enabled()
                and kv_caches[0][0].dtype in cpu_ops.DTYPES):
            # the same kernels as the loop below, issued from C++ (no Python per layer)
            return self.cpu_decode_plan.run(h, *cos_sin, kv_caches, meta.slot_mapping, meta.block_tables,
                                            meta.context_lens)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches):
            h, residual = layer(cos_sin, h, residual, kv, meta, backend)
        norm = self.model.norm
        return fused_ops.add_rms_norm(h, residual, norm.weight, norm.eps)[0]

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, Dm] (only the rows whose next token is due) -> logits [B, V] in float32."""
        if self.int8_head is not None:
            return self.int8_head(hidden).float()
        w = self.lm_head_weight()
        if self.cpu_gemv and cpu_kernels.use_gemv(hidden, w):
            return cpu_kernels.gemv(hidden, w)
        if self.cpu_head_packed is not None and hidden.dtype == w.dtype:
            return cpu_kernels.onednn_linear(hidden, self.cpu_head_packed).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()


# One class serves every supported family; the flags in ModelConfig select the differences:
# Mistral and SmolLM are Llama; Qwen2 sets attention_bias; Qwen3 sets qk_norm.
MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
                 "qwen3": LlamaForCausalLM}
