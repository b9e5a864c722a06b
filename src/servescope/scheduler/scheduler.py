"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption.

There is no prefill phase nor decode phase. Each request has num_computed_tokens (tokens whose KV
is cached) and num_tokens (prompt + outputs); every step the scheduler gives each request a
number of new tokens so that num_computed_tokens catches up with num_tokens. A decode is a
request one token behind; a prefill chunk is a request further behind. When a step brings a
request level (num_computed + num_new == num_tokens) its last token's logits are sampled and
the request is one token behind again. Pure Python: no torch, no model.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from typing import Callable, Optional

from servescope.config import SchedulerConfig
from servescope.errors import InvalidParameterError
from servescope.kvcache.manager import KVCacheManager
from servescope.scheduler.output import ScheduledSequence, SchedulerOutput
from servescope.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.config = config
        self.kv_manager = kv_manager
        self.block_size = kv_manager.block_size
        if config.block_size != kv_manager.block_size:
            logger.warning(
                "SchedulerConfig.block_size (%d) differs from the KV cache's (%d); using the cache's",
                config.block_size, kv_manager.block_size,
            )
        self._clock = clock  # stamps first_scheduled_time; use the clock arrival_time comes from
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: list[Request] = []  # sorted by _order_key
        self._running: list[Request] = []  # in admission order
        self._order: dict[str, tuple] = {}  # request id -> (priority, arrival_time, add sequence)
        self._seq = itertools.count()
        self._finished_to_report: list[Request] = []
        self._num_preemptions = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    def has_unfinished(self) -> bool:
        """True while a request waits, runs, or finished here and is not yet reported by schedule()."""
        return bool(self._waiting or self._running or self._finished_to_report)

    def queues(self) -> dict:
        """Request ids by queue, for live views: running (admission order), waiting (the order they
        will be admitted in; preempted ones among them) and preempted (waiting to recompute)."""
        waiting = [r.request_id for r in self._waiting]
        preempted = [r.request_id for r in self._waiting if r.status is RequestStatus.PREEMPTED]
        return {"running": [r.request_id for r in self._running], "waiting": waiting, "preempted": preempted}

    def running_requests(self) -> list[Request]:
        """The running requests, in admission order (a copy)."""
        return list(self._running)

    def get_request(self, request_id: str) -> Optional[Request]:
        return self._requests.get(request_id)

    def _order_key(self, request: Request) -> tuple:
        return self._order[request.request_id]

    # -- admission control -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. One that can never run (empty, longer than max_model_len - 1, or
        whose prompt + 1 token needs more blocks than the whole cache) is finished at once with
        FINISHED_ERROR and reported in the next SchedulerOutput.finished_requests."""
        rid = request.request_id
        if rid in self._requests:
            raise InvalidParameterError("request_id", f"request id {rid!r} is already in use")
        error = self._never_fits(request.num_prompt_tokens)
        if error is not None:
            self._finish_with_error(request, error)
            return
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self._order[rid] = (request.priority, request.arrival_time, next(self._seq))
        bisect.insort(self._waiting, request, key=self._order_key)

    def _never_fits(self, num_prompt_tokens: int) -> Optional[str]:
        max_len = self.config.max_model_len
        if num_prompt_tokens == 0:
            return "the prompt is empty; it needs at least one token"
        if num_prompt_tokens > max_len - 1:
            return (
                f"the prompt has {num_prompt_tokens} tokens but max_model_len is {max_len}: it must "
                f"leave room for at least one generated token (at most {max_len - 1} prompt tokens)"
            )
        need = self.kv_manager.num_blocks_for(num_prompt_tokens + 1)
        if need > self.kv_manager.num_blocks:
            return (
                f"the prompt has {num_prompt_tokens} tokens; with one generated token it needs {need} KV "
                f"blocks of {self.block_size} tokens, but the whole cache holds {self.kv_manager.num_blocks} "
                f"({self.kv_manager.num_blocks * self.block_size} tokens)"
            )
        return None

    def _finish_with_error(self, request: Request, error: str) -> None:
        logger.warning("request %s cannot be served: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error
        self._finished_to_report.append(request)

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens.

        Budgets: at most max_num_batched_tokens tokens and max_num_seqs sequences.

        1. RUNNING requests, in admission order. Each gets
           num_new_tokens = min(num_tokens - num_computed_tokens, tokens left in the budget):
           1 for a decode, a chunk for a partly prefilled request (without chunked prefill a
           request that does not fit whole waits for the next step). If its blocks cannot be
           allocated, the lowest-priority running request -- the largest (priority, arrival),
           i.e. the latest of the lowest-priority class, possibly the request itself -- is
           preempted: its blocks are freed, num_computed_tokens = 0, status PREEMPTED, and it
           goes back to the waiting queue (at the front of its priority class); if it was
           already scheduled this step it is taken out of the step. Then allocation is retried.
        2. Only if nothing was preempted: WAITING requests in (priority, arrival) order. Each
           takes its longest prefix-cache hit (never the last token), then
           num_new_tokens = min(num_tokens - num_computed_tokens, tokens left) (without
           chunked prefill only if the whole remainder fits). A preempted request recomputes
           prompt + outputs so far and may hit the cache. The first request whose blocks
           cannot be allocated stops admission (FCFS: nobody skips ahead).

        The token budget never splits a request's KV: allocation precedes the budget charge, and
        a request gets blocks only for tokens it is scheduled for.
        """
        token_budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledSequence] = {}  # insertion order = order chosen
        preempted: list[str] = []
        finished: list[Request] = self._finished_to_report
        self._finished_to_report = []
        token_budget = self._schedule_running(token_budget, scheduled, preempted, finished)
        if not preempted:
            self._schedule_waiting(token_budget, scheduled, finished)

        seqs = list(scheduled.values())
        num_prefill = num_total = 0
        for s in seqs:
            num_total += s.num_new_tokens
            if s.is_prefill:
                num_prefill += s.num_new_tokens
        if num_prefill:  # decodes first (a prefill always has tokens: no prefill, nothing to move)
            seqs = [s for s in seqs if not s.is_prefill] + [s for s in seqs if s.is_prefill]
        return SchedulerOutput(
            scheduled=seqs,
            total_num_scheduled_tokens=num_total,
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_total - num_prefill,
            preempted_request_ids=preempted,
            finished_requests=finished,
            num_waiting=len(self._waiting),
            num_running=len(self._running),
        )

    def _schedule_running(self, token_budget: int, scheduled: dict, preempted: list, finished: list) -> int:
        """Step 1 of schedule(): the running requests, preempting when blocks run out. Fills the step's
        `scheduled`, `preempted` and `finished`; returns the token budget left."""
        kv = self.kv_manager
        running = self._running
        chunked = self.config.enable_chunked_prefill
        cache_tokens = kv.num_blocks * kv.block_size  # num_blocks_for(n) > num_blocks  <=>  n > cache_tokens
        i = 0
        while i < len(running) and token_budget > 0:
            req = running[i]
            start, num_tokens = req.num_computed_tokens, req.num_tokens
            num_new = num_tokens - start
            if num_new <= 0:  # nothing to compute (the engine sampled no token for it); skip
                i += 1
                continue
            if num_tokens > cache_tokens:  # it outgrew the whole cache: no amount of preemption helps
                running.pop(i)
                self._finish_outgrown(req)
                finished.append(req)
                continue
            if num_new > token_budget:
                if not chunked:
                    i += 1
                    continue
                num_new = token_budget
            spec = self._take_spec_tokens(req, num_new, token_budget) if req.spec_token_ids else ()
            num_new += len(spec)
            if spec and not kv.allocate_slots(req, num_new):
                num_new -= len(spec)  # no room to verify drafts: decode plainly before preempting anyone
                spec = ()
            while not kv.allocate_slots(req, num_new):
                victim = max(running, key=self._order_key)
                j = running.index(victim)
                running.pop(j)
                if j < i:
                    i -= 1
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    token_budget += undone.num_new_tokens
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = self._make_seq(req, start, num_new, spec)
                token_budget -= num_new
                i += 1
        return token_budget

    def decode_batch(self) -> Optional[list[Request]]:
        """The running requests (admission order, a copy) when the next schedule() can do nothing but give
        each of them one decode token, else None: nothing waits or is to be reported, every running request
        has an output and is one token behind it with no drafts, they all fit the token budget, and none
        outgrew the cache (the checks of _schedule_running's loop, for num_new = 1). Blocks are not looked
        at: a decode whose new block cannot be allocated still preempts. While no request finishes and no
        allocation fails, the steps after such a step are such steps too, each request one position further
        (a simulator may apply them at once, calling allocate_slots(req, 1) wherever it can change blocks)."""
        running, budget = self._running, self.config.max_num_batched_tokens
        if self._waiting or self._finished_to_report or not running or len(running) > budget:
            return None
        cache_tokens = self.kv_manager.num_blocks * self.kv_manager.block_size
        for req in running:
            n = req.num_tokens
            if req.spec_token_ids or not req.output_token_ids or req.num_computed_tokens != n - 1 or n > cache_tokens:
                return None
        return list(running)

    def _take_spec_tokens(self, req: Request, num_new: int, token_budget: int) -> tuple:
        """The request's drafts to verify this step (consumed: the proposer sets new ones after the
        step). Only a decode speculates; the drafts are cut to the step's token budget and so that
        all its KV positions stay below max_model_len."""
        spec, req.spec_token_ids = req.spec_token_ids, []
        if not spec or num_new != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return ()
        room = min(token_budget - 1, self.config.max_model_len - req.num_tokens)
        return tuple(spec[:max(room, 0)])

    def _schedule_waiting(self, token_budget: int, scheduled: dict, finished: list) -> int:
        """Step 2 of schedule(): admit waiting requests in order until one does not fit. Fills the
        step's `scheduled` and `finished`; returns the token budget left."""
        kv = self.kv_manager
        while self._waiting and token_budget > 0 and len(self._running) < self.config.max_num_seqs:
            req = self._waiting[0]
            if kv.num_blocks_for(req.num_tokens) > kv.num_blocks:
                self._waiting.pop(0)
                self._finish_outgrown(req)
                finished.append(req)
                continue
            computed_blocks, num_cached = kv.get_computed_blocks(req)
            if req.sampling_params.prompt_logprobs is not None:
                computed_blocks, num_cached = [], 0  # every prompt position's logits are due
            num_new = req.num_tokens - num_cached
            if num_new > token_budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, token_budget)
            if not kv.allocate_slots(req, num_new, computed_blocks, num_cached):
                break
            self._waiting.pop(0)
            self._running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self._clock()
            scheduled[req.request_id] = self._make_seq(req, num_cached, num_new)
            token_budget -= num_new
        return token_budget

    def _make_seq(self, req: Request, start: int, num_new: int, spec: tuple = ()) -> ScheduledSequence:
        num_tokens = req.num_tokens
        return ScheduledSequence(
            req, num_new, start, self.kv_manager.get_block_ids(req.request_id),
            # prompt (or recompute) tokens: everything before the last known token, and a whole
            # one-token prompt on its first step
            start < num_tokens - 1 or start < req.num_prompt_tokens,  # is_prefill
            start + num_new - len(spec) == num_tokens,  # will_sample
            spec,
            self.kv_manager.get_group_block_ids(req.request_id),
        )

    def _preempt(self, req: Request) -> None:
        """Drop a request's KV and queue it again (it recomputes later). Not in _running any more."""
        self.kv_manager.free(req)  # before resetting num_computed_tokens: free() reads it
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._num_preemptions += 1
        bisect.insort(self._waiting, req, key=self._order_key)
        logger.debug("preempted %s (%d tokens)", req.request_id, req.num_tokens)

    def _finish_outgrown(self, req: Request) -> None:
        """A request whose tokens need more blocks than the whole cache holds can never run
        again: it ends with FINISHED_ERROR instead of being preempted forever. (The engine caps
        max_model_len to the cache, so this is a guard, not a normal path.)"""
        need = self.kv_manager.num_blocks_for(req.num_tokens)
        self.kv_manager.free(req)
        req.status = RequestStatus.FINISHED_ERROR
        req.error = (
            f"the request grew to {req.num_tokens} tokens, which need {need} KV blocks of {self.block_size} "
            f"tokens, but the whole cache holds {self.kv_manager.num_blocks}"
        )
        logger.warning("request %s: %s", req.request_id, req.error)
        self._forget(req)

    # -- after the model ran ---------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled: dict) -> None:
        """Advance num_computed_tokens by what the step computed and append sampled tokens.

        sampled: request id -> its token, or its tokens (a speculating request: the accepted drafts then the
        target's own token). The KV of rejected drafts is rolled back: num_computed_tokens counts only verified
        positions and blocks past the request's tokens go back to the free list. Blocks that the sampled tokens
        will fill are hashed when the step that computes their KV is scheduled (allocate_slots), so nothing is
        hashed here. Requests finished since schedule() (aborted in between) are skipped."""
        requests, running = self._requests, RequestStatus.RUNNING
        for seq in output.scheduled:
            req = seq.request
            rid = req.request_id
            if req.status is not running or requests.get(rid) is not req:
                continue
            assert req.num_computed_tokens == seq.num_computed_tokens, f"{rid}: step applied twice"
            num_spec = len(seq.spec_token_ids)
            req.num_computed_tokens += seq.num_new_tokens - num_spec
            if seq.will_sample:
                toks = sampled.get(rid)
                if type(toks) is int and not num_spec:  # one token, no drafts: every decode row, at once
                    req.append_output_token(toks)
                    continue
                toks = () if toks is None else (toks,) if isinstance(toks, int) else list(toks)
                assert len(toks) <= num_spec + 1, f"{rid}: {len(toks)} tokens for {num_spec} drafts"
                if len(toks) > 1:
                    assert list(seq.spec_token_ids[:len(toks) - 1]) == toks[:-1], "accepted tokens are drafts"
                    req.num_computed_tokens += len(toks) - 1  # the accepted drafts' KV is verified
                for tok in toks:
                    req.append_output_token(tok)
            if num_spec:
                self.kv_manager.rollback(req, req.num_tokens)

    def reserve_lookahead(self, request_id: str, num_tokens: int) -> Optional[tuple]:
        """Blocks for num_tokens positions past a running request's computed ones (a draft model writes
        its own KV there before the next step verifies), without hashing anything. The request's block
        table per group of layers (the KV manager's order; one table for all layers: a 1-tuple), or None
        (nothing changed) when the cache has no room."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return None
        if not self.kv_manager.allocate_slots(req, 0, num_lookahead_tokens=num_tokens):
            return None
        return self.kv_manager.get_group_block_ids(request_id) or (self.kv_manager.get_block_ids(request_id),)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request wherever it is (waiting, mid-prefill, decoding) and free its blocks
        at once. Unknown or already finished ids are ignored.

        Call it between update_from_output() and the next schedule(): a request in the step
        being run may be sharing blocks that this step writes for it.
        """
        if not status.is_finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status}")
        req = self._requests.get(request_id)
        if req is None:
            return
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self.kv_manager.free(req)
        req.status = status
        self._forget(req)

    def _forget(self, req: Request) -> None:
        del self._requests[req.request_id]
        del self._order[req.request_id]

    def discard_kv(self, request_id: str) -> None:
        """Drop a running request's KV but keep it running in place: next step recomputes all
        its tokens (the no-KV-cache baseline)."""
        req = self._requests[request_id]
        assert req.status is RequestStatus.RUNNING, f"discard_kv of a {req.status.name} request"
        self.kv_manager.free(req)
        req.num_computed_tokens = 0
