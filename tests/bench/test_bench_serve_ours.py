"""`servescope bench serve` against our own server on loopback (tiny model, a few requests):
the load generator and the server agree on token counts, and the JSON is well formed."""

import json
import threading
import time

import pytest

from .fake_openai_server import free_port


def _server_parts():
    try:
        from servescope.engine.async_engine import AsyncEngine
        from servescope.server.app import build_app
    except ImportError as e:
        pytest.skip(f"servescope.server has no app factory yet (build_app / AsyncEngine): {e}")
    return AsyncEngine, build_app


@pytest.fixture(scope="module")
def our_server(tmp_path_factory):
    AsyncEngine, build_app = _server_parts()
    import uvicorn
    from tiny_models import make_tiny_hf_model

    from servescope.config import EngineConfig
    from servescope.engine.llm_engine import LLMEngine

    path = make_tiny_hf_model(tmp_path_factory.mktemp("serve"), "llama")
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=256, kv_cache_memory_bytes=8 * 2**20))
    aengine = AsyncEngine(engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(aengine, model_name="tiny"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("our server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(timeout=30)
    aengine.shutdown()


def test_bench_serve_against_our_server(our_server, tmp_path):
    from servescope.cli import main

    base_url, engine = our_server
    out = tmp_path / "serve.json"
    # no --model: the name comes from GET /v1/models
    rc = main(["bench", "serve", "--base-url", base_url, "--num-prompts", "4", "--input-len", "8..24",
               "--output-len", "3..6", "--request-rate", "20", "--max-concurrency", "2",
               "--goodput", "ttft:600000", "--vocab-size", "49152", "--json", str(out), "--include-records",
               "--no-progress"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["completed"] == 4 and d["failed"] == 0, d["error_counts"]
    assert d["config"]["model"] == "tiny" and d["config"]["max_concurrency"] == 2
    assert d["max_concurrency_seen"] <= 2
    from servescope.bench.datasets import random_requests

    reqs = random_requests(4, (8, 24), (3, 6), vocab_size=49152, seed=0)
    # ignore_eos: the server generated exactly what was asked, and counted it in usage
    assert d["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert d["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert sorted(r["output_len"] for r in d["records"]) == sorted(r.output_len for r in reqs)
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "request_throughput",
                "output_throughput", "request_goodput"):
        assert d[key] is not None and d[key] >= 0, key
    assert d["request_goodput"] > 0
    assert not engine.has_unfinished()


def test_bench_serve_chat_against_our_server(our_server, tmp_path):
    from servescope.cli import main

    base_url, _ = our_server
    out = tmp_path / "chat.json"
    rc = main(["bench", "serve", "--base-url", base_url, "--model", "tiny", "--endpoint", "chat",
               "--num-prompts", "2", "--input-len", "12", "--output-len", "4", "--json", str(out),
               "--no-progress"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["completed"] == 2 and d["failed"] == 0 and d["total_output_tokens"] == 8
