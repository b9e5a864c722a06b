"""Attention whose scores change before the softmax: tanh soft-capping (Gemma 2) and learned sinks (gpt-oss),
in plain PyTorch, in the order of operations of transformers' eager attention.

SDPA and the CPU's tiled prefill kernel compute softmax(q.k * scale) only; a layer with a soft-cap or sinks
(AttentionSpec.plain_softmax false) has its prefill rows served by `attend` here, except under Triton, whose paged
prefill kernel (kernels/triton/prefill.py) computes both. Decode rows take the paged decode kernels, which compute
both: the C++ one on the CPU (csrc/decode_attention.h's ScoreMods) and the
Triton one on GPUs (kernels/triton/attention.py's SOFTCAP / SINKS), so a decode-only step of such a model
runs no reference code and CUDA graphs capture it. The C++ decode plan still declines such models.

Shape legend: B batch, H query heads, Hkv KV heads, q queries, L keys, D head dim.
"""

from __future__ import annotations

from typing import Optional

import torch


MAX_SCORES = 1 << 24  # scores of one attend call (64 MiB of float32; a few such temporaries live at once)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
           softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, q, D]; k, v [B, Hkv, L, D]; mask bool, broadcastable to [B, H, q, L] (True: attend);
    sinks [H] or None -> [B, H, q, D]. Each score s becomes softcap * tanh(s / softcap) when softcap > 0;
    a sink is one more logit per head in the softmax whose probability is dropped (the weights of the
    real keys then sum to less than one)."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    rows = max(1, MAX_SCORES // (b * h * nk))
    if nq > rows:  # the queries in pieces: at most MAX_SCORES scores held at once (each row's softmax is its own)
        m = mask.expand(*mask.shape[:-2], nq, nk)
        return torch.cat([attend(q[:, :, i:i + rows], k, v, scale, m[..., i:i + rows, :], softcap, sinks)
                          for i in range(0, nq, rows)], dim=2)
    # grouped-query heads without copying K and V per query head: query head i reads KV head i // (H / Hkv), so
    # [B, H, q, D] viewed as [B, Hkv, (H / Hkv) q, D] multiplies each KV head's keys once
    s = torch.matmul(q.reshape(b, hkv, -1, d), k.transpose(-1, -2)).view(b, h, nq, nk) * scale  # [B, H, q, L]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
    else:
        s = torch.cat([s, sinks.to(s.dtype).view(1, h, 1, 1).expand(b, h, nq, 1)], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        p = torch.softmax(s, dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(p.to(v.dtype).reshape(b, hkv, -1, nk), v).view(b, h, nq, v.shape[-1])
