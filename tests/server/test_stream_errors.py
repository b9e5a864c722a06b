"""An engine failure after streaming began reaches the client as `data: {"error": {...}}` then
[DONE]; a non-streaming request gets a 500 envelope (a bug, never a client mistake). A stub engine
stands in for the model so the failure can be forced."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from servescope.engine.async_engine import AsyncEngine
from servescope.engine.outputs import CompletionOutput, RequestOutput
from servescope.server.app import build_app

from .server_utils import LiveServer


class _FailingEngine:
    """Emits one token for each request, then its next step raises."""

    tokenizer = None
    max_model_len = 64
    model_config = SimpleNamespace(vocab_size=100)

    def __init__(self):
        self.requests = {}

    def add_request(self, rid, prompt, params, priority=0, arrival_time=None):
        self.requests[rid] = list(prompt)

    def abort(self, rid):
        return self.requests.pop(rid, None) is not None

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        fresh = [rid for rid, p in self.requests.items() if p]
        if not fresh:
            raise RuntimeError("boom")
        outs = []
        for rid in fresh:
            prompt, self.requests[rid] = self.requests[rid], []
            outs.append(RequestOutput(rid, None, prompt, [CompletionOutput(0, "x", [7])]))
        return outs


@pytest.fixture(scope="module")
def failing_server():
    ae = AsyncEngine(_FailingEngine())
    s = LiveServer(build_app(ae, model_name="stub")).start()
    yield s
    s.stop()
    ae.shutdown()


def test_error_after_streaming_began(failing_server):
    with httpx.Client(base_url=failing_server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first, err = json.loads(events[0]), json.loads(events[-2])
    assert first["choices"][0]["text"] == "x"
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "server_error" and "EngineStepError" in err["error"]["message"]


def test_engine_failure_without_streaming_is_a_500_envelope(failing_server):
    with httpx.Client(base_url=failing_server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5})
        assert r.status_code == 500
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in r.text
        assert c.get("/health").status_code == 200  # the engine thread lives on
