"""One engine (the embedded SmolLM2-135M on the CPU, with LLMEngine()'s settings, on the weights the
session's smollm2_llm loaded) per test session, behind real uvicorn servers on 127.0.0.1: `server`
(API key, the default limits) and `small_queue_server` (max_queue 4), both sharing one AsyncEngine."""

from __future__ import annotations

import httpx
import pytest

from servescope.engine.async_engine import AsyncEngine
from servescope.engine.llm_engine import LLMEngine
from servescope.server.app import build_app
from .server_utils import LiveServer, openai_client

MODEL = "smollm2-135m"
API_KEY = "sk-servescope-test"
MAX_BODY = 256 * 1024
SMALL_QUEUE = 4


@pytest.fixture(scope="session")
def async_engine(smollm2_engine):
    ae = AsyncEngine(smollm2_engine())  # LLMEngine()'s settings on the session's weights
    yield ae
    ae.shutdown()


@pytest.fixture(scope="session")
def app(async_engine):
    return build_app(async_engine, model_name=MODEL, max_body_bytes=MAX_BODY, api_key=API_KEY, max_n=8,
                     max_queue=256)


@pytest.fixture(scope="session")
def server(app):
    s = LiveServer(app).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def small_queue_server(async_engine):
    s = LiveServer(build_app(async_engine, model_name=MODEL, max_queue=SMALL_QUEUE)).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    """The real openai SDK, validating every response against its models."""
    return openai_client(server, API_KEY)


@pytest.fixture(scope="session")
def lenient_client(server):
    """For streamed completions only (server_utils.openai_client says why)."""
    return openai_client(server, API_KEY, strict=False)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


# ---- a tiny random model (with the SmolLM2 tokenizer) behind a real server: the dashboard's tests
TINY_KEY = "sk-dashboard-test"


@pytest.fixture(scope="session")
def tiny_async_engine(tmp_path_factory):
    from tiny_models import make_tiny_hf_model  # tests/model is on sys.path (tests/conftest.py)

    path = make_tiny_hf_model(tmp_path_factory.mktemp("dash"), "llama_plain")
    ae = AsyncEngine(LLMEngine(model=str(path), num_kv_blocks=96, block_size=8, max_model_len=256,
                               max_num_seqs=8, max_num_batched_tokens=128))
    yield ae
    ae.shutdown()


@pytest.fixture(scope="session")
def tiny_server(tiny_async_engine):
    s = LiveServer(build_app(tiny_async_engine, model_name="tiny", api_key=TINY_KEY)).start()
    yield s
    s.stop()
