"""Repetition, presence and frequency penalties, and the min_tokens EOS mask.

Shapes: B rows (requests), V vocabulary entries. Everything edits float32 logits in place.

- repetition penalty (HF/vLLM): for every token seen in the prompt or the output so far,
  a positive logit is divided by the penalty, a non-positive one multiplied by it.
- frequency and presence penalties (OpenAI): on output tokens only,
  logit -= frequency * count + presence * (count > 0).
Order (as vLLM): repetition, then frequency, then presence.

Token lists are flattened on the host and copied once to the device; ids outside [0, V)
land in a spare column V that is dropped, so a stray id can never index out of bounds.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch


def host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on `device`, copied without a device sync on CUDA."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    t = t.to(dtype)
    if device.type == "cuda":
        # a pinned source makes the copy asynchronous; the caching host allocator keeps the
        # buffer alive until the copy has run
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list: float32 [B, V] (exact up to 2**24)."""
    rows = len(token_lists)
    lengths = [len(ids) for ids in token_lists]
    counts = torch.zeros(rows * (vocab_size + 1), dtype=torch.float32, device=device)  # [B * (V+1)]
    total = sum(lengths)
    if total:
        ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)  # [total]
        ids = torch.where((ids < 0) | (ids >= vocab_size), vocab_size, ids)
        row_of = torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths))  # [total]
        flat = host_to_device(row_of * (vocab_size + 1) + ids, torch.long, device)
        counts.index_add_(0, flat, torch.ones(total, dtype=torch.float32, device=device))
    return counts.view(rows, vocab_size + 1)[:, :vocab_size]  # [B, V]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Penalise float32 `logits` [B, V] in place and return it.

    Penalties are per-row tensors [B] on the logits' device. A row that needs no penalty
    may pass empty token lists to save host work (its penalties must then be neutral:
    repetition 1, presence 0, frequency 0).
    """
    vocab = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab, logits.device)  # [B, V]
    seen = output_counts > 0  # [B, V]
    if any(prompt_token_ids):
        seen = seen | (token_counts(prompt_token_ids, vocab, logits.device) > 0)
    rep = repetition_penalty.unsqueeze(1)  # [B, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= frequency_penalty.unsqueeze(1) * output_counts
    logits -= presence_penalty.unsqueeze(1) * (output_counts > 0)
    return logits


def mask_tokens(logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
    """Set logits[rows[i], token_ids[i]] = -inf in place (min_tokens: EOS may not be sampled yet)."""
    if rows:
        r = host_to_device(list(rows), torch.long, logits.device)
        t = host_to_device(list(token_ids), torch.long, logits.device)
        # a device-side fill, not torch.tensor(-inf, device=...), which would be a blocking copy
        logits.index_put_((r, t), torch.full((len(rows),), float("-inf"), dtype=logits.dtype, device=logits.device))
    return logits
