"""The per-channel int8 form (model/linears/int8.py's Int8Linear): each row of W [N, K] as int8 Q [N, K]
and one float32 scale s [N], W ~= s[:, None] * Q, s = max|W[n, :]| / 127."""

from __future__ import annotations

import torch


def quantize_per_channel(w: torch.Tensor) -> tuple:
    """w [N, K] float -> (int8 [N, K], scale [N] float32)."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale
