"""/metrics (Prometheus text, vLLM's names under servescope:), /v1/internals, /health, and the CLI parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from .conftest import MODEL

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens")
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds")


def _metrics(http) -> dict:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _value(families, name, suffix=""):
    fam = families[f"servescope:{name}"]
    return sum(s.value for s in fam.samples if s.name == f"servescope:{name}{suffix}")


def test_metrics_names_labels_and_counts(http):
    before = _metrics(http)
    for name in GAUGES:
        assert before[f"servescope:{name}"].type == "gauge"
    for name in COUNTERS:
        assert before[f"servescope:{name}"].type == "counter"
    for name in HISTOGRAMS:
        assert before[f"servescope:{name}"].type == "histogram"
    for fam in before.values():
        if fam.name == "servescope:cpu_kernels_info":  # an info gauge: its labels are its value (below)
            continue
        for s in fam.samples:
            assert set(s.labels) - {"le"} == {"model_name"} and s.labels["model_name"] == MODEL
    r = http.post("/v1/completions", json={"prompt": "Metrics test prompt", "max_tokens": 3, "temperature": 0,
                                           "ignore_eos": True})
    usage = r.json()["usage"]
    after = _metrics(http)
    assert _value(after, "generation_tokens", "_total") - _value(before, "generation_tokens", "_total") == 3
    assert (_value(after, "prompt_tokens", "_total") - _value(before, "prompt_tokens", "_total")
            == usage["prompt_tokens"])
    for name in HISTOGRAMS:
        grown = _value(after, name, "_count") - _value(before, name, "_count")
        assert grown == 1, name
    assert _value(after, "prefix_cache_queries", "_total") > _value(before, "prefix_cache_queries", "_total")
    assert _value(after, "num_requests_running") == 0


def test_cpu_kernels_info_gauge(http):
    """Which CPU kernel path serves: the ISA the engine's extension was built for, and its description."""
    from servescope.kernels.cpu import ops as cpu_ops  # the server under test runs in this process

    fam = _metrics(http)["servescope:cpu_kernels_info"]  # Prometheus text has no info type: a gauge of 1
    assert fam.type == "gauge"
    (sample,) = fam.samples
    assert sample.value == 1 and sample.labels["model_name"] == MODEL
    assert sample.labels["isa"] == cpu_ops.isa() and sample.labels["path"] == cpu_ops.kernel_path()
    assert sample.labels["isa"] in ("avx512", "avx2", "neon", "scalar", "eager")


def test_internals(http):
    http.post("/v1/completions", json={"prompt": "Internals", "max_tokens": 2})
    d = http.get("/v1/internals?n=3").json()
    assert 1 <= len(d["steps"]) <= 3
    steps = [s["step"] for s in d["steps"]]
    assert steps == sorted(steps)
    for key in ("phase", "wall_seconds", "kv_blocks_used", "num_prefill_tokens", "num_decode_tokens"):
        assert key in d["steps"][-1]
    for key in ("num_blocks", "blocks_used", "usage", "bytes_per_token", "prefix_cache_hits"):
        assert key in d["kv_cache"]
    assert http.get("/v1/internals?n=0").json()["steps"] == []


def test_health_and_openapi(server, http):
    assert http.get("/health").json() == {"status": "ok"}
    spec = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])


def test_cli_serve_parser():
    from servescope.cli import build_parser

    a = build_parser().parse_args(["serve", "--port", "9001", "--max-queue", "3", "--max-n", "2",
                                   "--max-body-bytes", "1000", "--api-key", "k", "--served-model-name", "m",
                                   "--max-num-seqs", "4"])
    assert (a.command, a.host, a.port, a.max_queue, a.max_n, a.max_body_bytes, a.api_key,
            a.served_model_name, a.max_num_seqs) == ("serve", "127.0.0.1", 9001, 3, 2, 1000, "k", "m", 4)
