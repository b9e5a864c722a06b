"""Multi-head latent attention (attention kind "latent", DeepSeek-V2/V3; the spec is config/mla.py).

Shape legend:
  T  tokens in the step, B decode sequences, H heads, L keys of one sequence
  r  kv_lora_rank, R qk_rope_head_dim (the latent row: r + R), n qk_nope_head_dim, v v_head_dim
  N, S  KV blocks, block size

The KV cache of a latent layer is [N, S, 1, r + R]: each token's normed latent c and its rotated rope key
k_pe, one "head" (the engine's second cache tensor is [N, S, 1, 0]: nothing). Head h's key is
[W_UK[h] c | k_pe] and its value W_UV[h] c, W_UK [H, n, r] and W_UV [H, v, r] being kv_b_proj's rows.

- Decode rows use the absorbed form (DeepSeek-V2's paper, vLLM's MLA decode): W_UK folded into the query,
  q_lat[h] = W_UK[h]^T q_nope[h] (r features), so q.k = [q_lat | q_pe] . [c | k_pe] is a single-KV-head
  attention over the latent rows themselves, whose values are the rows' first r features (c): the backend's
  latent_decode runs it (on a CPU one C++ kernel, csrc/decode_attention.h's latent_decode_rows, that reads
  the keys whole and the values' r features only; elsewhere the paged decode over whole rows, cut to r), and
  W_UV is applied to its output. Nothing is expanded per head: a decode step reads the r + R features of
  each cached token once per layer.
- Prefill rows expand the latent to per-head K and V (kv_b_proj over the sequence's cached latents) and
  attend with SDPA: over many queries this costs fewer FLOPs than the absorbed form (n + R and v per head
  instead of r + R twice).
"""

from __future__ import annotations

import torch
from torch import nn

from servescope.config import LayerSpec, ModelConfig
from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.attention.reference import _prefill_keys, _sdpa
from servescope.model.layers import RMSNorm, RotaryEmbedding


class LatentAttention(nn.Module):
    """DeepSeek's MLA: q (q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj), the latent (kv_a_proj_with_mqa ->
    [c | k_pe], c normed by kv_a_layernorm), kv_b_proj (c -> per-head k_nope | v), o_proj."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        m = spec.attention.latent
        self.num_heads, self.scale, self.interleave = cfg.num_attention_heads, m.scale, m.rope_interleave
        self.nope, self.rope = m.qk_nope_head_dim, m.qk_rope_head_dim
        self.rank, self.v_dim = m.kv_lora_rank, m.v_head_dim
        h, d, bias = cfg.num_attention_heads, cfg.hidden_size, spec.attention.bias
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * m.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, m.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps)
        # stays an nn.Linear (not in projections()): decode reads its weight as W_UK and W_UV
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * m.v_head_dim, d, bias=spec.attention.out_bias)

    def projections(self) -> list:
        """(parent, attribute, module) of the swappable linears (kv_b_proj's weight is read as a tensor)."""
        names = ("q_a_proj", "q_b_proj") if hasattr(self, "q_a_proj") else ("q_proj",)
        return [(self, n, getattr(self, n)) for n in (*names, "kv_a_proj_with_mqa", "o_proj")]

    def forward(self, cos_sin: tuple, x, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t, h = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split((self.nope, self.rope), dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope), dim=-1)  # [T, r], [T, R]
        q_pe, k_pe = self._rotate(cos_sin, q_pe, k_pe[:, None])
        latent = torch.cat((self.kv_a_layernorm(c.contiguous()), k_pe[:, 0]), dim=-1)  # [T, r + R]
        cache = kv_cache[0]  # [N, S, 1, r + R]
        cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))
        out = q.new_empty(t, h, self.v_dim)
        nd = meta.num_decode_seqs
        if nd:
            out[:nd] = self._absorbed_decode(q_nope[:nd], q_pe[:nd], cache, meta, backend)
        if nd < meta.num_seqs:
            self._expanded_prefill(q_nope, q_pe, cache, meta, out)
        return self.o_proj(out.view(t, h * self.v_dim))

    def _rotate(self, cos_sin, q_pe, k_pe) -> tuple:
        """DeepSeek's rope on the rope features only. Interleaved pairs (x0, x1), (x2, x3) ... are laid out as
        the even features then the odd ones, which makes them rotate-half's pairs (q and k alike, so every
        dot product is the interleaved rope's)."""
        if self.interleave:
            q_pe = torch.cat((q_pe[..., 0::2], q_pe[..., 1::2]), dim=-1)
            k_pe = torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), dim=-1)
        return RotaryEmbedding.apply(cos_sin, q_pe.contiguous(), k_pe.contiguous())

    def _absorbed(self) -> tuple:
        """W_UK [H, n, r] and W_UV [H, v, r]: views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def _absorbed_decode(self, q_nope, q_pe, cache, meta: AttentionMetadata, backend: AttentionBackend):
        """q_nope [B, H, n], q_pe [B, H, R] -> [B, H, v]: one KV head of width r + R, the latents as keys and values."""
        w_uk, w_uv = self._absorbed()
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # W_UK folded into the query
        qa = torch.cat((q_lat, q_pe), dim=-1).contiguous()  # [B, H, r + R]
        o = backend.latent_decode(qa, cache, decode_rows(meta), self.scale, self.rank)  # [B, H, r]
        return torch.einsum("bhr,hvr->bhv", o, w_uv)  # W_UV after attention

    def _expanded_prefill(self, q_nope, q_pe, cache, meta: AttentionMetadata, out) -> None:
        """Each prefill sequence's queries over its cached latents expanded to per-head K [L, H, n + R] and
        V [L, H, v], written into out [T, H, v]."""
        h, start = self.num_heads, meta.num_decode_seqs
        for i in range(meta.num_decode_seqs, meta.num_seqs):
            qlen, ctx = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
            key = ("prefill", i, 0)  # the reference backend's key: the same blocks and mask
            if key not in meta.scratch:
                meta.scratch[key] = _prefill_keys(ctx, qlen, cache.shape[1], meta.block_tables[i], 0, q_nope.device)
            blocks, lo, hi, mask = meta.scratch[key]
            lat = cache[blocks].flatten(0, 2)[lo:hi].to(q_nope.dtype)  # [L, r + R]
            kv = self.kv_b_proj(lat[:, :self.rank]).view(-1, h, self.nope + self.v_dim)  # [L, H, n + v]
            k = torch.cat((kv[..., :self.nope], lat[:, None, self.rank:].expand(-1, h, self.rope)), dim=-1)
            rows = slice(start, start + qlen)
            qi = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)  # [q, H, n + R]
            out[rows] = _sdpa(qi, k, kv[..., self.nope:], self.scale, mask=mask)
            start += qlen


def decode_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata of the step's decode sequences alone (they lead the flat layout), made once per step."""
    if meta.is_decode_only:
        return meta
    if "decode_rows" not in meta.scratch:
        nd = meta.num_decode_seqs
        meta.scratch["decode_rows"] = AttentionMetadata(
            slot_mapping=meta.slot_mapping[:nd], block_tables=meta.block_tables[:nd],
            context_lens=meta.context_lens[:nd], query_start_loc=meta.query_start_loc[:nd + 1],
            query_lens_cpu=meta.query_lens_cpu[:nd], context_lens_cpu=meta.context_lens_cpu[:nd],
            max_query_len=1, max_context_len=max(meta.context_lens_cpu[:nd]), num_decode_seqs=nd)
    return meta.scratch["decode_rows"]
