"""Read back a Chrome trace written by telemetry/trace.py, for replaying a recorded run.

What comes back is what the trace holds: per step its phase mix, tokens, measured and predicted
time, FLOP/s and GB/s (hence FLOPs and bytes), and the KV and queue counters sampled at its start;
per request its TTFT, TPOT and finish time. A trace holds no block map and no queue contents, so a
replay shows their counts only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from servescope.errors import InvalidParameterError


@dataclass
class RecordedRun:
    steps: list  # step events in telemetry/live.step_event's form, in time order ("t" in ms from 0)
    requests: list = field(default_factory=list)  # (finish ms, ttft s or None, tpot s or None), by finish
    hardware: Optional[str] = None
    num_blocks: Optional[int] = None  # estimated from the usage counter (used / usage)

    @property
    def duration_ms(self) -> float:
        ends = [s["t"] + s["ms"] for s in self.steps] + [r[0] for r in self.requests]
        return max(ends, default=0.0)


def _counters(events: list) -> dict:
    """ts -> merged counter args (KV usage %, KV blocks, requests) sampled at that time."""
    by_ts: dict = {}
    for e in events:
        if e.get("ph") == "C":
            by_ts.setdefault(e["ts"], {})[e.get("name")] = e.get("args", {})
    return by_ts


def _step(e: dict, counters: dict) -> dict:
    a = e.get("args", {})
    ms = float(a.get("measured_ms") or e.get("dur", 0) / 1e3)
    gflops, gbs = a.get("GFLOP/s"), a.get("GB/s")
    c = counters.get(e["ts"], {})
    usage = c.get("KV usage %", {}).get("usage")
    return {
        "step": int(a.get("step", 0)), "t": e["ts"] / 1e3, "ms": ms, "pred_ms": a.get("predicted_ms"),
        "phase": e.get("name", "decode"), "prefill_tokens": int(a.get("prefill_tokens", 0)),
        "decode_tokens": int(a.get("decode_tokens", 0)), "prefill_seqs": int(a.get("prefill_seqs", 0)),
        "decode_seqs": int(a.get("decode_seqs", 0)),
        "flops": None if gflops is None else gflops * 1e9 * ms / 1e3,
        "bytes": None if gbs is None else gbs * 1e9 * ms / 1e3, "bound": a.get("bound"),
        "kv_used": int(c.get("KV blocks", {}).get("used", 0)),
        "kv_cached": int(c.get("KV blocks", {}).get("cached", 0)),
        "kv_usage": None if usage is None else usage / 100.0,
        "running": int(c.get("requests", {}).get("running", 0)),
        "waiting": int(c.get("requests", {}).get("waiting", 0)),
        "preemptions": 0,
        **_moe(a.get("moe")),
    }


MOE_NUMBERS = ("moe_active", "moe_expected", "moe_imbalance", "moe_bytes", "moe_rank_imbalance", "a2a_ms")
MOE_LISTS = ("moe_tokens", "moe_rank_rows")


def _moe(d) -> dict:
    """A step's mixture-of-experts routing (telemetry/live.moe_fields) as the trace holds it: only its known
    keys, numbers and lists of numbers (a trace is a file from anywhere; the page draws what comes)."""
    if not isinstance(d, dict) or not isinstance(d.get("moe_tokens"), list):
        return {}
    num = (int, float)
    out = {k: d[k] if isinstance(d.get(k), num) and not isinstance(d.get(k), bool) else None for k in MOE_NUMBERS}
    out.update({k: d[k] for k in MOE_LISTS if isinstance(d.get(k), list)
                and all(isinstance(x, num) and not isinstance(x, bool) for x in d[k])})
    if "moe_rank_rows" not in out:  # (one process: no expert-parallel fields, as live sends none)
        out = {k: v for k, v in out.items() if k not in ("moe_rank_imbalance", "a2a_ms")}
    return out if "moe_tokens" in out else {}


def _requests(events: list) -> list:
    """(finish ms, ttft s, tpot s) of each request's outer slice ("request ..." b/e pair)."""
    begins, out = {}, []
    for e in events:
        if e.get("cat") != "request" or not str(e.get("name", "")).startswith("request "):
            continue
        if e.get("ph") == "b":
            begins[e.get("id")] = e.get("args", {})
        elif e.get("ph") == "e" and e.get("id") in begins:
            a = begins.pop(e.get("id"))
            ttft, tpot = a.get("ttft_ms"), a.get("tpot_ms")
            out.append((e["ts"] / 1e3, None if ttft is None else ttft / 1e3, None if tpot is None else tpot / 1e3))
    return sorted(out)


def read_recorded_run(source: Union[str, Path, dict]) -> RecordedRun:
    """A trace file (or its parsed dict) as a RecordedRun; InvalidParameterError when it is not a
    servescope trace with at least one step."""
    if isinstance(source, dict):
        trace = source
    else:
        try:
            trace = json.loads(Path(source).read_text())
        except OSError as e:
            raise InvalidParameterError("trace", f"cannot read {source}: {e.strerror or e}") from None
        except ValueError as e:
            raise InvalidParameterError("trace", f"{source} is not JSON: {e}") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise InvalidParameterError("trace", "not a Chrome trace (no traceEvents list)")
    events = [e for e in events if isinstance(e, dict) and isinstance(e.get("ts", 0), (int, float))]
    counters = _counters(events)
    steps = sorted((_step(e, counters) for e in events if e.get("cat") == "step" and e.get("ph") == "X"),
                   key=lambda s: s["t"])
    if not steps:
        raise InvalidParameterError("trace", "the trace holds no engine steps (write one with --trace)")
    hardware = next((e["args"].get("hardware") for e in events if e.get("cat") == "step"
                     and isinstance(e.get("args"), dict) and e["args"].get("hardware")), None)
    # the fullest sample gives the closest estimate (the usage counter is rounded)
    fullest = max((s for s in steps if s["kv_usage"]), key=lambda s: s["kv_used"], default=None)
    num_blocks = round(fullest["kv_used"] / fullest["kv_usage"]) if fullest else None
    return RecordedRun(steps=steps, requests=_requests(events), hardware=hardware, num_blocks=num_blocks)
