"""A written trace read back for `servescope replay`: the steps, counters and request latencies come
back as they were recorded; anything else is refused with a clear error."""

import pytest

from servescope.errors import InvalidParameterError
from servescope.telemetry.trace import write_chrome_trace
from servescope.telemetry.trace_replay import read_recorded_run

from .test_trace import _outputs, _records


def test_round_trip_of_steps_counters_and_requests(tmp_path):
    recs = _records()
    run = read_recorded_run(write_chrome_trace(tmp_path / "t.json", recs, _outputs()))
    assert [s["step"] for s in run.steps] == [1, 2, 3]
    assert [s["phase"] for s in run.steps] == ["prefill", "decode", "mixed"]
    for s, r in zip(run.steps, recs):
        assert s["ms"] == pytest.approx(r.wall_seconds * 1e3)
        assert s["pred_ms"] == pytest.approx(r.predicted_seconds * 1e3)
        assert s["flops"] == pytest.approx(r.flops, rel=1e-3) and s["bytes"] == pytest.approx(r.bytes, rel=1e-3)
        assert (s["prefill_tokens"], s["decode_tokens"]) == (r.num_prefill_tokens, r.num_decode_tokens)
        assert (s["kv_used"], s["kv_cached"], s["waiting"]) == (r.kv_blocks_used, r.kv_blocks_cached, r.num_waiting)
        assert s["kv_usage"] == pytest.approx(r.kv_usage)
    assert run.steps[0]["t"] == pytest.approx(10.0)  # the request's arrival is the trace's origin
    assert run.num_blocks == 10 and run.hardware == "local-cpu"
    (finish, ttft, tpot), = run.requests
    assert finish == pytest.approx(72.0) and ttft == pytest.approx(0.060) and tpot == pytest.approx(0.006)


def test_bad_traces_are_refused_clearly(tmp_path):
    with pytest.raises(InvalidParameterError, match="cannot read"):
        read_recorded_run(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(InvalidParameterError, match="not JSON"):
        read_recorded_run(tmp_path / "x.json")
    with pytest.raises(InvalidParameterError, match="no traceEvents"):
        read_recorded_run({"foo": 1})
    with pytest.raises(InvalidParameterError, match="no engine steps"):
        read_recorded_run({"traceEvents": [{"ph": "M", "name": "process_name"}]})
