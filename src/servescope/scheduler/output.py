"""SchedulerOutput: what one step computes, handed from the scheduler to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from servescope.scheduler.request import Request


@dataclass(slots=True)  # one per sequence per step: slots make it cheaper to build and read
class ScheduledSequence:
    """One request's share of a step: tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step: the position of the first new token
    block_ids: list[int]  # the full block table after allocation (a copy)
    is_prefill: bool  # some of these tokens are prompt or recompute tokens
    will_sample: bool  # the step reaches the request's last token: its logits are due
    # draft tokens verified this step: they follow the request's last token, so num_new_tokens is
    # 1 + len(spec_token_ids) and logits are due at each of those positions
    spec_token_ids: tuple = ()
    # a cache with a block table per group of layers of one window (kvcache/hybrid.py): each group's table,
    # the first being block_ids; () with one table for all layers
    group_block_ids: tuple = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_sample_positions(self) -> int:
        """Positions whose logits the step needs: 0, 1, or 1 + drafts (the bonus position included)."""
        return (1 + len(self.spec_token_ids)) if self.will_sample else 0

    def token_ids(self) -> list:
        """The step's input tokens of this sequence: known tokens, then the drafts."""
        start, n = self.num_computed_tokens, self.num_new_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[start:start + n] + list(self.spec_token_ids)

    @property
    def context_len(self) -> int:
        """Tokens this sequence attends over after the step."""
        return self.num_computed_tokens + self.num_new_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)  # decodes first, then prefills
    total_num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_requests: list[Request] = field(default_factory=list)  # finished by the scheduler itself
    num_waiting: int = 0
    num_running: int = 0

    @property
    def num_scheduled_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
