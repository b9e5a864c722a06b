"""Per-request latency metrics with vLLM's definitions.

queue time = first scheduled - arrival; TTFT = first token - arrival;
TPOT = (E2E - TTFT) / (n_out - 1) (undefined for one output token); ITL = every gap between
consecutive output tokens; E2E = finish - arrival. Times are time.perf_counter() seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    token_times: list = field(default_factory=list)  # perf_counter time of each output token
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0  # ... and accepted

    @property
    def spec_acceptance_rate(self) -> Optional[float]:
        """Accepted / proposed drafts; None when nothing was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def queue_time(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> Optional[float]:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        n = len(self.token_times)
        if n < 2:
            return None
        end = self.finished_time if self.finished_time is not None else self.token_times[-1]
        return (end - self.arrival_time - self.ttft) / (n - 1)

    @property
    def itls(self) -> list:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def as_dict(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "queue_time": self.queue_time,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "itls": self.itls,
        }
