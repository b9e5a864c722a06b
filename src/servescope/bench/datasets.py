"""Synthetic benchmark prompts: random token ids with fixed or uniformly drawn lengths.

Prompts are token id lists by default (servescope, vLLM and llama.cpp accept ids in
/v1/completions), so the server sees exactly `prompt_len` tokens without any
tokenizer on the client. With a tokenizer the ids are decoded to text (needed
for /v1/chat/completions); `prompt_len` is then the re-encoded length, which
may differ slightly from the drawn one because decode/encode is not a bijection.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np


class BenchRequest(NamedTuple):
    """One benchmark request: prompt (token ids or text), its length in tokens, tokens to generate."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def length_bounds(length: int | tuple[int, int], range_ratio: float = 0.0) -> tuple[int, int]:
    """Inclusive (lo, hi): an explicit pair, or length * (1 -/+ range_ratio) as vLLM's random dataset."""
    if isinstance(length, tuple):
        lo, hi = (int(x) for x in length)
    else:
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
        lo, hi = int(length * (1.0 - range_ratio)), int(length * (1.0 + range_ratio))
    if lo < 1 or hi < lo:
        raise ValueError(f"length bounds must satisfy 1 <= lo <= hi, got ({lo}, {hi})")
    return lo, hi


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens (BOS would inflate prompt_len by one)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # tokenizers without the keyword
        return list(tokenizer.encode(text))


def random_requests(
    n: int,
    input_len: int | tuple[int, int],
    output_len: int | tuple[int, int],
    range_ratio: float = 0.0,
    vocab_size: int | None = None,
    seed: int = 0,
    tokenizer: Any = None,
) -> list[BenchRequest]:
    """`n` seeded requests of random tokens.

    Lengths: an int with `range_ratio` (vLLM semantics) or an inclusive (lo, hi)
    pair, drawn uniformly per request. Token ids are uniform over the vocabulary
    minus the tokenizer's special ids (when a tokenizer is given). `vocab_size`
    defaults to `len(tokenizer)` and is required without a tokenizer.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    if vocab_size is None:
        if tokenizer is None:
            raise ValueError("vocab_size is required without a tokenizer")
        vocab_size = len(tokenizer)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    special = set(getattr(tokenizer, "all_special_ids", None) or []) if tokenizer is not None else set()
    allowed = np.array([t for t in range(vocab_size) if t not in special], dtype=np.int64)
    if allowed.size == 0:
        raise ValueError("no non-special token ids to draw from")

    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_lo, in_hi + 1, size=n)
    out_lens = rng.integers(out_lo, out_hi + 1, size=n)
    requests = []
    for i in range(n):
        ids = allowed[rng.integers(0, allowed.size, size=int(in_lens[i]))].tolist()
        if tokenizer is None:
            requests.append(BenchRequest(ids, len(ids), int(out_lens[i])))
            continue
        text = tokenizer.decode(ids)
        # Re-encoding usually merges or splits a few tokens; cut back to the drawn length
        # so prompts never exceed it, and report what the server will actually count.
        reencoded = encode_text(tokenizer, text)
        if len(reencoded) > len(ids):
            text = tokenizer.decode(reencoded[: len(ids)])
            reencoded = encode_text(tokenizer, text)
        requests.append(BenchRequest(text, len(reencoded), int(out_lens[i])))
    return requests


def total_tokens(requests: Sequence[BenchRequest]) -> tuple[int, int]:
    """(sum of prompt lengths, sum of requested output lengths)."""
    return sum(r.prompt_len for r in requests), sum(r.output_len for r in requests)
