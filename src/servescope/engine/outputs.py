"""What the engine hands back: RequestOutput with one CompletionOutput per sample (n)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from servescope.telemetry.request_metrics import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative; while unfinished it excludes text that may still turn into a stop string
    token_ids: list
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: object = None  # the stop string or stop token id that ended it, if any
    logprobs: Optional[list] = None  # list[TokenLogprobs] when asked for
    cumulative_logprob: Optional[float] = None
    metrics: Optional[RequestMetrics] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list = field(default_factory=list)  # list[CompletionOutput], ordered by index
    finished: bool = False
    error: Optional[str] = None
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: [None] + a TokenLogprobs per later prompt token (so far)
    prompt_logprobs: Optional[list] = None

    @property
    def metrics(self) -> Optional[RequestMetrics]:
        """Metrics of the first sample (n = 1: the request's)."""
        return self.outputs[0].metrics if self.outputs else None
