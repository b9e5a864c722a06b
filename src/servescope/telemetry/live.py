"""Plain data for live views of a running engine: the compact form of a step on the wire, latency
histograms with fixed buckets, and the bounded frame queue each viewer reads from.

Bounded by construction: a histogram is a fixed list of counts whatever the number of requests; a
FrameQueue holds at most `maxsize` frames and drops the oldest when a new one arrives while it is
full (counting what it dropped), so a viewer that stops reading costs a few frames of memory and
never makes the producer wait.
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Optional

# step fields that only some steps fill (speculative decoding, parallel communication), as wire name ->
# StepRecord field: on the wire only when the step verified drafts / communicated, so that their
# panels appear only then
SPEC_STEP_FIELDS = {"spec_proposed": "num_draft_tokens", "spec_accepted": "num_accepted_tokens"}
COMM_STEP_FIELDS = {"comm_seconds": "comm_seconds"}

# latency histogram buckets: log-spaced edges in milliseconds, 4 per decade from 0.1 ms to 100 s
HIST_EDGES_MS = tuple(round(10 ** (k / 4 - 1), 4) for k in range(25))


def _round(x: Optional[float], digits: int = 4) -> Optional[float]:
    return None if x is None or not math.isfinite(x) else round(x, digits)


def step_event(rec, t0: float) -> dict:
    """What a viewer needs of one StepRecord (times in ms, `t` from t0, the engine's start)."""
    d = {
        "step": rec.step, "t": _round((rec.start_time - t0) * 1e3, 3), "ms": _round(rec.wall_seconds * 1e3),
        "pred_ms": _round(None if rec.predicted_seconds is None else rec.predicted_seconds * 1e3),
        "phase": rec.phase, "prefill_tokens": rec.num_prefill_tokens, "decode_tokens": rec.num_decode_tokens,
        "prefill_seqs": rec.num_prefill_seqs, "decode_seqs": rec.num_decode_seqs,
        "flops": rec.flops, "bytes": rec.bytes, "bound": rec.bound,
        "kv_used": rec.kv_blocks_used, "kv_cached": rec.kv_blocks_cached, "kv_usage": _round(rec.kv_usage),
        "running": rec.num_running, "waiting": rec.num_waiting, "preemptions": rec.num_preemptions_total,
    }
    if getattr(rec, "num_draft_tokens", 0):
        d.update({wire: getattr(rec, field) for wire, field in SPEC_STEP_FIELDS.items()})
    if getattr(rec, "comm_bytes", 0):  # a parallel engine's step (one process communicates nothing)
        d.update({wire: getattr(rec, field) for wire, field in COMM_STEP_FIELDS.items()})
    d.update(moe_fields(rec))
    return d


def moe_fields(rec) -> dict:
    """A mixture-of-experts step's routing on the wire (telemetry/moe.py; empty for a dense step): distinct
    experts per layer, the uniform expectation, imbalance, bytes, tokens per expert; under expert parallelism
    also the (token, expert) rows each rank ran, their imbalance and the all-to-alls' time. A Chrome trace
    carries the same dict (telemetry/trace.py), so a replay draws the expert panel too."""
    if not rec.moe_experts_active:
        return {}
    active = rec.moe_experts_active
    d = {"moe_active": _round(sum(active) / len(active), 3), "moe_expected": _round(rec.moe_expected_experts, 3),
         "moe_imbalance": _round(rec.moe_imbalance, 3), "moe_bytes": rec.moe_expert_bytes,
         "moe_tokens": list(rec.moe_tokens_per_expert)}
    if rec.moe_rows_per_rank:
        d.update({"moe_rank_rows": list(rec.moe_rows_per_rank), "moe_rank_imbalance": _round(rec.moe_rank_imbalance, 3),
                  "a2a_ms": _round(rec.all_to_all_seconds * 1e3)})
    return d


class Histogram:
    """Counts of values (seconds) in the HIST_EDGES_MS buckets: counts[i] holds edges[i-1] <= v <
    edges[i] (counts[0] below the first edge, counts[-1] at or above the last)."""

    def __init__(self):
        self.counts = [0] * (len(HIST_EDGES_MS) + 1)
        self.total = 0

    def add(self, seconds: float) -> None:
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            return
        i = bisect.bisect_right(HIST_EDGES_MS, seconds * 1e3)
        self.counts[i] += 1
        self.total += 1


class LatencyHistograms:
    """TTFT, TPOT and ITL of finished requests (vLLM's definitions, telemetry/request_metrics.py),
    fed with RequestOutputs: `on_output` is an AsyncEngine output listener (engine thread)."""

    def __init__(self):
        self.ttft, self.tpot, self.itl = Histogram(), Histogram(), Histogram()
        self.finished = 0

    def on_output(self, out, new_tokens: int = 0) -> None:
        if not out.finished:
            return
        for o in out.outputs:
            m = o.metrics
            if m is None:
                continue
            self.finished += 1
            self.ttft.add(m.ttft)
            self.tpot.add(m.tpot)
            for gap in m.itls:
                self.itl.add(gap)

    def add_request(self, ttft: Optional[float], tpot: Optional[float]) -> None:
        """A finished request known only by its TTFT and TPOT (a replayed trace has no ITLs)."""
        self.finished += 1
        self.ttft.add(ttft)
        self.tpot.add(tpot)

    def as_dict(self) -> dict:
        return {"edges_ms": list(HIST_EDGES_MS), "finished": self.finished,
                "ttft": list(self.ttft.counts), "tpot": list(self.tpot.counts), "itl": list(self.itl.counts)}


class FrameQueue:
    """At most `maxsize` frames for one viewer; `put` never blocks: when full, the oldest frame is
    dropped and counted in `dropped` (a viewer that falls behind sees the newest state)."""

    def __init__(self, maxsize: int = 8):
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        self._frames: collections.deque = collections.deque(maxlen=maxsize)
        self.maxsize = maxsize
        self.dropped = 0

    def put(self, frame) -> None:
        if len(self._frames) == self.maxsize:
            self.dropped += 1  # the deque's maxlen drops the oldest
        self._frames.append(frame)

    def get(self):
        """The oldest frame, or None when empty."""
        return self._frames.popleft() if self._frames else None

    def __len__(self) -> int:
        return len(self._frames)
