"""`servescope simulate`: bench serve's flags and output, --json keys, traces that replay, trace files,
bad input as one clear error."""

import json

import pytest

from servescope.cli import main
from servescope.errors import InvalidParameterError
from servescope.sim.step_table import StepTable, fit_step_table
from servescope.sim.workload import read_trace
from servescope.telemetry.step_record import StepRecord
from servescope.telemetry.trace_replay import read_recorded_run

SMALL = ["simulate", "--hardware", "H100", "--num-kv-blocks", "256", "--max-model-len", "2048", "--num-prompts", "6",
         "--input-len", "64..128", "--output-len", "4..8", "--request-rate", "20"]


def test_prints_bench_serves_table_and_writes_the_same_json_keys(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(SMALL + ["--goodput", "ttft:50", "--json", str(out), "--include-records"]) == 0
    text = capsys.readouterr().out
    for line in ("Serving Benchmark Result", "Successful requests:", "Median TTFT (ms):", "P99 ITL (ms):",
                 "Request goodput (req/s):", "Output token throughput (tok/s):"):
        assert line in text
    d = json.loads(out.read_text())
    assert d["completed"] == 6 and len(d["records"]) == 6 and d["config"]["simulated"] is True
    for key in ("median_ttft_ms", "p90_tpot_ms", "mean_itl_ms", "p99_e2el_ms", "request_goodput", "duration_s"):
        assert key in d
    assert d["simulation"]["instances"][0]["steps"] > 0


def test_the_trace_replays_with_predictions(tmp_path):
    trace = tmp_path / "t.json"
    assert main(SMALL + ["--trace", str(trace)]) == 0
    run = read_recorded_run(trace)
    assert run.steps and all(s["pred_ms"] is not None for s in run.steps)
    assert run.hardware == "H100-SXM" and len(run.requests) == 6


def test_a_trace_file_with_sessions_shares_real_prefixes(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [{"arrival_time": 0.0, "prompt_len": 300, "output_len": 4, "session_id": "a"},
             {"arrival_time": 0.5, "prompt_len": 400, "output_len": 4, "session_id": "a"},
             {"arrival_time": 0.1, "input_len": 50, "output_len": 2}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = read_trace(path, vocab_size=1000)
    assert [r.arrival for r in reqs] == [0.0, 0.1, 0.5]
    assert reqs[2].prompt[:300] == reqs[0].prompt and reqs[1].prompt_len == 50
    out = tmp_path / "r.json"
    assert main(["simulate", "--hardware", "H100", "--trace-file", str(path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["simulation"]["instances"][0]["prefix_hit_rate"] > 0


@pytest.mark.parametrize("line,message", [
    ('{"arrival_time": -1, "prompt_len": 3, "output_len": 1}', "arrival_time"),
    ('{"arrival_time": 0, "prompt_len": 0, "output_len": 1}', "prompt_len"),
    ('{"arrival_time": 0, "prompt_len": 3}', "missing output_len"),
    ("[1, 2]", "JSON object"),
    ("not json", "not JSON"),
])
def test_a_bad_trace_line_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_time": 0, "prompt_len": 3, "output_len": 1}\n' + line + "\n")
    with pytest.raises(InvalidParameterError, match=message) as e:
        read_trace(path, 100)
    assert ":2" in str(e.value)


@pytest.mark.parametrize("extra,message", [
    (["--prefill-instances", "1"], "disaggregation needs both"),
    (["--search"], "--search needs --goodput"),
    (["--num-speculative-tokens", "2", "--spec-acceptance", "1.5"], "spec-acceptance"),
    (["--model", "no-such-preset"], "unknown preset"),
    (["--hardware", "nope"], "unknown hardware"),
    (["-ep", "2"], "no experts to split"),
    (["--quantization", "fp8", "--hardware", "a100"], "no FP8 tensor cores"),
    (["--quantization", "int3"], "weight dtype must be one of"),
    (["--context-quantum", "-1"], "context_quantum must be >= 0"),
])
def test_bad_arguments_are_one_clear_error(extra, message, capsys):
    assert main(SMALL + extra) == 2
    assert message in capsys.readouterr().err


def _rec(start, tokens, context, pred, wall, prefill=0):
    return StepRecord(step=0, start_time=start, wall_seconds=wall, num_prefill_seqs=int(bool(prefill)),
                      num_decode_seqs=0, num_prefill_tokens=prefill, num_decode_tokens=tokens - prefill,
                      context_lens=[context + tokens], kv_blocks_used=0, kv_blocks_free=0, kv_blocks_cached=0,
                      kv_usage=0, num_running=0, num_waiting=0, num_preemptions_total=0, predicted_seconds=pred)


def test_step_tables_fit_load_and_scale():
    recs = [_rec(0.0, 1, 100, 1.0, 1.2), _rec(1.4, 1, 100, 1.0, 1.4),  # the first one's period: 1.4 s
            _rec(10.0, 8, 100, 2.0, 2.0), _rec(20.0, 1, 2000, 1.0, 3.0), _rec(30.0, 512, 0, 4.0, 6.0, 512)]
    table = fit_step_table(recs, prior_steps=0)  # each bin's own median (test_step_table.py: the shrinkage)
    assert table.decode[0][0] == 100 and table.decode[0][1] == ((1, pytest.approx(1.4)), (8, 1.0))
    assert table.decode[1] == (2000, ((1, 3.0),)) and table.prefill == ((1, ((512, 1.5),)),)
    assert table.ratio(True, 1, 100) == pytest.approx(1.4) and table.ratio(True, 100, 50) == 1.0
    assert table.ratio(True, 2, 100) == pytest.approx(1.4 ** (2 / 3))  # log-log between token bins
    assert table.ratio(True, 1, 2000) == 3.0 and table.ratio(True, 1, 10**4) == 3.0
    assert 1.4 < table.ratio(True, 1, 500) < 3.0  # between context bins
    assert StepTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    with pytest.raises(InvalidParameterError):
        StepTable.from_dict({"decode": [[1, [[1, -1]]]], "prefill": [[1, [[1, 1]]]]})


def test_the_context_quantum_only_rounds_step_times(tmp_path):
    runs = {}
    for q in ("0", "16"):
        out = tmp_path / f"q{q}.json"
        assert main(SMALL + ["--context-quantum", q, "--json", str(out)]) == 0
        runs[q] = json.loads(out.read_text())
    assert runs["0"]["completed"] == runs["16"]["completed"] == 6
    assert runs["0"]["total_output_tokens"] == runs["16"]["total_output_tokens"]
    for key in ("median_ttft_ms", "median_tpot_ms", "duration_s"):
        assert runs["16"][key] == pytest.approx(runs["0"][key], rel=1e-2)
