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


def test_trace_of_a_real_engine_run(tmp_path):
    """Records and metrics from the engine itself (tiny random model) make a well-formed trace."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "model"))
    from tiny_models import make_tiny_hf_model

    from servescope.config import SamplingParams
    from servescope.engine.llm import LLM

    llm = LLM(model=str(make_tiny_hf_model(tmp_path, "llama")), num_kv_blocks=64, max_model_len=256,
              num_threads=1, hardware="A100-80GB", max_num_batched_tokens=64)
    outs = llm.generate([[5] * 40, [7] * 100, [9] * 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    steps = list(llm.engine.step_records)
    trace = json.loads(write_chrome_trace(tmp_path / "run.json", steps, outs).read_text())
    ev = trace["traceEvents"]
    slices = [e for e in ev if e["ph"] == "X"]
    assert len(slices) == len(steps)
    assert {e["name"] for e in slices} <= {"prefill", "decode", "mixed"}
    assert sum(e["args"]["tokens"] for e in slices) == sum(s.num_tokens for s in steps)
    assert all(e["args"]["predicted_ms"] > 0 for e in slices)
    ts = [e["ts"] for e in ev if e["ph"] != "M"]
    assert ts == sorted(ts) and min(ts) >= 0
    # chunked prefill (64-token budget): the 100-token prompt's prefill spans several steps
    begins = [e for e in ev if e["ph"] == "b" and e["name"] == "prefill"]
    assert len(begins) == 3
    for e in ev:
        if e["ph"] == "X":
            assert e["dur"] >= 0


def moe_records():
    """_records() with mixture-of-experts routing on steps 2 and 3, step 3 under expert parallelism (2 ranks)."""
    from servescope.telemetry.moe import record_expert_parallel, record_routing

    recs = _records()
    record_routing(recs[1], [[1, 0, 1, 0], [0, 2, 0, 0]], expert_bytes=1000)
    record_routing(recs[2], [[3, 1, 0, 2], [1, 1, 2, 2]], expert_bytes=1000)
    recs[1].moe_expected_experts = recs[2].moe_expected_experts = 1.5
    record_expert_parallel(recs[2], [9, 3], a2a_seconds=0.001, a2a_bytes=4096)
    return recs


def test_a_mixture_of_experts_routing_survives_the_trace():
    """The expert panel's fields ride in the step's args and come back from a replay as the live view sent them;
    a hand-edited trace's junk in them is dropped, not drawn."""
    from servescope.telemetry.live import step_event
    from servescope.telemetry.trace_replay import read_recorded_run

    recs = moe_records()
    trace = chrome_trace(recs)
    steps = read_recorded_run(trace).steps
    live = [step_event(r, recs[0].start_time) for r in recs]
    moe_keys = [sorted(k for k in s if k.startswith(("moe_", "a2a"))) for s in live]
    assert moe_keys[0] == [] and "moe_rank_rows" not in moe_keys[1] and "moe_rank_rows" in moe_keys[2]
    for got, want, keys in zip(steps, live, moe_keys):
        assert {k: got.get(k) for k in keys} == {k: want[k] for k in keys} and not [
            k for k in got if k.startswith(("moe_", "a2a")) and k not in keys]
    assert steps[2]["moe_rank_rows"] == [9, 3] and steps[2]["moe_rank_imbalance"] == 1.5
    assert steps[2]["a2a_ms"] == 1.0 and steps[2]["moe_tokens"] == [4, 2, 2, 4]
    step = next(e for e in trace["traceEvents"] if e.get("cat") == "step" and e["args"]["step"] == 3)
    step["args"]["moe"].update({"moe_rank_rows": ["<b>"], "moe_imbalance": "x", "other": 1})
    got = read_recorded_run(trace).steps[2]
    assert "moe_rank_rows" not in got and "a2a_ms" not in got and got["moe_imbalance"] is None and "other" not in got
    step["args"]["moe"] = {"moe_tokens": "nope"}
    assert not [k for k in read_recorded_run(trace).steps[2] if k.startswith("moe_")]
