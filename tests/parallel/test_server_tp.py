"""The server on a TP=2 engine (two gloo processes; parked workers of an earlier test reused when
there are) passes the same OpenAI-client tests as at TP=1
(tests/server/test_openai_api.py, imported here and run against this module's fixtures), on a tiny
random model with the SmolLM2 tokenizer; then a killed worker turns into 503s with a clear message,
and shutdown leaves no process behind."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from server.conftest import API_KEY, MODEL
from server.server_utils import LiveServer, openai_client
from server.test_openai_api import *  # noqa: F401,F403 - the same tests, collected again here
from servescope.engine.async_engine import AsyncEngine
from servescope.engine.llm_engine import LLMEngine
from servescope.server.app import build_app
from tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def async_engine(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tp"), "qwen2")
    engine = LLMEngine(model=str(path), tensor_parallel_size=2, num_threads=1, max_model_len=512,
                       num_kv_blocks=256, distributed_timeout_s=30)
    ae = AsyncEngine(engine)
    yield ae
    ae.shutdown()
    engine.shutdown()


@pytest.fixture(scope="module")
def server(async_engine):
    s = LiveServer(build_app(async_engine, model_name=MODEL, api_key=API_KEY, max_n=8, max_queue=256)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, API_KEY, timeout=120)


@pytest.fixture(scope="module")
def lenient_client(server):
    return openai_client(server, API_KEY, strict=False, timeout=120)


def test_tp_engine_holds_half_the_weights_and_kv(async_engine):
    """Rank 0 of TP=2: 1/2 of the sharded weights (+ the replicated norms), 1/2 of the KV bytes per
    token; the same memory budget would hold twice the tokens."""
    from servescope import LLM

    engine = async_engine.engine
    single = LLM(model=str(engine.source_path), max_model_len=512, num_kv_blocks=256).engine
    cfg = engine.model_config
    norms = 4 * (cfg.hidden_size * (2 * cfg.num_hidden_layers + 1))  # float32 RMSNorm weights, replicated
    assert engine.weight_bytes == (single.weight_bytes - norms) // 2 + norms
    assert engine.kv_bytes_per_token * 2 == single.kv_bytes_per_token
    assert engine.kv_cache_state()["total_bytes"] * 2 == single.kv_cache_state()["total_bytes"]


def test_zz_killed_worker_gives_503_then_no_orphans(async_engine, server):
    """Runs last in this module (it kills the shared engine's worker)."""
    ex = async_engine.engine.executor
    (proc,) = ex.workers.procs
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 503, r.text
    msg = r.json()["error"]["message"]
    assert "worker rank 1 exited with code -9" in msg and "restarted" in msg
    assert httpx.get(server.url + "/health", headers=headers, timeout=10).status_code == 503
    async_engine.engine.shutdown()
    assert all(p.exitcode is not None for p in ex.workers.procs)
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)  # reaped, not a zombie
