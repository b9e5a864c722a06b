"""Speculative decoding in the engine's step: proposals after a step, verification in the next.

  end of step t   SpecDecoder.propose: for each running request one token behind (a decode), k from
                  the chooser (adaptive: acceptance rate and the cost model; 0 skips the request), capped
                  so that the request cannot pass max_tokens or max_model_len; the proposer's drafts go
                  into Request.spec_token_ids (a draft model first gets lookahead KV slots)
  step t + 1      the scheduler schedules last token + drafts as one sequence; the runner returns logits
                  at each of its 1 + k positions; SpecDecoder.verify runs the rejection sampler (spec/)
                  and hands back each request's accepted drafts + the target's token
The totals (drafts, draft tokens, accepted tokens: vLLM's spec_decode counters) and the step's counts
feed /metrics and the StepRecord.
"""

from __future__ import annotations

from typing import Optional

import torch

from servescope.engine.output_processor import OutputProcessor, SampledToken
from servescope.engine.token_decider import Decision, TokenDecider
from servescope.sampling.sampler import Sampler
from servescope.scheduler.output import SchedulerOutput
from servescope.scheduler.scheduler import Scheduler
from servescope.spec.adaptive import KChooser
from servescope.spec.rejection import verify


class SpecDecoder(TokenDecider):
    """The speculative token decider. proposer: spec.ngram.NgramProposer or spec.draft.DraftProposer
    (propose_batch)."""

    speculative = True

    def __init__(self, proposer, chooser: KChooser, sampler: Sampler, max_model_len: int):
        super().__init__(sampler)
        self.proposer, self.chooser = proposer, chooser
        self.max_model_len = max_model_len
        self._draft_probs: dict[str, Optional[torch.Tensor]] = {}  # request id -> q [k, V] of its drafts
        self.num_drafts = 0  # verifications with at least one draft (vLLM: num_drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    # ---------------------------------------------------------------- after a step
    def after_step(self, scheduler: Scheduler, outputs: OutputProcessor) -> None:
        self.propose(scheduler, outputs)

    def propose(self, scheduler: Scheduler, outputs: OutputProcessor) -> None:
        running = scheduler.running_requests()
        self.chooser.tracker.retain(r.request_id for r in running)
        self.proposer.retain(r.request_id for r in running)
        self._draft_probs = {}
        ready = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        if not ready:
            return
        ctx = sum(r.num_tokens for r in ready) // len(ready)
        ks = self.chooser.choose([r.request_id for r in ready], len(ready), ctx)
        items = []
        for req, k in zip(ready, ks):
            sp = req.sampling_params
            # emitted tokens <= k + 1: stay within max_tokens and the context
            k = min(k, sp.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
            state = outputs.sampling_state(req.request_id)
            if k <= 0 or state.grammar is not None:
                # a grammar-constrained request decodes plainly: verifying drafts would need its matcher
                # advanced through them and rolled back on rejection (not built)
                continue
            tables = None
            if self.proposer.needs_lookahead:
                tables = scheduler.reserve_lookahead(req.request_id, k)  # per group of layers
                if tables is None:
                    continue  # no room for the draft's KV: this request decodes plainly
            items.append((req, k, tables, state))
        for (req, _, _, _), (drafts, q) in zip(items, self.proposer.propose_batch(items)):
            req.spec_token_ids = list(drafts)
            if q is not None:
                self._draft_probs[req.request_id] = q

    # ---------------------------------------------------------------- in the next step
    def decide(self, out: SchedulerOutput, rows: list, logits: Optional[torch.Tensor],
               outputs: OutputProcessor) -> Decision:
        """Verification when a scheduled row carries drafts, else plain sampling."""
        if not any(out.scheduled[i].spec_token_ids for i in rows):
            return super().decide(out, rows, logits, outputs)
        return self.verify(out, rows, logits, outputs)

    def verify(self, out: SchedulerOutput, rows: list, logits: torch.Tensor, outputs: OutputProcessor) -> Decision:
        """The tokens of the scheduled sequences at `rows` (accepted drafts, then the target's own);
        logits: their sample positions, in order."""
        seqs = [out.scheduled[i] for i in rows]
        drafts = [list(s.spec_token_ids) for s in seqs]
        q = [self._draft_probs.get(s.request_id) if d else None for s, d in zip(seqs, drafts)]
        q = [None if x is None else x[:len(d)] for x, d in zip(q, drafts)]
        states = [outputs.sampling_state(s.request_id) for s in seqs]
        verified = verify(self.sampler, logits, states, drafts, q)
        d = Decision(mask_seconds=verified.mask_seconds)
        for seq, res in zip(seqs, verified.results):
            rid = seq.request_id
            d.tokens[rid] = [SampledToken(t, lp) for t, lp in zip(res.token_ids, res.logprobs)]
            if res.num_drafts:
                d.num_spec_seqs += 1
                d.num_draft_tokens += res.num_drafts
                d.num_accepted_tokens += res.num_accepted
                self.chooser.tracker.update(rid, res.num_drafts, res.num_accepted)
                outputs.record_speculation(rid, res.num_drafts, res.num_accepted)
        self.num_drafts += d.num_spec_seqs
        self.num_draft_tokens += d.num_draft_tokens
        self.num_accepted_tokens += d.num_accepted_tokens
        return d

    def state(self) -> dict:
        """Totals for /metrics and kv_cache_state()."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens}
