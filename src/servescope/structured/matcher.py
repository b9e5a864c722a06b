"""Matcher (one sample's grammar state) and apply_grammar_masks (one bitmask for the batch).

Shapes: B rows of logits, V vocabulary, W = ceil(V / 32) int32 words of bitmask per row.
"""

from __future__ import annotations

import time

import torch
import xgrammar as xgr


class Matcher:
    """Follows one sample's tokens through its grammar. `accept` returns False on a token the
    grammar forbids (it cannot happen while the mask is applied)."""

    def __init__(self, matcher, allowed: "torch.Tensor | None" = None):
        self._m = matcher
        self.allowed = allowed  # a bitmask row [W] ANDed into every mask (None: the grammar's alone)

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self._m.is_terminated()


_batch_matcher = None


def _batch():
    global _batch_matcher  # one thread pool for the process (xgrammar's BatchGrammarMatcher)
    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
    return _batch_matcher


def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> float:
    """Set to -inf, in place, the logits [B, V] of tokens each row's grammar forbids (rows whose
    matcher is None are left alone). Returns the seconds spent (filling + applying)."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated]
    if not rows:
        return 0.0
    t0 = time.perf_counter()
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)  # [R, W] int32, on the host
    _batch().batch_fill_next_token_bitmask([matchers[i]._m for i in rows], bitmask)
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)  # -1: every bit set
    for j, i in enumerate(rows):
        if matchers[i].allowed is not None:
            bitmask[j] &= matchers[i].allowed
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), vocab_size=vocab)
    return time.perf_counter() - t0
