"""Chrome trace export (the JSON "Trace Event Format" that Perfetto and chrome://tracing open).

What the trace holds:
- pid 1 "engine", tid 1 "steps": one complete ("X") slice per engine step, named by its phase
  (prefill / decode / mixed), with the step's tokens, measured and predicted time, bound and
  achieved GB/s and FLOP/s in `args`;
- counters ("C") on pid 1: KV cache usage %, KV blocks used / cached, running and waiting requests,
  one sample at the start of each step (the state the step ended with, as the StepRecord holds it);
- pid 2 "requests" (when request outputs are given): one async track per request sample, a parent
  slice from arrival to finish with nested queue / prefill / decode slices (async "b"/"e" pairs
  sharing the request's id), from the RequestMetrics timestamps.

Times are time.perf_counter() seconds in the records; the trace uses microseconds relative to the
earliest timestamp found, so it starts at 0. The file is written to a temporary file in the same
directory and renamed over the target: a reader never sees half a trace, and an error leaves any
previous file untouched.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from servescope.telemetry.live import moe_fields

ENGINE_PID = 1
STEPS_TID = 1
REQUESTS_PID = 2


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _metrics_of(outputs: Optional[Iterable]) -> list:
    """(label, RequestMetrics) for every sample of every RequestOutput that carries metrics."""
    found = []
    for out in outputs or ():
        samples = getattr(out, "outputs", None) or []
        for c in samples:
            m = getattr(c, "metrics", None)
            if m is None:
                continue
            label = out.request_id if len(samples) == 1 else f"{out.request_id}#{c.index}"
            found.append((label, m))
    return found


def _origin(step_records: Sequence, metrics: list) -> float:
    times = [r.start_time for r in step_records]
    for _, m in metrics:
        times.append(m.arrival_time)
    return min(times) if times else 0.0


def _step_events(step_records: Sequence, t0: float) -> list:
    events = []
    for r in step_records:
        ts = _us(r.start_time, t0)
        bps, fps = r.achieved_bytes_per_s, r.achieved_flops_per_s
        args = {
            "step": r.step,
            "tokens": r.num_tokens,
            "prefill_tokens": r.num_prefill_tokens,
            "decode_tokens": r.num_decode_tokens,
            "prefill_seqs": r.num_prefill_seqs,
            "decode_seqs": r.num_decode_seqs,
            "max_context": max(r.context_lens) if r.context_lens else 0,
            "measured_ms": round(r.wall_seconds * 1e3, 4),
            "predicted_ms": None if r.predicted_seconds is None else round(r.predicted_seconds * 1e3, 4),
            "bound": r.bound,
            "GB/s": None if bps is None else round(bps / 1e9, 3),
            "GFLOP/s": None if fps is None else round(fps / 1e9, 3),
            "hardware": r.hardware,
        }
        moe = moe_fields(r)
        if moe:  # (a mixture of experts: its routing, as the live view sends it)
            args["moe"] = moe
        events.append({"name": r.phase, "cat": "step", "ph": "X", "ts": ts,
                       "dur": round(max(r.wall_seconds, 0.0) * 1e6, 3),
                       "pid": ENGINE_PID, "tid": STEPS_TID, "args": args})
        counters = {
            "KV usage %": {"usage": round(100.0 * r.kv_usage, 3)},
            "KV blocks": {"used": r.kv_blocks_used, "cached": r.kv_blocks_cached},
            "requests": {"running": r.num_running, "waiting": r.num_waiting},
        }
        for name, cargs in counters.items():
            events.append({"name": name, "ph": "C", "ts": ts, "pid": ENGINE_PID, "args": cargs})
    return events


def _request_events(metrics: list, t0: float) -> list:
    """Nested async slices per request: request > queue, prefill, decode."""
    events = []
    for i, (label, m) in enumerate(metrics):
        end = m.finished_time
        if end is None:
            end = m.token_times[-1] if m.token_times else (m.first_scheduled_time or m.arrival_time)
        if m.token_times:
            end = max(end, m.token_times[-1])
        end = max(end, m.arrival_time)
        common = {"cat": "request", "id": i + 1, "pid": REQUESTS_PID, "tid": i + 1}
        spans = []
        if m.first_scheduled_time is not None:
            spans.append(("queue", m.arrival_time, m.first_scheduled_time))
            if m.token_times:
                spans.append(("prefill", m.first_scheduled_time, m.token_times[0]))
                if len(m.token_times) > 1 or end > m.token_times[0]:
                    spans.append(("decode", m.token_times[0], end))
        outer_args = {"prompt_tokens": m.num_prompt_tokens, "output_tokens": m.num_output_tokens,
                      "cached_tokens": m.num_cached_tokens, "preemptions": m.num_preemptions,
                      "ttft_ms": None if m.ttft is None else round(m.ttft * 1e3, 4),
                      "tpot_ms": None if m.tpot is None else round(m.tpot * 1e3, 4)}
        events.append({**common, "name": f"request {label}", "ph": "b", "ts": _us(m.arrival_time, t0),
                       "args": outer_args})
        for name, a, b in spans:
            events.append({**common, "name": name, "ph": "b", "ts": _us(a, t0)})
            events.append({**common, "name": name, "ph": "e", "ts": _us(max(a, b), t0)})
        events.append({**common, "name": f"request {label}", "ph": "e", "ts": _us(end, t0)})
    return events


def _metadata(has_requests: bool) -> list:
    meta = [
        {"name": "process_name", "ph": "M", "pid": ENGINE_PID, "args": {"name": "engine"}},
        {"name": "thread_name", "ph": "M", "pid": ENGINE_PID, "tid": STEPS_TID, "args": {"name": "steps"}},
    ]
    if has_requests:
        meta.append({"name": "process_name", "ph": "M", "pid": REQUESTS_PID, "args": {"name": "requests"}})
    return meta


def chrome_trace(step_records: Sequence, request_outputs: Optional[Iterable] = None) -> dict:
    """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": "ms"}, events sorted by time
    (metadata first; at equal times a slice's begin comes before anything it contains)."""
    steps = list(step_records)
    metrics = _metrics_of(request_outputs)
    t0 = _origin(steps, metrics)
    timed = _step_events(steps, t0) + _request_events(metrics, t0)
    # a stable sort keeps each request's b/e pairs in the order written when timestamps tie
    timed.sort(key=lambda e: e["ts"])
    return {"traceEvents": _metadata(bool(metrics)) + timed, "displayTimeUnit": "ms",
            "otherData": {"producer": "servescope", "time_origin_perf_counter_s": t0}}


def write_chrome_trace(path: Union[str, Path], step_records: Sequence,
                       request_outputs: Optional[Iterable] = None) -> Path:
    """Write `chrome_trace(...)` to `path` atomically (temp file in the same directory + rename)."""
    path = Path(path)
    trace = chrome_trace(step_records, request_outputs)
    text = json.dumps(trace, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
