"""Draft-model proposer: a smaller model with the target's vocabulary guesses k tokens per request.

Shape legend: B requests proposing, n_j of them still drafting at draft step j, V vocabulary, k drafts,
M max blocks per request.

Two KV arrangements, both over the TARGET's block tables (so the target's allocator is the only one:
rolling back rejected drafts, preemption and finishing free the draft's slots too, and the prefix cache
never needs to know about the draft). Before proposing, the engine reserves lookahead slots for the
draft's k - 1 unverified positions (Scheduler.reserve_lookahead), never hashed.

  shared   (self-speculation: the target's own weights quantised, the same layer shapes and KV dtype)
           the draft reads and writes the target's KV cache. Every position before the request's last
           token holds the target's verified KV, which the draft attends over as it is (QSpec, Zhao et al.
           2024, shares the cache between its quantised draft and its verifier the same way); the draft
           writes the KV of the last token and of its own drafts at positions the target's verification
           step rewrites before any of its rows reads them (all rows store before any attends). So each
           proposal is exactly k one-token decodes: no prompt prefill, no catch-up rows, no second cache.
           With a block table per group of layers (kvcache/hybrid.py) each draft layer is the target's layer
           of the same window, so it reads and writes its own group's table, lookahead slots reserved in
           every group.
  own      (any other draft) the draft has its own cache (its own layers' K and V) at the same slots: with
           a table per group of layers, the full-attention group's (its first; the engine keeps tables per
           group under a draft only where the target has full-attention layers), which holds every block.
           Per request the proposer remembers how many leading positions of it are valid: after a
           verification min(what it wrote, the target's verified count); a preemption resets it (the
           blocks are new). The first forward catches up on the tokens the draft has not seen (the whole
           prompt the first time, else the target's last token or two); its last logits give draft 1.

The k - 1 (shared: k) one-token steps are the draft's inner loop, kept to its kernels: requests sorted by
k (longest first) so those still drafting are a prefix, one host buffer per step (the runner's layout),
and for greedy requests whose sampler reads no history the argmax stays a tensor that feeds the next
step's input ids; the drafts reach the host once per proposal. Other requests' drafts are sampled from
the draft's processed distribution q (kept for rejection sampling), one step at a time.
"""

from __future__ import annotations

import itertools
import time

import torch

from servescope.sampling.sampler import Sampler
from servescope.scheduler.output import ScheduledSequence
from servescope.spec.rejection import position_states, reads_history


MAX_CATCH_UP_ROWS = 8  # a catch-up of up to this many tokens runs as one-token rows


class DraftProposer:
    name = "draft"
    deterministic = False
    needs_lookahead = True

    def __init__(self, runner, sampler: Sampler, shares_target_kv: bool = False):
        self.runner = runner  # a ModelRunner on the draft's weights (over the target's cache when shared)
        self.sampler = sampler
        self.shares_target_kv = shares_target_kv
        self._valid: dict[str, tuple] = {}  # own cache: request id -> (draft KV positions written, preemptions)
        self.num_forwards, self.forward_seconds = 0, 0.0  # the draft's own cost, measured
        self.num_prefill_forwards, self.prefill_seconds = 0, 0.0  # of which catch-ups with a prompt (own cache)
        self.propose_seconds = 0.0  # whole proposals (forwards, sampling, copies)

    def propose_batch(self, items: list) -> list:
        """items: (request, k, its block table per group of layers (Scheduler.reserve_lookahead), sampling state)
        -> [(drafts, q [k, V] or None when greedy)]."""
        if not items:
            return []
        t0 = time.perf_counter()
        order = sorted(range(len(items)), key=lambda i: -items[i][1])  # at step j, order[:n_j] still draft
        its = [items[i] for i in order]
        n_at = [sum(1 for _, k, _, _ in its if k > j) for j in range(its[0][1])]
        plain = not any(not st.params.greedy or reads_history(st) for _, _, _, st in its)
        drafts: list[list[int]] = [[] for _ in its]  # host copies (filled per step unless plain)
        probs: list[list] = [[] for _ in its]
        steps = []  # plain: per step the drafts [n_j] as a tensor, copied to the host once at the end
        if self.shares_target_kv:
            ids = [req.all_token_ids[-1] for req, _, _, _ in its]
            tok = self._draw(its, self._decode_rows(its, 0, ids), plain, drafts, probs)
        else:
            tok = self._catch_up(its, plain, drafts, probs)
        steps.append(tok)
        for j in range(1, len(n_at)):
            n = n_at[j]
            tok = self._draw(its[:n], self._decode_rows(its[:n], j, tok[:n]), plain, drafts[:n], probs[:n])
            steps.append(tok)
        if plain:
            flat = torch.cat(steps).tolist()  # step-major: step j holds the first n_j requests' drafts
            at = 0
            for n in n_at:
                for i in range(n):
                    drafts[i].append(flat[at + i])
                at += n
        if not self.shares_target_kv:
            for (req, k, _, _) in its:
                # positions written: through the (k - 1)-th draft's, at num_tokens - 1 + k - 1
                self._valid[req.request_id] = (req.num_tokens + k - 1, req.num_preemptions)
        out = [None] * len(items)
        for i, d, p in zip(order, drafts, probs):
            out[i] = (d, torch.stack(p) if p else None)
        self.propose_seconds += time.perf_counter() - t0
        return out

    # ---------------------------------------------------------------- one draft forward
    @torch.inference_mode()  # as ModelRunner.execute: the C++ decode plan serves only grad-free steps
    def _decode_rows(self, its: list, j: int, ids) -> torch.Tensor:
        """Logits [n, V] of one one-token row per request: its (j-1)-th draft (j = 0: its last token) at
        position num_tokens - 1 + j. ids: the n input tokens, a host list or a tensor (the previous
        step's drafts, never copied to the host)."""
        t0 = time.perf_counter()
        pos = [req.num_tokens - 1 + j for req, _, _, _ in its]
        batch = self.runner.one_token_rows(ids, pos, [tables for _, _, tables, _ in its])
        r = self.runner
        logits = r.executor.run(batch, r.kv_caches, r.backend, batch.logits_indices)  # [n, V]
        dt = time.perf_counter() - t0
        self.num_forwards += 1
        self.forward_seconds += dt
        return logits

    def _catch_up(self, its: list, plain: bool, drafts: list, probs: list) -> torch.Tensor:
        """Own cache: the first forward, over the tokens the draft has not seen; draft 1 of each request."""
        t0 = time.perf_counter()
        seqs = [self._catch_up_seq(req, tables[0]) for req, _, tables, _ in its]  # (own cache: the first table)
        # one-token queries first (decodes and catch-ups laid out as rows), prompts last
        order = sorted(range(len(its)), key=lambda i: seqs[i].num_new_tokens > 1 and not seqs[i].spec_token_ids)
        logits = self.runner.execute([seqs[i] for i in order], list(range(len(seqs))))  # [P, V]
        ends = list(itertools.accumulate(seqs[i].num_sample_positions for i in order))
        back = [0] * len(its)  # each request's last position, in the batch's (k-sorted) order
        for o, i in enumerate(order):
            back[i] = ends[o] - 1
        logits = logits.index_select(0, torch.tensor(back, device=logits.device))
        self.num_forwards += 1
        dt = time.perf_counter() - t0
        self.forward_seconds += dt
        if any(sq.is_prefill or (sq.num_new_tokens > 1 and not sq.spec_token_ids) for sq in seqs):
            self.num_prefill_forwards += 1
            self.prefill_seconds += dt
        return self._draw(its, logits, plain, drafts, probs)

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

    def _draw(self, its: list, logits: torch.Tensor, plain: bool, drafts: list, probs: list) -> torch.Tensor:
        """Each request's next draft [n] from the draft's logits [n, V]. plain (every request greedy, its
        sampler reading no history): the argmax, as the sampler's fast path takes it, left on the device;
        else through the sampler's distributions at each request's position, appended to drafts (and q
        to probs) on the host."""
        if plain:
            return logits[:, : self.sampler.vocab_size].argmax(dim=-1)
        states = [position_states(st, d)[-1] for (_, _, _, st), d in zip(its, drafts)]
        toks, p = self.sampler.draw(logits, states)  # drafts have no grammar
        greedy = [st.params.greedy for st in states]
        for i, t in enumerate(toks.tolist()):
            drafts[i].append(t)
            if p is not None and not greedy[i]:
                probs[i].append(p[i])
        return toks

    def retain(self, request_ids) -> None:
        """Forget the requests not in request_ids (finished or aborted ones)."""
        keep = set(request_ids)
        self._valid = {r: v for r, v in self._valid.items() if r in keep}
