"""What multi-head latent attention (DeepSeek's MLA: config/mla.py, model/mla.py) costs: its projections'
weight bytes and FLOPs, and its attention FLOPs by step shape.

The engine runs decode rows in the absorbed form and prefill rows expanded (model/mla.py), so the two cost
differently per key:
- a decode row (one query, c cached keys): W_UK folded into the query (2 H n r) and W_UV after attention
  (2 H r v), and an attention of H heads over one latent head of width r + R, the latent rows serving as
  values too (the kernel's values are the whole row): 2 H (r + R) per key for q.k and as much for p.v;
- a prefill chunk (n queries after c cached tokens): kv_b_proj expands all c + n latents to per-head k_nope
  and v (2 (c + n) r H (n_dim + v)), then 2 H (n_dim + R) per attended key for q.k and 2 H v for p.v.
Shape names: H heads, r kv_lora_rank, R qk_rope_head_dim, n_dim qk_nope_head_dim, v v_head_dim.
"""

from __future__ import annotations

from typing import Callable, Sequence

from servescope.config import ModelConfig


def projection_shapes(cfg: ModelConfig) -> dict:
    """{op group: [(out, in) of each swappable linear]} of one latent layer: the query and latent
    projections ("qkv_proj") and o_proj ("attn_out_proj"); kv_b_proj is priced in the attention."""
    m, h, d = cfg.mla, cfg.num_attention_heads, cfg.hidden_size
    q = [(m.q_lora_rank, d), (h * m.qk_head_dim, m.q_lora_rank)] if m.q_lora_rank else [(h * m.qk_head_dim, d)]
    return {"qkv_proj": q + [(m.latent_dim, d)], "attn_out_proj": [(d, h * m.v_head_dim)]}


def linear_bytes(cfg: ModelConfig, linear_weight_bytes: Callable) -> dict:
    """{"qkv_proj", "attn_out_proj"} weight bytes of one latent layer (linear_weight_bytes(out, in): the
    dtype's rule from op_counts) and "kv_b_proj": kept in the activation dtype's float (model/mla.py reads it
    as W_UK / W_UV), passed in by the caller as a per-element size."""
    return {g: sum(linear_weight_bytes(o, i) for o, i in shapes) for g, shapes in projection_shapes(cfg).items()}


def kv_b_elements(cfg: ModelConfig) -> int:
    m = cfg.mla
    return m.kv_lora_rank * cfg.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)


def projection_flops(cfg: ModelConfig, num_tokens: int) -> dict:
    """FLOPs of the swappable projections over every layer for num_tokens tokens."""
    return {g: 2 * num_tokens * sum(o * i for o, i in shapes) * cfg.num_hidden_layers
            for g, shapes in projection_shapes(cfg).items()}


def attention_flops(cfg: ModelConfig, seqs: Sequence[tuple[int, int]], attended: Callable) -> int:
    """Attention FLOPs of one step over every layer: decode rows (n == 1) absorbed, prefill chunks expanded.
    attended(n, c): keys attended by n new tokens after c cached ones, causally (op_counts.attended_keys)."""
    m, h = cfg.mla, cfg.num_attention_heads
    total = 0
    for n, c in seqs:
        keys = attended(n, c)
        if n == 1:
            total += 2 * h * m.qk_nope_head_dim * m.kv_lora_rank + 2 * h * m.kv_lora_rank * m.v_head_dim
            total += 4 * h * m.latent_dim * keys
        else:
            total += 2 * (c + n) * kv_b_elements(cfg)
            total += 2 * h * (m.qk_head_dim + m.v_head_dim) * keys
    return total * cfg.num_hidden_layers
