"""Chrome trace writer: valid JSON, the fields Perfetto needs, time ordering, atomic writes."""

import json
import os

import pytest

from servescope.engine.outputs import CompletionOutput, RequestOutput
from servescope.telemetry.request_metrics import RequestMetrics
from servescope.telemetry.step_record import StepRecord
from servescope.telemetry.trace import chrome_trace, write_chrome_trace

T0 = 1000.0  # perf_counter seconds: the trace must start at 0 whatever the clock says


def _step(i, start, wall, prefill=0, decode=0, predicted=0.002, used=3, waiting=0):
    return StepRecord(step=i, start_time=start, wall_seconds=wall, num_prefill_seqs=1 if prefill else 0,
                      num_decode_seqs=decode, num_prefill_tokens=prefill, num_decode_tokens=decode,
                      context_lens=[prefill or 10], kv_blocks_used=used, kv_blocks_free=10 - used,
                      kv_blocks_cached=1, kv_usage=used / 10, num_running=1, num_waiting=waiting,
                      num_preemptions_total=0, predicted_seconds=predicted, flops=2e9, bytes=5e8,
                      bound="memory", hardware="local-cpu")


def _records():
    return [_step(1, T0 + 0.010, 0.050, prefill=32, waiting=1),
            _step(2, T0 + 0.061, 0.004, decode=1),
            _step(3, T0 + 0.066, 0.005, prefill=16, decode=1, used=5)]


def _outputs():
    m = RequestMetrics(arrival_time=T0, first_scheduled_time=T0 + 0.010,
                       token_times=[T0 + 0.060, T0 + 0.065, T0 + 0.071], finished_time=T0 + 0.072,
                       num_prompt_tokens=32)
    return [RequestOutput("r1", None, [1] * 32, [CompletionOutput(0, "", [5, 6, 7], "length", metrics=m)],
                          finished=True)]


def test_trace_is_valid_json_with_step_slices_and_counters(tmp_path):
    path = write_chrome_trace(tmp_path / "t.json", _records())
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["prefill", "decode", "mixed"]
    first = slices[0]
    assert first["ts"] == 0  # relative to the earliest event
    assert first["dur"] == pytest.approx(50_000)
    assert {"pid", "tid", "ts", "dur", "args"} <= set(first)
    args = first["args"]
    assert args["tokens"] == 32 and args["prefill_tokens"] == 32 and args["decode_tokens"] == 0
    assert args["predicted_ms"] == pytest.approx(2.0)
    assert args["bound"] == "memory"
    assert args["GB/s"] == pytest.approx(5e8 / 0.050 / 1e9)
    assert args["GFLOP/s"] == pytest.approx(2e9 / 0.050 / 1e9)
    assert slices[1]["ts"] == pytest.approx(51_000)
    counters = [e for e in events if e["ph"] == "C"]
    names = {e["name"] for e in counters}
    assert names == {"KV usage %", "KV blocks", "requests"}
    kv = [e["args"]["usage"] for e in counters if e["name"] == "KV usage %"]
    assert kv == pytest.approx([30.0, 30.0, 50.0])
    req = [e["args"] for e in counters if e["name"] == "requests"]
    assert req[0] == {"running": 1, "waiting": 1}
    assert any(e["ph"] == "M" for e in events)


def test_events_are_time_ordered_and_request_slices_nest(tmp_path):
    trace = chrome_trace(_records(), _outputs())
    timed = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    ts = [e["ts"] for e in timed]
    assert ts == sorted(ts)
    assert min(ts) == 0  # the request's arrival is the origin (before the first step)
    asyncs = [e for e in timed if e["ph"] in ("b", "e")]
    assert {e["id"] for e in asyncs} == {1}
    # begin/end pairs balance like parentheses, in order
    stack = []
    for e in asyncs:
        if e["ph"] == "b":
            stack.append(e["name"])
        else:
            assert stack.pop() == e["name"]
    assert not stack
    spans = {}
    for e in asyncs:
        spans.setdefault(e["name"], []).append(e["ts"])
    assert spans["queue"] == pytest.approx([0, 10_000])
    assert spans["prefill"] == pytest.approx([10_000, 60_000])
    assert spans["decode"] == pytest.approx([60_000, 72_000])
    assert spans["request r1"] == pytest.approx([0, 72_000])
    outer = next(e for e in asyncs if e["name"] == "request r1" and e["ph"] == "b")
    assert outer["args"]["ttft_ms"] == pytest.approx(60.0)


def test_unfinished_request_and_empty_inputs():
    m = RequestMetrics(arrival_time=T0)  # never scheduled
    out = RequestOutput("q", None, [1], [CompletionOutput(0, "", [], None, metrics=m)])
    trace = chrome_trace([], [out])
    asyncs = [e for e in trace["traceEvents"] if e["ph"] in ("b", "e")]
    assert [e["ph"] for e in asyncs] == ["b", "e"]
    assert chrome_trace([])["traceEvents"][0]["ph"] == "M"


def test_write_is_atomic_on_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("old")
    bad = _records()
    bad[0].context_lens = [object()]  # max() of one object works, but JSON cannot encode it
    with pytest.raises(TypeError):
        write_chrome_trace(path, bad)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["t.json"]  # no temp file left behind
