"""The decoder: every supported family in plain PyTorch, built layer by layer from its layer specs.

Shape legend:
  T   tokens in the step (flat, all sequences)     Dm  model width (hidden_size)
  H   query heads, Hkv KV heads, D head dim        I   MLP width (intermediate_size)
  V   vocabulary                                   N, S  KV blocks, block size

A layer is built from its LayerSpec (config/layers.py): the attention module of its kind, the MLP
module of its kind, the norms of its placement (the tables ATTENTION_KINDS and MLP_KINDS below). A
family is a row of config/families.py; it needs code here only when its maths are a new kind.

Parameter names follow the Hugging Face checkpoint keys (model.layers.{i}.self_attn.o_proj...),
except that q/k/v and gate/up are fused into one matmul each (`qkv_proj`, `gate_up_proj`: fewer,
larger matmuls, each output element the same dot product): `fuse_checkpoint` concatenates the
checkpoint's tensors at load time (gpt-fast's load hook), so loading stays a straight copy (a
checkpoint that is fused already, Phi-3's, is copied as it is).

The model exposes the four steps every executor composes: `embed`, `run_layers` (over the layers
this process holds: all of them, or a pipeline stage's), `final_norm`, `compute_logits`; `forward` is
their composition. Its linear modules are swappable: the executor's build replaces them (int8, the
CPU GEMV / oneDNN linear, the Triton GEMV) and decides which kernels serve a step; the model itself
never branches on a kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from servescope.config import LayerSpec, ModelConfig
from servescope.kernels import fused_ops
from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from servescope.model.mla import LatentAttention
from servescope.model.moe import SparseMoeBlock
from servescope.model.moe_checkpoint import stack_expert_checkpoint

# (fused module, its parts in the checkpoint, in the order their outputs are concatenated)
FUSED_PROJECTIONS = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                     ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                     ("mlp.shared_expert.gate_up_proj",
                      ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")),
                     ("mlp.shared_experts.gate_up_proj",  # DeepSeek's (ungated) shared experts
                      ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")))


class Attention(nn.Module):
    """Causal attention over the whole context (kind "full") or over the last `window` positions (kind
    "sliding": the backend skips the keys before the window), GQA, optional q/k/v bias and q/k norm."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_scale
        self.window = spec.attention.window  # 0: the whole context
        self.softcap = spec.attention.softcap  # 0: the scores go into the softmax as they are
        if spec.attention.sinks:  # gpt-oss: one learned logit per query head in the softmax's denominator
            self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads))
        # output rows: q [H*D] | k [Hkv*D] | v [Hkv*D] (a tensor-parallel shard splits each part)
        self.qkv_sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.qkv_sizes), bias=spec.attention.bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=spec.attention.out_bias)
        self.qk_norm_all_heads = spec.attention.qk_norm_all_heads  # OLMoE: over [H*D] and [Hkv*D] at once
        if spec.attention.qk_norm:  # Qwen3: RMSNorm over each head's D features of q and k, before rotary
            widths = (cfg.q_size, cfg.kv_size) if self.qk_norm_all_heads else (cfg.head_dim, cfg.head_dim)
            self.q_norm = RMSNorm(widths[0], cfg.rms_norm_eps)
            self.k_norm = RMSNorm(widths[1], cfg.rms_norm_eps)

    def projections(self) -> list:
        return [(self, "qkv_proj", self.qkv_proj), (self, "o_proj", self.o_proj)]

    def forward(self, cos_sin: tuple, x, kv_cache, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # [T, (H + 2 Hkv) D] -> 3 parts
        if self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H*D] -> [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv*D] -> [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm") and not self.qk_norm_all_heads:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = RotaryEmbedding.apply(cos_sin, q, k)
        k_cache, v_cache = kv_cache
        meta = meta.for_window(self.window)  # a cache with a block table per group: this layer's group's
        backend.store_kv(k, v, k_cache, v_cache, meta)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.window,  # [T, H, D]
                            softcap=self.softcap, sinks=getattr(self, "sinks", None))
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))  # [T, H*D] -> [T, Dm]


ATTENTION_KINDS = {"full": Attention, "sliding": Attention,  # the window is the spec's
                   "latent": LatentAttention}  # DeepSeek's MLA (model/mla.py)
MLP_KINDS = {"dense": GatedMLP, "moe": SparseMoeBlock}


class DecoderLayer(nn.Module):
    """Pre-norm: input_layernorm -> attention -> residual add, post_attention_layernorm -> MLP. Sandwich
    (Gemma 2/3, Hugging Face's names): input_layernorm -> attention -> post_attention_layernorm -> residual
    add, pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm (its residual add in the next norm)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.sandwich = spec.norm == "sandwich"
        self.self_attn = ATTENTION_KINDS[spec.attention.kind](cfg, spec)
        self.mlp = MLP_KINDS[spec.mlp.kind](cfg, spec)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def projections(self) -> list:
        """(parent module, attribute, module) of this layer's swappable linears: attention's, then the MLP's."""
        return [*self.self_attn.projections(), *self.mlp.projections()]

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
        if self.sandwich:
            attn, ln = self.post_attention_layernorm(attn), self.pre_feedforward_layernorm
        else:
            ln = self.post_attention_layernorm
        x, residual = fused_ops.add_rms_norm(attn, residual, ln.weight, ln.eps)
        out = self.mlp(x)
        return (self.post_feedforward_layernorm(out) if self.sandwich else out), residual


class Backbone(nn.Module):
    """`model.*` in the checkpoint: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # no random init (the loader fills every parameter): nn.Embedding's own normal_ would, under
        # loader/build.py's meta-device context, import torch._dynamo (1.5-4 s of every start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec) for spec in cfg.layer_specs())
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: Optional[int] = None):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        with torch.device("cpu"):  # real tables even under a meta-device build (its arange would import dynamo)
            self.rotary = rotary_for(cfg, max_positions)
            self.rotary_local = local_rotary_for(cfg, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Tied embeddings: the head reads the embedding's weight (one tensor, counted once). Called
        again after anything that re-creates parameters (to_empty from the meta device)."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # (not a packed head)
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---------------------------------------------------------------- the four steps of a forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> h [T, Dm] (Gemma: times sqrt(Dm) rounded to the activation dtype, as transformers)."""
        h = self.model.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        return h

    def run_layers(self, h: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                   kv_caches: list, meta: AttentionMetadata, backend: AttentionBackend) -> tuple:
        """The layers this model holds (a pipeline stage: its own) over (h, residual) [T, Dm] -> the
        same after the last of them (residual None: h is the embeddings). kv_caches: one per held layer."""
        cos_sin = self.rotary.table(positions)  # once per call, shared by the layers
        local = self.rotary_local.table(positions) if self.rotary_local is not None else None
        for layer, kv in zip(self.model.layers, kv_caches):
            h, residual = layer(local if layer.spec.attention.rope_theta else cos_sin, h, residual, kv, meta, backend)
        return h, residual

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's (h, residual) -> hidden [T, Dm] (the residual add fused into the norm)."""
        norm = self.model.norm
        return fused_ops.add_rms_norm(h, residual, norm.weight, norm.eps)[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, Dm] after the final norm: the composition of
        the steps above, as the eager executor runs it."""
        h, residual = self.run_layers(self.embed(input_ids), None, positions, kv_caches, meta, backend)
        return self.final_norm(h, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, Dm] (only the rows whose next token is due) -> logits [B, V] in float32 (Gemma 2:
        soft-capped, cap * tanh(logits / cap))."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def projections(self) -> list:
        """(parent module, attribute, module) of every swappable linear: the decoder layers'
        projections in layer order, then the output head. Transforms (quantisation, kernel choice,
        tensor-parallel shards) walk this list and replace modules in place."""
        return [p for layer in self.model.layers for p in layer.projections()] + [(self, "lm_head", self.lm_head)]

    @staticmethod
    def fuse_checkpoint(state_dict: dict, num_layers: int) -> dict:
        """Checkpoint tensors (HF names) -> this model's names: each layer's q/k/v and gate/up
        weights (and biases) concatenated along the output dimension. A layer missing a part is left
        as it is, so that the build reports exactly which tensor is missing."""
        sd = stack_expert_checkpoint(dict(state_dict))  # per-expert tensors -> stacked (model/moe_checkpoint.py)
        for i in range(num_layers):
            for fused, parts in FUSED_PROJECTIONS:
                for kind in ("weight", "bias"):
                    keys = [f"model.layers.{i}.{p}.{kind}" for p in parts]
                    if all(k in sd for k in keys):
                        sd[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([sd.pop(k) for k in keys], dim=0)
        return sd


def rotary_for(cfg: ModelConfig, max_positions: Optional[int] = None) -> RotaryEmbedding:
    """The rotary tables of cfg for positions up to max_positions (the model's context by default)."""
    return RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                           cfg.rope_scaling, context=cfg.max_position_embeddings)


def local_rotary_for(cfg: ModelConfig, max_positions: Optional[int] = None) -> Optional[RotaryEmbedding]:
    """The tables of the layers with their own rotary base (Gemma 3's local layers: plain rope at
    rope_local_theta), None when every layer uses the model's."""
    if cfg.rope_local_theta is None:
        return None
    return RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_local_theta, None)
