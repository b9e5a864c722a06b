"""Top-k, top-p (nucleus) and min-p truncation of a batch of logits, one setting per row.

Shapes: B rows (requests), V vocabulary entries. A dropped token's logit becomes -inf;
the survivors keep their value (the caller softmaxes afterwards, which renormalises).

Rules, as in vLLM:
- top-k keeps every token whose logit is >= the k-th largest, so ties at the k-th
  value are all kept. k <= 0 (0 or -1) or k >= V means off.
- top-p works on the distribution left by top-k: it keeps the smallest set of most
  likely tokens whose probability mass is >= p, and always keeps the top token.
  Computed as "drop a token when the mass of it and everything less likely is <= 1 - p".
- min-p drops tokens whose probability is < min_p * (probability of the top token).
  It is a ratio test, so applying it before or after renormalisation gives the same set.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

_Param = Union[torch.Tensor, float, int, None]


def _per_row(value: _Param, rows: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(-1).expand(rows)
    return torch.full((rows,), value, dtype=dtype, device=device)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    k: _Param = None,
    p: _Param = None,
    min_p: _Param = None,
) -> torch.Tensor:
    """Return a copy of `logits` [B, V] with the tokens outside top-k, top-p and min-p set to -inf.

    k, p, min_p are per-row tensors [B] (or scalars for every row), or None to skip that
    filter for the whole batch. Rows with k off, p == 1 or min_p == 0 are left unchanged by
    that filter, so a batch may mix settings. Never synchronises with the host.
    """
    rows, vocab = logits.shape
    device = logits.device
    k = _per_row(k, rows, torch.long, device)
    p = _per_row(p, rows, logits.dtype, device)
    min_p = _per_row(min_p, rows, logits.dtype, device)
    neg_inf = float("-inf")

    if k is not None or p is not None:
        # one ascending sort serves both filters; the top token is in the last column
        logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [B, V] each
        if k is not None:
            k = torch.where((k <= 0) | (k > vocab), vocab, k)
            kth_largest = logits_sort.gather(1, (vocab - k).unsqueeze(1))  # [B, 1]
            logits_sort.masked_fill_(logits_sort < kth_largest, neg_inf)
        if p is not None:
            mass_up_to = logits_sort.softmax(dim=-1).cumsum_(dim=-1)  # [B, V], ascending mass
            drop = mass_up_to <= (1 - p).unsqueeze(1)
            drop[:, -1] = False  # the top token always survives
            logits_sort.masked_fill_(drop, neg_inf)
        logits = torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)
    else:
        logits = logits.clone()

    if min_p is not None:
        probs = logits.softmax(dim=-1)  # [B, V]
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        logits.masked_fill_(probs < threshold, neg_inf)
    return logits
