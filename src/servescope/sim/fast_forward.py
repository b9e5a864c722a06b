"""Fast-forward: an instance's steps that only decode, planned in bulk and applied when needed, with the
state and records that as many single steps give.

A stretch starts when the scheduler says its next step can only decode (Scheduler.decode_batch: nothing
waits, every running request is one token behind, no drafts). Every step after it is the same batch one
position further until a request finishes (its max_tokens or the context: that step is the stretch's last,
applied with its finishes as step() delivers them) or an allocation could fail (the stretch stops before
the step whose new blocks would exceed the blocks free at its start, so nothing in it can preempt).
Such a step's time depends only on the batch's contexts: the plan holds each step's predicted seconds
(StepTimer.decode_seconds, the memo single steps use) and its end, so the instance's next step start
and outstanding tokens at any time are known without touching the scheduler; a router asks for them
(sim/parallel.py).

`commit` applies the planned steps as single steps would have, in their order: for each step, the KV
manager's `allocate_slots(req, 1)` of every request whose step can change its blocks -- the position
starts a block (a new block, when the held ones do not cover it) or fills one (its hash goes into the
prefix cache): the manager's invariants say a request holds ceil(tokens / S) blocks and hashes a block
when the step computing its last token is scheduled, so at any other position the call changes nothing
-- made with the request exactly as that step's schedule() saw it (its tokens and num_computed_tokens);
then the times of every step's tokens, the clock, the instance's counters (summed step by step in the
same order) and, when kept, a StepRecord per step (the KV state as each step leaves it). Without records
the stretch's calls are one (kvcache/decode_steps.allocate_decode_steps: the blocks taken and hashed in
bulk, the state the calls leave) and the peak KV usage is the usage after them (nothing frees blocks in
a stretch). Every token of the stretch (each request's own stream)
is given to its request before the first call, as the calls need only the tokens before their positions
(a call hashes the blocks full within min(position + 1, its tokens): the position bounds it either way).

Windowed layers (one window for every layer, or a hybrid's windowed groups of layers: a table per group) free a
block at the position whose query no longer sees it ((p - window + 1) % S == 0), so in such a stretch the calls
are made step by step as with records -- at each step those of the rows at a block start, a block fill or a
slide, and at its first step every row's (a chunk before it may have left blocks to give back) -- and the bound
is the least of the groups' free blocks at the start (a block start takes a block in every group; blocks freed
meanwhile are not counted). Speculative decoding never fast-forwards.
"""

from __future__ import annotations

from array import array
from itertools import chain
from typing import Optional

from servescope.kvcache.decode_steps import allocate_decode_steps


class DecodeRun:
    """The planned stretch of one SimEngine (start() gives one, or None when the next step cannot start one)."""

    def __init__(self, engine, rows: list):
        self.engine, self.rows = engine, rows
        kv, live, max_len = engine.kv_manager, engine._live, engine._max_model_len
        self.block_size = b = kv.block_size
        # per request: its live entry, its position at the first step, its outputs then, the step at which it gets
        # its last token (max_tokens or the context: it finishes there); and by their position mod S: those at the
        # first position of a block at step j (a new block) are by_phase[-j % S], with prefix caching those at the
        # last (it fills and is hashed) by_phase[(-j-1) % S]. A decode is one token behind: num_tokens = p + 1.
        self.entries, self.p0, self.n_out0, self.last_step = entries, p0, n_out0, last_step = [], [], [], []
        self.by_phase = by_phase = [[] for _ in range(b)]
        for i, r in enumerate(rows):
            e, p, n = live[r.request_id], r.num_computed_tokens, len(r.output_token_ids)
            entries.append(e)
            p0.append(p)
            n_out0.append(n)
            last_step.append(min(e[2] - n, max_len - p - 1) - 1)
            by_phase[p % b].append(i)
        self.sum0 = sum(p0)
        self.finish_step = min(last_step)
        self.cache_steps = kv.num_blocks * b - max(p0)  # (schedule() finishes a request that outgrew the cache)
        self.hashing = kv.enable_prefix_caching and b > 1
        # windowed layers (one window for all, or a hybrid's windowed groups): a block slides out at the position
        # whose query no longer sees it, so the steps are applied one at a time (their calls free blocks)
        groups, self.windows, self.offsets = _layout(engine)
        # (every group takes a block where a block starts)
        self.free0 = kv.num_free_blocks if len(groups) == 1 else min(g.num_free_blocks for g in groups)
        self.allocs = 0  # blocks the planned steps may take (every block start counted)
        self.clock0 = self.clock = engine.clock
        self.plan: list = []  # per planned step: (seconds, prediction, bound, its end)
        self._last: tuple = (None, None)  # (decode shape, decode_seconds) of the last planned step
        self.blocked = False  # the next step cannot be planned: it runs as a single step

    @classmethod
    def start(cls, engine) -> Optional["DecodeRun"]:
        if engine.spec.spec_decode.k:
            return None
        rows = engine.scheduler.decode_batch()
        return cls(engine, rows) if rows else None

    @property
    def steps(self) -> int:
        return len(self.plan)

    def extend_to(self, t: float) -> None:
        """Plan the steps that start before t, as far as the stretch goes (then `blocked`): up to and with the
        first step that finishes a request."""
        plan, b, timer, p0, sum0 = self.plan, self.block_size, self.engine.timer, self.p0, self.sum0
        n, last = len(p0), self._last
        while self.clock < t and not self.blocked:
            j = len(plan)
            new_blocks = len(self.by_phase[-j % b])
            if j >= self.cache_steps or self.allocs + new_blocks > self.free0:
                self.blocked = True
                return
            self.allocs += new_blocks
            shape = timer.decode_shape(n, sum0 + j * n)
            if shape is None or shape != last[0]:  # the step's time changes only with its shape
                last = (shape, timer.decode_seconds(p0, j, sum0))
            seconds, pred, bound = last[1]
            self.clock = self.clock + seconds
            plan.append((seconds, pred, bound, self.clock))
            self.blocked = j == self.finish_step
        self._last = last

    def commit(self) -> list:
        """Apply the planned steps to the scheduler, the KV manager, the requests and the engine's counters;
        the requests the last one finished (Finished), if it is the stretch's finishing step."""
        e, m = self.engine, len(self.plan)
        if not m:
            return []
        rows, p0 = self.rows, self.p0
        ends = array("d", [step[3] for step in self.plan])  # (an array extends an array by copying its bytes)
        for req, entry, p, n in zip(rows, self.entries, p0, self.n_out0):  # every token first: see the docstring
            req.extend_output_tokens(entry[4][n:n + m])
            req.num_computed_tokens = p + m
            entry[1].token_times.extend(ends)
        finishing = m - 1 == self.finish_step
        records = e.steps is not None
        if records or self.windows:
            self._apply_steps(m, finishing, records)
        else:
            self._apply_blocks(m)
        n = len(rows) * m
        e.clock = self.clock
        e.tokens_scheduled += n
        e.seqs_scheduled += n
        e.outstanding_tokens -= n  # each step's token of a request that has its first already
        done = []
        if finishing:  # as step()'s delivery: in the step's order, each through the scheduler's finish_request
            done = [e.finish(self.entries[i], self.clock) for i in range(len(rows)) if self.last_step[i] == m - 1]
            if records:
                seconds, pred, _, _ = self.plan[-1]
                e.num_steps += 1
                e._record_step(pred, self.plan[-2][3] if m > 1 else self.clock0, seconds, 0, len(rows), 0, len(rows),
                               [p + m for p in p0], 0, 0, 0)
        if not records:
            e.num_steps += m
        self.plan = []
        return done

    def _apply_blocks(self, m: int) -> None:
        """The KV calls of the m planned steps in one (kvcache/decode_steps.py: the state their calls leave), the
        engine's busy and bound seconds summed step by step, its peak KV usage (the cache only fills during the
        steps: the usage after them)."""
        e = self.engine
        if not allocate_decode_steps(e.kv_manager, self.rows, self.p0, m):
            raise RuntimeError(f"{e.name}: a fast-forwarded decode found no free block (the stretch's bound)")
        e.peak_kv_usage = max(e.peak_kv_usage, e.kv_manager.usage)
        busy, bound_seconds = e.busy_seconds, e.bound_seconds
        for seconds, _, bound, _ in self.plan:
            busy += seconds
            bound_seconds[bound] += seconds
        e.busy_seconds = busy

    def _apply_steps(self, m: int, finishing: bool, records: bool) -> None:
        """The m planned steps one at a time, with records each with its StepRecord (the KV state as that step
        leaves it): each step's allocate_slots(req, 1) where it can change blocks, then its counters."""
        e, rows, p0, b = self.engine, self.rows, self.p0, self.block_size
        kv = e.kv_manager
        touch: dict = {}
        peak, busy, bound_seconds = e.peak_kv_usage, e.busy_seconds, e.bound_seconds
        start, allocate = self.clock0, kv.allocate_slots
        for j, (seconds, pred, bound, end) in enumerate(self.plan):
            # (with windows every row at the first step: a block may have slid out before it, e.g. a prefill's
            # chunk, and the first call after that gives it back whatever its position)
            touched = list(range(len(rows))) if j == 0 and self.windows else touch.get(j % b)
            if touched is None:
                touched = touch[j % b] = self._touched(j)
            for i in touched:  # as this step's schedule(): the request at its position, then its allocation
                req = rows[i]
                req.num_computed_tokens = p0[i] + j
                if not allocate(req, 1):
                    raise RuntimeError(f"{e.name}: a fast-forwarded decode found no free block (the stretch's bound)")
            if touched or j == 0:
                peak = max(peak, kv.usage)
            busy += seconds
            bound_seconds[bound] += seconds
            e.peak_kv_usage, e.busy_seconds = peak, busy
            if records and not (finishing and j == m - 1):  # the finishing step's after its finishes, as step()'s
                e.num_steps += 1
                e._record_step(pred, start, seconds, 0, len(rows), 0, len(rows), [p + j + 1 for p in p0], 0, 0, 0)
            start = end
        for req, p in zip(rows, p0):
            req.num_computed_tokens = p + m

    def _touched(self, j: int) -> list:
        """The rows whose step j can change blocks, in admission order (schedule()'s): those at a block start,
        with prefix caching those filling one, with windows those whose oldest block slides out (`offsets`)."""
        b, by_phase = self.block_size, self.by_phase
        phases = {(o - j) % b for o in self.offsets}
        if len(phases) == 1:
            return by_phase[phases.pop()]
        return sorted(chain.from_iterable(by_phase[p] for p in phases))


def _layout(engine) -> tuple:
    """(the KV manager's groups of layers, their windows, the step offsets within a block -- position mod S --
    where a call can change blocks: a block starts, one fills (hashed), one slides out of a window, as
    first_in_view moves at (p - w + 1) % S == 0), computed once per engine."""
    layout = engine.decode_layout
    if layout is None:
        kv = engine.kv_manager
        b = kv.block_size
        groups = getattr(kv, "groups", (kv,))
        windows = tuple(g.window for g in groups if g.window)
        hashing = kv.enable_prefix_caching and b > 1
        offsets = frozenset({0} | ({b - 1} if hashing else set()) | {(w - 1) % b for w in windows})
        layout = engine.decode_layout = (groups, windows, offsets)
    return layout
