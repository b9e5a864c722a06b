"""Request: one sequence's tokens and scheduling state, as the scheduler sees it."""

from __future__ import annotations

import enum
from typing import Optional, Sequence

from servescope.config import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV dropped; it will recompute
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> Optional[str]:
        """OpenAI-style finish_reason ("stop", "length", "abort", "error"), None while unfinished."""
        return self.value if self.is_finished else None


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


class Request:
    """Tokens: prompt_token_ids + output_token_ids (= all_token_ids, num_tokens of them).

    num_computed_tokens counts the leading tokens whose KV is in the cache. While running,
    num_computed_tokens < num_tokens: after a step that samples, the new token's KV is not yet
    computed. Preemption resets it to 0 and the request recomputes all_token_ids.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        eos_token_ids: Sequence[int] = (),
    ):
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority  # lower value = served first; ties by arrival order
        self.eos_token_ids = tuple(eos_token_ids)

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit (tokens) at the last admission; -1 before
        self.num_preemptions = 0
        self.error: Optional[str] = None
        self.first_scheduled_time: Optional[float] = None
        # speculative decoding: draft tokens proposed after the last step, verified by the next one
        # (never part of all_token_ids: only verified tokens are, so only they reach the prefix cache)
        self.spec_token_ids: list[int] = []

    @property
    def cache_salt(self):
        """The prefix-cache salt of this request (kvcache hashes its blocks under it), or None."""
        return self.sampling_params.cache_salt

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. A live list: read it, do not mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, tok: int) -> None:
        self.output_token_ids.append(tok)
        self._all_token_ids.append(tok)

    def extend_output_tokens(self, toks: Sequence[int]) -> None:
        """append_output_token of each of toks, in one go (a simulator applying several decode steps at once)."""
        self.output_token_ids.extend(toks)
        self._all_token_ids.extend(toks)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first num_output_tokens (a stop inside a step's several tokens)."""
        extra = self.num_output_tokens - num_output_tokens
        if extra > 0:
            del self.output_token_ids[num_output_tokens:]
            del self._all_token_ids[-extra:]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens} "
            f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, priority={self.priority})"
        )
