"""The Llama family in plain PyTorch: Llama 2/3, Mistral, SmolLM; Qwen2 and Qwen3 add small flags.

Shape legend:
  T   tokens in the step (flat, all sequences)     Dm  model width (hidden_size)
  H   query heads, Hkv KV heads, D head dim        I   MLP width (intermediate_size)
  V   vocabulary                                   N, S  KV blocks, block size

Parameter names follow the Hugging Face checkpoint keys (model.layers.{i}.self_attn.o_proj...),
except that q/k/v and gate/up are fused into one matmul each (`qkv_proj`, `gate_up_proj`: fewer,
larger matmuls, each output element the same dot product): `fuse_checkpoint` concatenates the
checkpoint's tensors at load time (gpt-fast's load hook), so loading stays a straight copy.

There is one forward: embed -> layers -> final norm, and one output head (`lm_head`, a module for
tied embeddings too, sharing the embedding's weight). The linear modules are swappable: the
engine's executor replaces them after loading (int8, the CPU GEMV / oneDNN linear, the Triton GEMV)
and decides which kernels serve a step; the model itself never branches on a kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from servescope.config import ModelConfig
from servescope.kernels import fused_ops
from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.layers import RMSNorm, RotaryEmbedding

# (fused module, its parts in the checkpoint, in the order their outputs are concatenated)
FUSED_PROJECTIONS = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                     ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        # output rows: q [H*D] | k [Hkv*D] | v [Hkv*D] (a tensor-parallel shard splits each part)
        self.qkv_sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.qkv_sizes), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's D features of q and k, before rotary
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, cos_sin: tuple, x, kv_cache, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # [T, (H + 2 Hkv) D] -> 3 parts
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
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate | up
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, Dm]


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
        # no random init (the loader fills every parameter): nn.Embedding's own normal_ would, under
        # loader/build.py's meta-device context, import torch._dynamo (1.5-4 s of every start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: Optional[int] = None):
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg)
        with torch.device("cpu"):  # real tables even under a meta-device build (its arange would import dynamo)
            self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                          cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Tied embeddings: the head reads the embedding's weight (one tensor, counted once). Called
        again after anything that re-creates parameters (to_empty from the meta device)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, Dm] after the final norm."""
        h = self.model.embed_tokens(input_ids)  # [T] -> [T, Dm]
        cos_sin = self.rotary.table(positions)  # once per step, shared by all layers
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches):
            h, residual = layer(cos_sin, h, residual, kv, meta, backend)
        norm = self.model.norm
        return fused_ops.add_rms_norm(h, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, Dm] (only the rows whose next token is due) -> logits [B, V] in float32."""
        return self.lm_head(hidden).float()

    def projections(self) -> list:
        """(parent module, attribute, module) of every swappable linear: the decoder layers'
        projections in layer order, then the output head. Transforms (quantisation, kernel choice,
        tensor-parallel shards) walk this list and replace modules in place."""
        out = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [(attn, "qkv_proj", attn.qkv_proj), (attn, "o_proj", attn.o_proj),
                    (mlp, "gate_up_proj", mlp.gate_up_proj), (mlp, "down_proj", mlp.down_proj)]
        return out + [(self, "lm_head", self.lm_head)]

    @staticmethod
    def fuse_checkpoint(state_dict: dict, num_layers: int) -> dict:
        """Checkpoint tensors (HF names) -> this model's names: each layer's q/k/v and gate/up
        weights (and biases) concatenated along the output dimension. A layer missing a part is left
        as it is, so that the build reports exactly which tensor is missing."""
        sd = dict(state_dict)
        for i in range(num_layers):
            for fused, parts in FUSED_PROJECTIONS:
                for kind in ("weight", "bias"):
                    keys = [f"model.layers.{i}.{p}.{kind}" for p in parts]
                    if all(k in sd for k in keys):
                        sd[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([sd.pop(k) for k in keys], dim=0)
        return sd


# One class serves every supported family; the flags in ModelConfig select the differences:
# Mistral and SmolLM are Llama; Qwen2 sets attention_bias; Qwen3 sets qk_norm.
MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
                 "qwen3": LlamaForCausalLM}
