"""Attention whose scores change before the softmax: tanh soft-capping (Gemma 2) and learned sinks (gpt-oss),
in plain PyTorch, in the order of operations of transformers' eager attention.

SDPA, the tiled prefill kernel and the Triton kernels compute softmax(q.k * scale) only; a layer with a
soft-cap or sinks (AttentionSpec.plain_softmax false) is served by the reference backend, which calls
`attend` here, except for its decode rows on the CPU, which the C++ paged decode kernel computes with both
(csrc/decode_attention.h's ScoreMods; the C++ decode plan still declines such models).

Shape legend: B batch, H query heads, Hkv KV heads, q queries, L keys, D head dim.
"""

from __future__ import annotations

from typing import Optional

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
           softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, q, D]; k, v [B, Hkv, L, D]; mask bool, broadcastable to [B, H, q, L] (True: attend);
    sinks [H] or None -> [B, H, q, D]. Each score s becomes softcap * tanh(s / softcap) when softcap > 0;
    a sink is one more logit per head in the softmax whose probability is dropped (the weights of the
    real keys then sum to less than one)."""
    b, h, nq, _ = q.shape
    group = h // k.shape[1]
    if group > 1:  # [B, Hkv, L, D] -> [B, H, L, D]: query head i reads KV head i // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, q, L]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
    else:
        s = torch.cat([s, sinks.to(s.dtype).view(1, h, 1, 1).expand(b, h, nq, 1)], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        p = torch.softmax(s, dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(p.to(v.dtype), v)
