"""Prompt logprobs: how likely the model found each prompt token, from the prefill's own logits.

Shapes: E positions, V vocabulary. The logits at position p score the token at p + 1, so a prompt of
P tokens has P - 1 scored tokens (the first has none, as in OpenAI's echo). Raw logits, float32
log_softmax, like the sampled tokens' logprobs (sampler.py); one device -> host copy per call.
"""

from __future__ import annotations

import torch

from servescope.sampling.sampler import TokenLogprobs


def prompt_logprobs(logits: torch.Tensor, targets: list, num_top: list, vocab_size: int) -> list:
    """TokenLogprobs of targets[e] under logits[e] ([E, V]), each with num_top[e] alternatives."""
    if logits.shape[0] != len(targets) or len(targets) != len(num_top):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(targets)} targets and {len(num_top)} top counts")
    if not targets:
        return []
    lp = torch.log_softmax(logits[:, :vocab_size].to(torch.float32), dim=-1)  # [E, V]
    tgt = torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)  # [E, 1]
    chosen = lp.gather(1, tgt)  # [E, 1]
    rank = (lp >= chosen).sum(dim=-1)  # [E]: 1 + tokens at least as likely (vLLM's tie rule)
    k = min(max(num_top), vocab_size)
    parts = [chosen.squeeze(1).double(), rank.double()]
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)  # [E, k] each, descending
        parts += [top_ids.double().flatten(), top_lp.double().flatten()]
    host = torch.cat(parts).tolist()
    e = len(targets)
    out = []
    for i, t in enumerate(targets):
        base = 2 * e + i * k
        top = [(int(host[base + c]), host[base + e * k + c]) for c in range(min(num_top[i], k))]
        out.append(TokenLogprobs(int(t), host[i], int(host[e + i]), top))
    return out
