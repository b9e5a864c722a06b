"""Draft-model proposer: a smaller model with the target's vocabulary guesses k tokens per request.

Shape legend: B requests proposing, V vocabulary, k drafts.

The draft has its own paged KV cache (its own layers' K and V) over the TARGET's block tables: block b,
slot s holds the draft's KV of the same token position as the target's. So the target's allocator is the
only one: rolling back rejected drafts, preemption and finishing free the draft's slots too, and the
prefix cache never needs to know about the draft. Before proposing, the engine reserves lookahead slots
for the draft's k - 1 unverified positions (Scheduler.reserve_lookahead), never hashed.

Per request the proposer remembers how many leading positions of the draft's cache are valid: after a
verification that is min(what it wrote, the target's verified count); a preemption resets it (the
blocks are new). Each proposal is k forwards of the draft over all proposing requests: a catch-up one
(the tokens the draft has not seen: the whole prompt the first time, else the target's last token or
two; its last logits give draft 1), then k - 1 one-token decodes.
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace
import torch

from servescope.sampling.sampler import Sampler
from servescope.scheduler.output import ScheduledSequence
from servescope.spec.rejection import position_states


MAX_CATCH_UP_ROWS = 8  # a catch-up of up to this many tokens runs as one-token rows


class DraftProposer:
    name = "draft"
    deterministic = False
    needs_lookahead = True

    def __init__(self, runner, sampler: Sampler):
        self.runner = runner  # a ModelRunner-like: execute(scheduled, sample_rows) -> logits [P, V]
        self.sampler = sampler
        self._valid: dict[str, tuple] = {}  # request id -> (draft KV positions written, num_preemptions)
        self.num_forwards, self.forward_seconds = 0, 0.0  # the draft's own cost, measured

    def propose_batch(self, items: list) -> list:
        """items: (request, k, block ids, sampling state) -> [(drafts, q [k, V] or None when greedy)]."""
        if not items:
            return []
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list] = [[] for _ in items]
        seqs = [self._catch_up_seq(req, blocks) for req, _, blocks, _ in items]
        # one-token queries first (decodes and catch-ups laid out as rows), prompts last
        order = sorted(range(len(items)), key=lambda i: seqs[i].num_new_tokens > 1 and not seqs[i].spec_token_ids)
        self._draw([items[i] for i in order], [seqs[i] for i in order], [drafts[i] for i in order],
                   [probs[i] for i in order])
        for j in range(1, max(k for _, k, _, _ in items)):
            todo = [i for i, (_, k, _, _) in enumerate(items) if k > j]
            step = [self._draft_seq(items[i][0], items[i][2], drafts[i]) for i in todo]
            self._draw([items[i] for i in todo], step, [drafts[i] for i in todo], [probs[i] for i in todo])
        for (req, k, _, _), d in zip(items, drafts):
            # positions written: through the (k - 1)-th draft's, at num_tokens - 1 + k - 1
            self._valid[req.request_id] = (req.num_tokens + k - 1, req.num_preemptions)
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _catch_up_seq(self, req, blocks):
        """The tokens the draft has not seen. After a verification they are one or two (the target's
        correction or bonus token, and the last draft when all were accepted): those go as one-token
        rows, the layout of a verification (engine/model_runner.py), so that the decode kernels (the
        C++ decode plan) serve them; a prompt goes as a prefill query."""
        written, preemptions = self._valid.get(req.request_id, (0, req.num_preemptions))
        start = 0 if preemptions != req.num_preemptions else min(written, req.num_computed_tokens)
        n = req.num_tokens - start
        rows = tuple(req.all_token_ids[start + 1:start + n]) if 1 < n <= MAX_CATCH_UP_ROWS else ()
        return ScheduledSequence(req, n, start, blocks, is_prefill=False, will_sample=True, spec_token_ids=rows)

    @staticmethod
    def _draft_seq(req, blocks, drafts):
        # the last draft as one token at its position, the earlier drafts as known tokens
        seq_req = SimpleNamespace(all_token_ids=req.all_token_ids + drafts)
        return ScheduledSequence(seq_req, 1, req.num_tokens + len(drafts) - 1, blocks, is_prefill=False,
                                 will_sample=True)

    def _draw(self, items: list, seqs: list, drafts: list, probs: list) -> None:
        """One draft forward over seqs; appends each request's next draft (and its distribution)."""
        t0 = time.perf_counter()
        logits = self.runner.execute(seqs, list(range(len(seqs))))  # [P, V]: every row of a rows catch-up
        if len(logits) > len(seqs):  # keep each sequence's last position
            ends = itertools.accumulate(s.num_sample_positions for s in seqs)
            logits = logits.index_select(0, torch.tensor([e - 1 for e in ends], device=logits.device))
        states = [position_states(st, d)[-1] for (_, _, _, st), d in zip(items, drafts)]
        p, greedy_ids, greedy, _ = self.sampler.distributions(logits, states)  # drafts have no grammar
        if p is None:
            toks = greedy_ids
        else:
            race = p / self.sampler.exponential_noise(p, states, greedy)  # a sample of p per row
            toks = torch.where(torch.tensor(greedy, device=p.device), greedy_ids, race.argmax(dim=-1)) \
                if greedy_ids is not None else race.argmax(dim=-1)
        for i, t in enumerate(toks.tolist()):
            drafts[i].append(t)
            if p is not None and not greedy[i]:
                probs[i].append(p[i])
        self.num_forwards += 1
        self.forward_seconds += time.perf_counter() - t0

    def retain(self, request_ids) -> None:
        """Forget the requests not in request_ids (finished or aborted ones)."""
        keep = set(request_ids)
        self._valid = {r: v for r, v in self._valid.items() if r in keep}

    def seconds_per_draft_step(self, k: int) -> float:
        """The proposer's cost for k drafts, for the k chooser: unknown until measured, 0 (the cost
        model's draft term is supplied by the engine where it has a predictor for the draft)."""
        return 0.0
