"""Acceptance tracking per request and the choice of k (0: do not speculate this step).

The tracker estimates each request's per-draft acceptance rate a from its verified steps: k drafts of
which m were accepted are m successes in m + (1 if m < k else 0) trials (drafts after the first rejection
were never tried). Counts decay geometrically, so a request whose text turns from copying to free
writing drops its k within a few steps, and start from a prior worth a few trials.
"""

from __future__ import annotations

from typing import Callable, Optional

from servescope.analysis.speculative import best_k


class AcceptanceTracker:
    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9):
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self._counts: dict[str, list] = {}  # request id -> [successes, trials] (decayed)

    def update(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        c = self._counts.setdefault(request_id, [0.0, 0.0])
        c[0] = self.decay * c[0] + num_accepted
        c[1] = self.decay * c[1] + num_accepted + (1 if num_accepted < num_drafts else 0)

    def rate(self, request_id: str) -> float:
        s, t = self._counts.get(request_id, (0.0, 0.0))
        return (s + self.prior * self.prior_weight) / (t + self.prior_weight)

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)

    def retain(self, request_ids) -> None:
        """Drop the requests not in request_ids (finished ones)."""
        keep = set(request_ids)
        for rid in [r for r in self._counts if r not in keep]:
            del self._counts[rid]


class KChooser:
    """k per request: the configured k, or (adaptive, with step times to predict from) the k in 0..max_k
    that the cost model predicts fastest at the request's acceptance rate and the batch's size.
    step_seconds(rows, context_len): the target's step over that many one-token rows;
    draft_step_seconds(rows, context_len): one forward of a draft model over that many one-token rows
    (None: the proposer costs nothing worth predicting, as n-gram lookup); k drafts cost k of them."""

    def __init__(self, max_k: int, adaptive: bool, step_seconds: Optional[Callable[[int, int], float]] = None,
                 draft_step_seconds: Optional[Callable[[int, int], float]] = None):
        self.max_k, self.adaptive = max_k, adaptive
        self.step_seconds, self.draft_step_seconds = step_seconds, draft_step_seconds
        self.tracker = AcceptanceTracker()
        self._seconds: dict = {}  # (which, rows, context bucket) -> predicted seconds, kept across steps

    def _predicted(self, fn: Callable[[int, int], float], rows: int, context_len: int) -> float:
        key = (fn, rows, context_len // 64)  # predictions move little within 64 tokens of context
        if key not in self._seconds:
            if len(self._seconds) > 4096:
                self._seconds.clear()
            self._seconds[key] = fn(rows, key[2] * 64 + 32)
        return self._seconds[key]

    def choose(self, request_ids: list, batch: int, context_len: int) -> list:
        """k per request of a batch of `batch` decodes of about context_len tokens each."""
        if not self.adaptive or self.step_seconds is None:
            return [self.max_k] * len(request_ids)

        def seconds(rows: int) -> float:
            return self._predicted(self.step_seconds, rows, context_len)

        draft = 0.0 if self.draft_step_seconds is None else self._predicted(self.draft_step_seconds, batch, context_len)
        return [best_k(self.tracker.rate(r), self.max_k, seconds, batch, lambda k: k * draft)[0]
                for r in request_ids]
