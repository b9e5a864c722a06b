"""`servescope bench`: argument parsing, the per-phase arithmetic, and tiny end-to-end runs that
write well-formed JSON (no speed asserts: benchmarks are never timed tests)."""

import json
import math

import pytest

from servescope.bench.latency import phase_breakdown
from servescope.bench.offline import Workload, parse_length, throughput_figures
from servescope.cli import build_parser, main
from servescope.telemetry.step_record import StepRecord


# ------------------------------------------------------------------------------------ parsing


def test_throughput_defaults_are_the_batching_issue_workload():
    a = build_parser().parse_args(["bench", "throughput"])
    assert (a.command, a.bench_command) == ("bench", "throughput")
    assert a.num_prompts == 64 and a.input_len == (32, 512) and a.output_len == (32, 256) and a.seed == 0
    assert a.baseline == [] and a.hf_batch_size == 16 and a.json is None and a.trace is None
    assert a.model is None and a.dtype == "auto" and a.baseline_dtype is None  # engine args are there


def test_throughput_lengths_and_baselines():
    a = build_parser().parse_args(["bench", "throughput", "--input-len", "100", "--output-len", "8..16",
                                   "--baseline", "hf", "--baseline", "llama-cpp", "--dtype", "bfloat16"])
    assert a.input_len == 100 and a.output_len == (8, 16)
    assert a.baseline == ["hf", "llama-cpp"] and a.dtype == "bfloat16"


@pytest.mark.parametrize("argv", [
    ["bench", "throughput", "--input-len", "0"],
    ["bench", "throughput", "--output-len", "20..10"],
    ["bench", "throughput", "--baseline", "vllm"],
    ["bench", "latency", "--batch-size", "0"],
    ["bench", "serve"],  # --base-url is required
    ["bench", "serve", "--base-url", "http://x", "--request-rate", "0"],
    ["bench", "serve", "--base-url", "http://x", "--burstiness", "-1"],
    ["bench", "serve", "--base-url", "http://x", "--percentiles", "101"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bench_without_subcommand_exits_2(capsys):
    assert main(["bench"]) == 2
    assert "subcommand" in capsys.readouterr().err


def test_serve_arguments():
    a = build_parser().parse_args([
        "bench", "serve", "--base-url", "http://127.0.0.1:8000", "--num-prompts", "5", "--input-len", "16..32",
        "--output-len", "4", "--request-rate", "2.5", "--burstiness", "0.5", "--max-concurrency", "3",
        "--goodput", "ttft:500", "tpot:50", "--sweep", "1,2,inf", "--json", "r.json", "--plot", "p.png",
        "--endpoint", "chat", "--api-key", "k"])
    assert a.num_prompts == 5 and a.input_len == (16, 32) and a.output_len == 4
    assert a.request_rate == 2.5 and a.burstiness == 0.5 and a.max_concurrency == 3
    assert a.goodput == ["ttft:500", "tpot:50"] and a.sweep == [1.0, 2.0, math.inf]
    assert a.endpoint == "chat" and a.api_key == "k"
    d = build_parser().parse_args(["bench", "serve", "--base-url", "http://h"])
    assert math.isinf(d.request_rate) and d.max_concurrency is None and d.percentiles == (90.0, 99.0)


def test_parse_length():
    assert parse_length("7") == 7
    assert parse_length("32..512") == (32, 512) == parse_length("32-512") == parse_length("32:512")
    assert parse_length("5..5") == 5
    for bad in ("0", "9..3", "x", "-3"):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_workload_is_seeded_and_in_range():
    wl = Workload(20, (4, 9), 3, seed=1)
    a, b = wl.requests(100), wl.requests(100)
    assert a == b and len(a) == 20
    assert all(4 <= r.prompt_len <= 9 and len(r.prompt) == r.prompt_len and r.output_len == 3 for r in a)
    assert all(0 <= t < 100 for r in a for t in r.prompt)
    assert Workload(20, (4, 9), 3, seed=2).requests(100) != a
    assert wl.describe() == {"num_prompts": 20, "input_len": [4, 9], "output_len": [3, 3], "seed": 1}
    with pytest.raises(ValueError):
        Workload(0)


def test_throughput_figures():
    f = throughput_figures(4, 100, 50, 2.0)
    assert f["requests_per_s"] == 2.0 and f["output_tokens_per_s"] == 25.0 and f["total_tokens_per_s"] == 75.0


def _rec(step, wall, pf, dec, flops, nbytes, pred):
    return StepRecord(step=step, start_time=float(step), wall_seconds=wall, num_prefill_seqs=int(pf > 0),
                      num_decode_seqs=dec, num_prefill_tokens=pf, num_decode_tokens=dec, context_lens=[],
                      kv_blocks_used=0, kv_blocks_free=1, kv_blocks_cached=0, kv_usage=0.0, num_running=1,
                      num_waiting=0, num_preemptions_total=0, predicted_seconds=pred, flops=flops,
                      bytes=nbytes, bound="compute" if pf else "memory")


def test_phase_breakdown_arithmetic():
    steps = [_rec(1, 2.0, 100, 0, 400.0, 10.0, 1.0),  # prefill
             _rec(2, 1.0, 0, 2, 4.0, 30.0, 0.5), _rec(3, 3.0, 0, 2, 4.0, 30.0, 0.5),  # decode
             _rec(4, 1.0, 10, 1, 50.0, 5.0, 0.25)]  # mixed
    out = phase_breakdown(steps, peak_flops=1000.0, bandwidth=100.0)
    p, d, m = out["prefill"], out["decode"], out["mixed"]
    assert p["tokens_per_s"] == 50.0 and p["achieved_flops_per_s"] == 200.0 and p["pct_of_peak_flops"] == 20.0
    assert p["bound"] == "compute" and p["predicted_over_measured"] == 0.5
    assert d["num_steps"] == 2 and d["median_step_seconds"] == 2.0 and d["tokens_per_s"] == 1.0
    assert d["achieved_bytes_per_s"] == 15.0 and d["pct_of_bandwidth"] == 15.0 and d["bound"] == "memory"
    assert d["predicted_over_measured"] == 0.25
    assert m["tokens"] == 11
    # without cost annotations only the timing part remains
    bare = [_rec(1, 2.0, 0, 1, None, None, None)]
    assert "achieved_bytes_per_s" not in phase_breakdown(bare, None, None)["decode"]


# ------------------------------------------------------------------------------- tiny runs


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model(tmp_path_factory.mktemp("bench"), "llama"))


ENGINE = ["--max-model-len", "256", "--kv-cache-memory", str(8 * 2**20)]


def test_bench_throughput_tiny_with_hf_baseline(tiny_model, tmp_path):
    out = tmp_path / "t.json"
    trace = tmp_path / "trace.json"
    rc = main(["bench", "throughput", "--model", tiny_model, "--num-prompts", "5", "--input-len", "4..24",
               "--output-len", "2..6", "--baseline", "hf", "--baseline", "llama-cpp", "--hf-batch-size", "2",
               "--json", str(out), "--trace", str(trace), "--no-progress", *ENGINE])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["benchmark"] == "throughput" and d["workload"]["num_prompts"] == 5
    assert d["machine"]["cpu"] and d["versions"]["torch"] and d["date_utc"]
    ours, hf = d["results"]["servescope"], d["results"]["hf"]
    wl = Workload(5, (4, 24), (2, 6), 0).requests(49152)
    assert ours["num_requests"] == 5 and ours["errors"] == 0
    assert ours["output_tokens"] == sum(r.output_len for r in wl)  # ignore_eos: exactly what was asked
    assert ours["prompt_tokens"] == sum(r.prompt_len for r in wl)
    assert 0 < ours["peak_kv_usage"] <= 1 and ours["preemptions"] >= 0
    assert ours["output_tokens_per_s"] > 0 and ours["wall_seconds"] > 0
    # hf counts only the requested tokens as output; the padded batches generate more
    assert hf["output_tokens"] == ours["output_tokens"] and hf["generated_tokens"] >= hf["output_tokens"]
    assert hf["batch_size"] == 2
    assert d["ratios"]["output_tokens_per_s_vs_hf"] == pytest.approx(
        ours["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert "skipped" in d["results"]["llama-cpp"]  # a tiny HF dir is no GGUF (or llama_cpp is missing)
    try:
        import servescope.telemetry.trace  # noqa: F401
    except ImportError:
        return
    assert json.loads(trace.read_text())


def test_bench_latency_tiny_with_hf_baseline(tiny_model, tmp_path):
    out = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", tiny_model, "--batch-size", "2", "--input-len", "20",
               "--output-len", "8", "--iters", "2", "--baseline", "hf", "--json", str(out), *ENGINE])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["shape"] == {"batch_size": 2, "input_len": 20, "output_len": 8, "iters": 2, "seed": 0}
    ours, hf = d["results"]["servescope"], d["results"]["hf"]
    assert len(ours["iterations"]) == 2
    assert ours["ttft_s"] > 0 and ours["tpot_s"] > 0 and ours["decode_tokens_per_s"] > 0
    assert all(it["output_tokens"] == 16 for it in ours["iterations"])
    dec = ours["phases"]["decode"]
    assert dec["num_steps"] == 2 * 7  # 7 decode steps per iteration after the prefill's first token
    assert dec["achieved_bytes_per_s"] > 0 and dec["pct_of_bandwidth"] > 0 and dec["predicted_over_measured"] > 0
    assert "prefill" in ours["phases"]
    assert ours["hardware"]["memory_bandwidth"] > 0 and ours["hardware"]["peak_flops"] > 0
    # the read bandwidth sampled before each iteration and after the last, and the share of it
    sb = ours["session_bandwidth"]
    assert len(sb["samples"]) == 3 and sb["min"] <= sb["median"] <= sb["max"] and sb["min"] > 1e8
    assert dec["pct_of_session_bandwidth"] == pytest.approx(100 * dec["achieved_bytes_per_s"] / sb["median"])
    # one more batch stepped by hand, a read sample before its first step and after every 8th (here the
    # 8th is its last: 1 prefill + 7 decode steps): one segment of decode steps between two samples
    pb = ours["paired_bandwidth"]
    assert pb["every_steps"] == 8 and len(pb["samples"]) == 2 and pb["decode_segments"] == 1
    assert pb["achieved_bytes_per_s"] > 0
    assert pb["pct"] == pytest.approx(100 * pb["achieved_bytes_per_s"] / (sum(pb["samples"]) / 2))
    assert hf["ttft_s"] > 0 and hf["decode_tokens_per_s"] > 0 and len(hf["iterations"]) == 2
    assert set(d["ratios"]) == {"decode_tokens_per_s_vs_hf", "ttft_vs_hf"}


def test_bench_serve_cli_against_fake_server(tmp_path):
    from .fake_openai_server import FakeServer

    out, plot = tmp_path / "s.json", tmp_path / "s.png"
    with FakeServer() as s:
        rc = main(["bench", "serve", "--base-url", s.base_url, "--model", "fake", "--num-prompts", "3",
                   "--input-len", "8", "--output-len", "3", "--sweep", "inf,50", "--goodput", "ttft:60000",
                   "--json", str(out), "--plot", str(plot), "--no-progress"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert isinstance(d, list) and len(d) == 2
    assert all(r["completed"] == 3 and r["failed"] == 0 and r["total_output_tokens"] == 9 for r in d)
    assert d[0]["request_goodput"] > 0 and "p99_ttft_ms" in d[0] and d[0]["machine"]["cpu"]
    assert plot.stat().st_size > 0
    # each point of the sweep sends its own prompts (seed + i): none can hit the previous point's
    # prompts in a prefix cache
    assert [r["config"]["seed"] for r in d] == [0, 1]
    first, second = ({json.dumps(p["prompt"]) for p in s.state.payloads[i * 3:(i + 1) * 3]} for i in (0, 1))
    assert len(first) == 3 and not first & second
