"""The SSE client against a fake server with known sleeps. Tolerances are generous: no speed asserts."""

import asyncio
import json

import pytest

from servescope.bench.datasets import BenchRequest, random_requests
from servescope.bench.report import plot_sweep, render_result_table, save_results_json
from servescope.bench.serve_client import (
    build_payload,
    endpoint_url,
    run_serve_benchmark,
    run_serve_benchmark_async,
    sweep,
)

from .fake_openai_server import ITL_S, TTFT_S, FakeServer, free_port


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


def reqs(n=4, output_len=5):
    return random_requests(n, input_len=8, output_len=output_len, vocab_size=100, seed=0)


def test_timings_and_usage(server):
    r = run_serve_benchmark(server.base_url, "fake", reqs(4, 5), progress=False, goodput="ttft:60000")
    assert r.completed == 4 and r.failed == 0, r.error_counts
    for rec in r.records:
        assert rec.output_len == 5
        assert len(rec.itl) == 4
        assert TTFT_S * 0.8 <= rec.ttft <= TTFT_S + 2.0
        assert all(ITL_S * 0.5 <= g <= ITL_S + 1.0 for g in rec.itl)
        assert rec.latency == pytest.approx(rec.ttft + sum(rec.itl), abs=1e-6)
        assert rec.generated_text == "ttttt"
    assert r.total_output_tokens == 20 and r.total_input_tokens == 32
    assert r.request_goodput == pytest.approx(r.request_throughput)
    assert 1 <= r.max_concurrency_seen <= 4
    # What went on the wire.
    body = server.state.payloads[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 8


def test_multi_token_chunks_counted_from_usage(server):
    r = run_serve_benchmark(server.base_url, "fake-multi", reqs(2, 6), progress=False)
    assert r.completed == 2
    for rec in r.records:
        assert rec.output_len == 6 and len(rec.itl) == 2  # 3 chunks of 2 tokens
    # TPOT divides by tokens: (e2e - ttft) / 5 ~ 2 gaps / 5.
    assert r.tpot.mean_ms < r.itl.mean_ms


def test_without_usage_counts_chunks(server):
    r = run_serve_benchmark(server.base_url, "fake-nousage", reqs(2, 3), progress=False)
    assert r.completed == 2 and all(rec.output_len == 3 for rec in r.records)


def test_chat_endpoint_skips_role_chunk(server):
    requests = [BenchRequest("hello there", 2, 3)]
    r = run_serve_benchmark(server.base_url + "/v1", "fake", requests, endpoint="/v1/chat/completions",
                            progress=False, api_key="secret", ignore_eos=False, extra_body={"top_p": 0.5})
    assert r.completed == 1, r.error_counts
    rec = r.records[0]
    assert rec.ttft >= TTFT_S * 0.8 and len(rec.itl) == 2 and rec.output_len == 3
    body = server.state.payloads[-1]
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert "ignore_eos" not in body and body["top_p"] == 0.5
    assert server.state.headers[-1]["authorization"] == "Bearer secret"
    with pytest.raises(ValueError):
        build_payload(BenchRequest([1, 2], 2, 3), "m", chat=True)


def test_errors_are_recorded_not_raised(server):
    for model, needle in [("fake-500", "HTTP 500"), ("fake-midstream", "engine died"),
                          ("fake-empty", "no content")]:
        r = run_serve_benchmark(server.base_url, model, reqs(2, 3), progress=False)
        assert r.completed == 0 and r.failed == 2, model
        assert all(needle in e for e in r.error_counts), r.error_counts


def test_timeout_is_a_failure(server):
    r = run_serve_benchmark(server.base_url, "fake-slow", reqs(1, 2), progress=False, request_timeout_s=0.3)
    assert r.failed == 1 and "timed out" in next(iter(r.error_counts))


def test_connection_refused_is_a_failure():
    r = run_serve_benchmark(f"http://127.0.0.1:{free_port()}", "fake", reqs(3, 2), progress=False)
    assert r.completed == 0 and r.failed == 3
    assert "ConnectError" in next(iter(r.error_counts))
    assert json.dumps(r.to_dict())


def test_max_concurrency_caps_in_flight(server):
    server.state.peak_in_flight = 0
    r = run_serve_benchmark(server.base_url, "fake", reqs(6, 3), max_concurrency=2, progress=False)
    assert r.completed == 6
    assert server.state.peak_in_flight <= 2 and r.max_concurrency_seen <= 2


def test_finite_rate_spreads_sends(server):
    r = run_serve_benchmark(server.base_url, "fake", reqs(5, 2), request_rate=20.0, seed=1, progress=False)
    starts = [rec.start_time for rec in r.records]
    assert starts == sorted(starts) and starts[-1] > 0.0
    assert r.config["request_rate"] == 20.0


def test_sync_wrapper_refuses_inside_loop(server):
    async def inner():
        with pytest.raises(RuntimeError):
            run_serve_benchmark(server.base_url, "fake", reqs(1, 1), progress=False)
        return await run_serve_benchmark_async(server.base_url, "fake", reqs(1, 1), progress=False)

    assert asyncio.run(inner()).completed == 1


def test_sweep_table_and_plot(server, tmp_path):
    results = sweep([40.0, float("inf")], server.base_url, "fake", reqs(3, 3), progress=False)
    assert [r.config["request_rate"] for r in results] == [40.0, "inf"]
    table = render_result_table(results[0])
    assert table.row_count > 10
    path = tmp_path / "sweep.png"
    plot_sweep(results, str(path))
    assert path.stat().st_size > 1000
    save_results_json(results, tmp_path / "sweep.json")
    loaded = json.loads((tmp_path / "sweep.json").read_text())
    assert [d["completed"] for d in loaded] == [3, 3] and "p99_tpot_ms" in loaded[0]


def test_bad_goodput_fails_before_sending(server):
    n = len(server.state.payloads)
    with pytest.raises(ValueError):
        run_serve_benchmark(server.base_url, "fake", reqs(1, 1), progress=False, goodput="ttfx:5")
    assert len(server.state.payloads) == n


def test_endpoint_url():
    assert endpoint_url("http://h:1/", "/v1/completions") == "http://h:1/v1/completions"
    assert endpoint_url("http://h:1/v1", "/v1/completions") == "http://h:1/v1/completions"
    assert endpoint_url("http://h:1", "v1/chat/completions") == "http://h:1/v1/chat/completions"
