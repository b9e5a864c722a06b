"""vLLM's per-request logits controls, applied by the Sampler after penalties and min_tokens:

  - logit_bias: {token id: bias} added to the logits (OpenAI's semantics; the server clamps biases
    to [-100, 100] as vLLM does);
  - allowed_token_ids: every other token gets -inf;
  - bad_words (as token sequences): a one-token word is never sampled; a longer word's last token
    gets -inf wherever the output so far ends with the rest of the word (vLLM's rule), so the
    word as tokenised is never completed;
  - the thinking budget (ThinkingBudget): once the reasoning block has its maximum number of
    tokens and is still open, only the next token of the end-of-reasoning sequence may be sampled.

Shapes: x is float32 [B, V], edited in place. Host work is per row that asks; the edits are
gathered into one index_put per kind.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from servescope.sampling.penalties import host_to_device

NEG_INF = float("-inf")


def apply_logit_controls(x: torch.Tensor, states: Sequence) -> None:
    """Edit float32 logits x [B, V] in place for the rows whose params ask (SamplingState list)."""
    vocab = x.shape[1]
    bias_rows, bias_toks, bias_vals = [], [], []
    ban_rows, ban_toks = [], []
    only: dict[int, list] = {}  # row -> the only tokens it may sample
    for i, s in enumerate(states):
        p = s.params
        if not p.has_logit_controls:
            continue
        for t, b in p.logit_bias:
            if t < vocab:
                bias_rows.append(i)
                bias_toks.append(t)
                bias_vals.append(b)
        for t in banned_by_bad_words(p.bad_words_token_ids, s.output_token_ids):
            if t < vocab:
                ban_rows.append(i)
                ban_toks.append(t)
        if p.allowed_token_ids is not None:
            only[i] = [t for t in p.allowed_token_ids if t < vocab]
        forced = forced_token(p.thinking_budget, s.output_token_ids) if p.thinking_budget else None
        if forced is not None and forced < vocab:
            only[i] = [forced]
    if bias_rows:
        idx = (
            host_to_device(bias_rows, torch.long, x.device),
            host_to_device(bias_toks, torch.long, x.device),
        )
        x.index_put_(idx, host_to_device(bias_vals, torch.float32, x.device), accumulate=True)
    if ban_rows:
        idx = (host_to_device(ban_rows, torch.long, x.device), host_to_device(ban_toks, torch.long, x.device))
        x.index_put_(idx, torch.full((len(ban_rows),), NEG_INF, dtype=x.dtype, device=x.device))
    for i, toks in only.items():
        keep = x[i, toks].clone()
        x[i].fill_(NEG_INF)
        x[i, toks] = keep


def banned_by_bad_words(words: Sequence[tuple], output: Sequence[int]) -> list:
    """Token ids that would complete a bad word now (vLLM's rule: the word's prefix ends the output)."""
    out = []
    n = len(output)
    for w in words:
        k = len(w) - 1
        if k == 0 or (k <= n and tuple(output[n - k :]) == w[:-1]):
            out.append(w[-1])
    return out


def forced_token(budget, output: Sequence[int]) -> Optional[int]:
    """The token the thinking budget forces next, or None (budget not spent, block closed, or the
    output did not open a block where the budget needs it to)."""
    start = budget.start_token_ids
    if start:
        if len(output) < len(start) or tuple(output[: len(start)]) != start:
            return None
    body = output[len(start) :]
    end = budget.end_token_ids
    if len(body) < budget.max_tokens or _contains(body, end):
        return None
    return end[_partial_end(body, end)]  # continue an end sequence already begun at the tail


def _contains(seq: Sequence[int], sub: tuple) -> bool:
    m = len(sub)
    first = sub[0]
    for i in range(len(seq) - m + 1):
        if seq[i] == first and tuple(seq[i : i + m]) == sub:
            return True
    return False


def _partial_end(seq: Sequence[int], end: tuple) -> int:
    """Length of the longest proper prefix of `end` that ends `seq` (0 if none)."""
    for k in range(min(len(end) - 1, len(seq)), 0, -1):
        if tuple(seq[len(seq) - k :]) == end[:k]:
            return k
    return 0
