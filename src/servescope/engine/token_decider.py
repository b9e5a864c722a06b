"""The token decider: from a step's logits to each sequence's new tokens, one interface for every way
of deciding them, so that the engine's step reads the same whatever is on.

  TokenDecider      plain sampling: one token per sequence whose next token is due (the Sampler)
  SpecDecoder       speculative decoding (engine/spec_decode.py): verification of last step's drafts,
                    then, after the step, drafts for the next one

Every decider returns a Decision: each sample's tokens in order (one, or a speculating request's
accepted drafts and the target's own token), the seconds spent on grammar masks and the step's
speculation counts for its StepRecord.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from servescope.engine.output_processor import OutputProcessor, SampledToken
from servescope.sampling.sampler import Sampler
from servescope.scheduler.output import SchedulerOutput
from servescope.scheduler.scheduler import Scheduler


@dataclass
class Decision:
    tokens: dict = field(default_factory=dict)  # sample id -> [SampledToken, ...], in step order
    mask_seconds: float = 0.0  # filling and applying grammar masks
    num_spec_seqs: int = 0  # requests that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class TokenDecider:
    """Plain sampling (the base of every decider)."""

    speculative = False

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def decide(self, out: SchedulerOutput, rows: list, logits: Optional[torch.Tensor],
               outputs: OutputProcessor) -> Decision:
        """The tokens of the scheduled sequences at `rows`; logits: their sample positions, in order."""
        rids = [out.scheduled[i].request_id for i in rows]
        if not rids:
            return Decision()
        so = self.sampler(logits, [outputs.sampling_state(r) for r in rids])
        return Decision({r: [SampledToken(t, lp)] for r, t, lp in zip(rids, so.token_ids, so.logprobs)},
                        so.mask_seconds)

    def after_step(self, scheduler: Scheduler, outputs: OutputProcessor) -> None:
        """Work between steps (speculation: the next step's drafts)."""

    def state(self) -> dict:
        """Totals for /metrics and the engine's kv_cache_state()."""
        return {}
