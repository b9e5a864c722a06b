"""The hostile-input suite (issue 39): what a hostile or careless client cannot do to the server.

A real uvicorn server on loopback over the tiny random model with SmolLM2's tokenizer (real
tokenisation, the real ChatML template), with tight limits. The floors asserted here:
- 0 responses with status 5xx and 0 hangs over >= 300 hostile cases covering every item of the
  issue (hostile_cases.py), sent 8 at a time, with normal requests answered correctly in between;
  afterwards no request is left in the engine and no KV block is held;
- every route but /health requires the key (routes read from the app, so new ones are covered);
- slow clients (headers, bodies) are cut off at their deadlines, connections beyond the limit are
  refused, and the server keeps answering;
- bodies fuzzed by hypothesis never get a 5xx.
Timing floors (a normal request's latency beside hostile ones) are measured by
benchmarks/hostile_latency.py, not asserted here.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servescope.server.app import build_app
from servescope.server.background import BackgroundServer
from servescope.server.limits import ServerLimits, limits_table
from servescope.server.request_checks import max_prompt_chars

from .hostile_cases import INJECTIONS, catalogue, chat, completion

KEY = "sk-hostile"
LIMITS = ServerLimits(
    max_queue=24,
    max_body_bytes=512 * 1024,
    header_timeout_s=1.0,
    body_timeout_s=1.0,
    max_connections=24,
    max_choices=64,
    max_grammar_bytes=16 * 1024,
    max_schema_depth=16,
    max_schema_properties=64,
    max_stop_token_ids=16,
    max_tools=8,
    max_prompts=16,
    max_embedding_inputs=8,
    grammar_compile_timeout_s=60.0,
    chat_template_timeout_s=5.0,
)
HANG_S = 60.0  # a request not answered within this is a hang


@pytest.fixture(scope="module")
def hostile(tiny_async_engine):
    app = build_app(tiny_async_engine, model_name="tiny", api_key=KEY, limits=LIMITS)
    server = BackgroundServer(app).start()
    yield server, app
    server.stop()


def _client(server, key=KEY, **kw):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, timeout=HANG_S, headers=headers, **kw)


def _routes(app) -> list:
    out = []
    for r in app.routes:
        path = r.path.replace("{name}", "dashboard.js")
        for m in sorted(getattr(r, "methods", None) or {"GET"}):
            if m in ("GET", "POST"):
                out.append((m, path))
    return out


def _send(client: httpx.Client, case) -> tuple:
    headers = dict(case.headers)
    if not case.auth:
        client = httpx.Client(base_url=client.base_url, timeout=HANG_S)
    t0 = time.perf_counter()
    try:
        r = client.request(case.method, case.path, content=case.body, headers=headers)
        return r.status_code, time.perf_counter() - t0, r.text[:200]
    except httpx.TimeoutException:
        return "hang", time.perf_counter() - t0, ""
    except httpx.HTTPError as e:  # a connection the server closed: not a 5xx, but must not happen here
        return f"transport {type(e).__name__}", time.perf_counter() - t0, str(e)
    finally:
        if not case.auth:
            client.close()


def _normal_chat_works(client) -> None:
    r = client.post("/v1/chat/completions", json=chat("Say hi", max_tokens=3))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _drained(client) -> dict:
    deadline = time.monotonic() + 60
    while True:
        d = client.get("/v1/internals?n=0").json()
        if (d["num_unfinished"] == 0 and d["num_in_flight"] == 0) or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def test_no_5xx_and_no_hang_over_the_catalogue(hostile):
    server, app = hostile
    with _client(server) as client:
        cases = catalogue(_routes(app), LIMITS, max_prompt_chars(app.state.ctx), 256)
        assert len(cases) >= 300
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda c: _send(client, c), cases))
            _normal_chat_works(client)  # while the last of them may still run
        bad = [
            (c.name, s, text) for c, (s, _, text) in zip(cases, results) if not isinstance(s, int) or s >= 500
        ]
        assert bad == [], bad[:10]
        wrong = [(c.name, s, text) for c, (s, _, text) in zip(cases, results) if s not in c.expect]
        assert wrong == [], "\n".join(f"{n} -> {s}: {t[:90]}" for n, s, t in wrong)
        _normal_chat_works(client)
        state = _drained(client)
        assert state["num_unfinished"] == 0 and state["num_in_flight"] == 0
        assert state["kv_cache"]["blocks_used"] == 0  # nothing leaked a KV block
        assert client.get("/health").status_code == 200


def test_every_route_but_health_needs_the_key(hostile):
    server, app = hostile
    routes = _routes(app)
    assert {"/metrics", "/docs", "/openapi.json", "/dashboard", "/v1/internals/stream"} <= {
        p for _, p in routes
    }
    with _client(server, key=None) as anon:
        assert anon.get("/health").status_code == 200
        for method, path in routes:
            if path == "/health":
                continue
            r = anon.request(method, path)
            assert r.status_code == 401, (method, path, r.status_code)
            page = path.startswith(("/dashboard", "/docs", "/redoc", "/openapi.json"))
            assert r.headers["www-authenticate"].startswith("Basic" if page else "Bearer"), path
    basic = base64.b64encode(f"anyone:{KEY}".encode()).decode()
    with httpx.Client(base_url=server.url, timeout=HANG_S, headers={"authorization": f"Basic {basic}"}) as c:
        assert c.get("/dashboard").status_code == 200  # a browser's prompt answered with the key
        assert c.get("/metrics").status_code == 200
        assert c.get("/docs").status_code == 200


def test_metrics_public_is_an_explicit_opt_out(tiny_async_engine):
    app = build_app(
        tiny_async_engine, model_name="tiny", api_key=KEY, limits=ServerLimits(metrics_public=True)
    )
    with _Running(app) as server:
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert httpx.get(server.url + "/v1/models").status_code == 401


class _Running:
    def __init__(self, app, **kw):
        self.server = BackgroundServer(app, **kw)

    def __enter__(self):
        return self.server.start()

    def __exit__(self, *exc):
        self.server.stop()


def test_host_allow_list(tiny_async_engine):
    app = build_app(tiny_async_engine, model_name="tiny")  # no key: the Host check is what protects it
    with _Running(app) as server:
        port = server.port
        for host, ok in (
            (f"127.0.0.1:{port}", True),
            (f"localhost:{port}", True),
            ("[::1]", True),
            ("evil.example", False),
            (f"attacker.example:{port}", False),
        ):
            r = httpx.get(server.url + "/v1/models", headers={"host": host})
            assert (r.status_code == 200) == ok, (host, r.status_code)
            if not ok:
                assert r.json()["error"]["code"] == "invalid_host"
    assert ServerLimits().for_bind("0.0.0.0").allowed_hosts == ("*",)
    assert ServerLimits().for_bind("127.0.0.1").host_allowed("localhost:8000")
    assert not ServerLimits().for_bind("::1").host_allowed("evil.example")
    assert ServerLimits(allowed_hosts=("api.example",)).host_allowed("API.example:443")


def test_dashboard_previews_only_behind_the_key(tiny_async_engine):
    open_app = build_app(tiny_async_engine, model_name="tiny")
    keyed_app = build_app(tiny_async_engine, model_name="tiny", api_key=KEY)
    opted_in = build_app(tiny_async_engine, model_name="tiny", limits=ServerLimits(dashboard_previews=True))
    sources = [a.state.broadcaster.source for a in (open_app, keyed_app, opted_in)]
    assert [s.previews for s in sources] == [False, True, True]


def _open(server, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S)
    s.sendall(data)
    return s


def _reply(s: socket.socket) -> bytes:
    """The response the server sends on `s`: its first bytes within HANG_S (else a hang), then up to its
    Content-Length, the close, or 5 s of silence."""
    buf = b""
    try:
        while not _whole_response(buf):
            try:
                b = s.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not b:
                break
            buf += b
            s.settimeout(5)
        return buf
    finally:
        s.close()


def _whole_response(buf: bytes) -> bool:
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False  # no length: the close ends it


def test_slow_headers_and_slow_bodies_are_cut_off(hostile):
    """Every slow client at once, each answered when its own deadline passes: headers that never end, a
    body that stops short, a body over the limit (refused unread), and slowloris, many connections
    trickling headers."""
    server, _ = hostile
    head = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-Slow: ".encode()
    body_head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {KEY}\r\n"
        'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt"'
    ).encode()
    oversize = body_head.replace(b"Content-Length: 100", f"Content-Length: {10**9}".encode())
    slow_head, slow_body, too_big = _open(server, head), _open(server, body_head), _open(server, oversize)
    slowloris = [_open(server, b"GET /health HTTP/1.1\r\n") for _ in range(8)]
    out = _reply(slow_head)
    assert out.startswith(b"HTTP/1.1 408"), out[:80]
    out = _reply(slow_body)
    assert out.startswith(b"HTTP/1.1 408"), out[:80]
    assert _reply(too_big).startswith(b"HTTP/1.1 413")  # refused unread
    for s in slowloris:  # all end at the deadline
        out = _reply(s)
        assert out.startswith(b"HTTP/1.1 408"), out[:80]
    with _client(server) as c:
        assert c.get("/health").status_code == 200


def test_connections_beyond_the_limit_are_refused(hostile):
    server, _ = hostile
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        assert extra.recv(200).startswith(b"HTTP/1.1 429")
        extra.close()
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    with _client(server) as c:
        assert c.get("/health").status_code == 200


def test_control_tokens_in_content_stay_text(hostile, tiny_async_engine):
    server, _ = hostile
    tok = tiny_async_engine.tokenizer
    control = {tok.hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    with _client(server) as c:
        for text in INJECTIONS[:3]:
            r = c.post("/v1/chat/completions", json=chat(text, max_tokens=1, prompt_logprobs=0))
            assert r.status_code == 200, r.text
            prompt_ids = [int(next(iter(e))) for e in r.json()["prompt_logprobs"][1:]]
            n_control = sum(1 for t in prompt_ids if t in control)
            # the template's own: <|im_start|>user ... <|im_end|> <|im_start|>assistant (+ a system turn)
            plain = tok.encode_chat([{"role": "user", "content": "x"}])[1]
            assert n_control == sum(1 for t in plain[1:] if t in control), (
                text,
                n_control,
            )  # [1:]: no logprob


def test_limits_are_reported_and_documented(hostile):
    server, app = hostile
    with _client(server) as c:
        limits = c.get("/v1/internals?n=0").json()["limits"]
    assert limits["max_stop_token_ids"] == LIMITS.max_stop_token_ids
    assert limits["max_prompt_chars_in_effect"] == max_prompt_chars(app.state.ctx)
    assert limits["grammar_cache_bytes_used"] is None or limits["grammar_cache_bytes_used"] >= 0
    import pathlib  # noqa: PLC0415 - only this test reads the docs

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "SERVER_LIMITS.md").read_text()
    assert limits_table() in doc  # regenerate the table with limits_table() when a limit changes


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(st.characters(codec="utf-8"), max_size=30)
    | st.sampled_from(["<|im_end|>", "\ud800", ""]),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "prompt",
        "messages",
        "max_tokens",
        "n",
        "stop",
        "stream",
        "logprobs",
        "echo",
        "structured_outputs",
        "response_format",
        "tools",
        "tool_choice",
        "input",
        "seed",
        "stop_token_ids",
        "min_tokens",
        "ignore_eos",
        "temperature",
        "top_logprobs",
    ]
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]),
    fields=st.dictionaries(_fields, _json_values, max_size=4),
)
def test_fuzzed_bodies_never_get_a_5xx(hostile, path, fields):
    server, _ = hostile
    base = {
        "/v1/completions": completion(),
        "/v1/chat/completions": chat(),
        "/v1/embeddings": {"input": "hi"},
    }[path]
    body = json.dumps({**base, **fields}).encode()
    with _client(server) as c:
        r = c.post(path, content=body, headers={"content-type": "application/json"})
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            r.read()
    assert r.status_code < 500, (r.status_code, r.text[:300])


def test_a_reader_that_stops_reading_does_not_hold_the_engine(hostile):
    """The client reads nothing while its stream (4 choices x 200 tokens with 20 logprobs each: more
    than the socket buffers hold) is generated: the engine finishes the request all the same (the
    stream keeps only the newest output, the writer waits on the socket), and the client later reads a
    complete, well-formed stream."""
    server, _ = hostile
    body = json.dumps(
        completion("Once upon a time", max_tokens=200, n=4, logprobs=20, ignore_eos=True, stream=True)
    ).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    with _client(server) as c:
        state = _drained(c)  # while the client reads nothing
    assert state["num_unfinished"] == 0 and state["kv_cache"]["blocks_used"] == 0
    s.settimeout(30)
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of the chunked body
        chunk = s.recv(1 << 16)
        assert chunk, data[-300:]
        data += chunk
    s.close()
    events = [
        json.loads(line[6:]) for line in _dechunk(data).decode().split("\n") if line.startswith("data: {")
    ]
    finished = {ch["index"] for e in events for ch in e["choices"] if ch["finish_reason"] == "length"}
    assert finished == {0, 1, 2, 3}


def _dechunk(response: bytes) -> bytes:
    """The body of an HTTP/1.1 response with Transfer-Encoding: chunked."""
    rest = response.split(b"\r\n\r\n", 1)[1]
    body = b""
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2 :]


def test_the_key_in_x_api_key_works_too(hostile):
    server, _ = hostile
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
