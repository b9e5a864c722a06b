"""/v1/internals/stream and /dashboard on a real server (a tiny random model): the API key, what the
frames hold (the block map's counts equal /v1/internals), and the bounds: a viewer that stops
reading never holds the engine up, and 1,000+ steps/s do not grow the server's memory."""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from servescope.bench.dashboard_viewer import DashboardViewer
from servescope.telemetry.step_record import StepRecord

from .conftest import TINY_KEY

AUTH = {"Authorization": f"Bearer {TINY_KEY}"}


def _events(url: str, n: int, headers=AUTH) -> list:
    """The first n (event, data) pairs of the stream."""
    out = []
    with httpx.stream("GET", url + "/v1/internals/stream", headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                out.append((event, json.loads(line[6:])))
                if len(out) == n:
                    return out
    return out


def _load(url: str, n: int, max_tokens: int = 24, prompt: str = "Tell me about paged attention") -> list:
    def one(i):
        r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120,
                       json={"model": "tiny", "prompt": f"{prompt} {i}", "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True})
        return r.status_code

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _wait_for(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_feed_and_page_need_the_key(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/internals/stream")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(tiny_server.url + "/dashboard")  # a browser is asked for Basic credentials: the key
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    page = httpx.get(tiny_server.url + "/dashboard", auth=("viewer", TINY_KEY))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/static/dashboard.js"' in page.text
    js = httpx.get(tiny_server.url + "/dashboard/static/dashboard.js", headers=AUTH)
    assert js.status_code == 200 and "javascript" in js.headers["content-type"] and "innerHTML" not in js.text
    for bad in ("nope.js", "..%2Fapp.py", "dashboard.html"):
        r = httpx.get(tiny_server.url + "/dashboard/static/" + bad, headers=AUTH)
        assert r.status_code == 404 and "error" in r.json()


def test_frames_follow_the_load_and_agree_with_internals(tiny_server, tiny_async_engine):
    before = httpx.get(tiny_server.url + "/v1/internals?n=1", headers=AUTH).json()
    viewer = DashboardViewer(tiny_server.url, TINY_KEY).start(wait_s=120)
    assert viewer.hello is not None, viewer.summary()
    assert viewer.hello["source"] == "live" and viewer.hello["model"] == "tiny"
    assert viewer.hello["hardware"]["ridge"] > 0
    assert _load(tiny_server.url, 6) == [200] * 6
    assert _wait_for(lambda: viewer.frames >= 3)
    viewer.stop()
    assert viewer.error is None, viewer.error
    assert viewer.last_step > (before["steps"] or [{"step": 0}])[-1]["step"]
    # idle now: a frame and the snapshot describe the same state
    (_, hello), (_, frame) = _events(tiny_server.url, 2)
    snap = httpx.get(tiny_server.url + "/v1/internals?n=1", headers=AUTH).json()
    kv, state = frame["kv"], snap["kv_cache"]
    c = kv["counts"]
    assert kv["num_blocks"] == state["num_blocks"] == len(kv["states"]) == sum(n for _, n in kv["owners"])
    assert c["used"] + c["cached"] == state["blocks_used"], (c, state)
    assert c["free"] + c["evictable"] == state["blocks_free"], (c, state)
    assert c["cached"] + c["evictable"] == state["blocks_cached"], (c, state)
    assert frame["last_step"] == snap["steps"][-1]["step"]
    assert frame["queues"]["running"]["count"] == 0, frame["queues"]
    assert frame["latency"]["finished"] >= 6, frame["latency"]
    assert frame["totals"]["decode_tokens"] > 0
    steps = hello["frame"]["steps"]
    assert [s["step"] for s in steps] == list(range(steps[0]["step"], steps[-1]["step"] + 1))
    assert {s["phase"] for s in steps} >= {"prefill", "decode"}


def _stalled_viewer(url: str) -> socket.socket:
    """A client that asks for the stream, then never reads (a tiny receive buffer fills at once)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect((host, int(port)))
    s.sendall(f"GET /v1/internals/stream HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TINY_KEY}\r\n\r\n".encode())
    return s


def _small_send_buffer(live, client: socket.socket) -> None:
    """The server's end of `client` with a small send buffer: a viewer that never reads blocks the server's
    writes after a few frames, not after the megabytes the system lets a loopback socket buffer (which took
    seconds of frames to fill)."""
    port = client.getsockname()[1]

    def server_end():
        for proto in list(live.server.server_state.connections):
            transport = getattr(proto, "transport", None)
            if transport is not None and (transport.get_extra_info("peername") or (None, None))[1] == port:
                return transport.get_extra_info("socket")
        return None

    assert _wait_for(lambda: server_end() is not None)
    server_end().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def _fast(broadcaster, interval_s: float):
    """Run the broadcaster faster for a test (frames pile up sooner), restored afterwards."""
    class Ctx:
        def __enter__(self):
            self.saved = broadcaster.interval_s
            broadcaster.interval_s = interval_s

        def __exit__(self, *exc):
            broadcaster.interval_s = self.saved

    return Ctx()


def test_a_stalled_viewer_never_holds_up_the_engine(tiny_server):
    broadcaster = tiny_server.server.config.app.state.broadcaster
    with _fast(broadcaster, 0.005):
        stalled = _stalled_viewer(tiny_server.url)
        _small_send_buffer(tiny_server, stalled)
        try:
            assert _wait_for(lambda: any(v.queue.dropped for v in broadcaster.viewers))
            reader = DashboardViewer(tiny_server.url, TINY_KEY).start(wait_s=120)
            sent = broadcaster.frames_sent
            assert _load(tiny_server.url, 8, max_tokens=32) == [200] * 8  # served while one viewer is stuck
            assert _wait_for(lambda: reader.frames >= 5)
            reader.stop()
            stuck = max(broadcaster.viewers, key=lambda v: v.queue.dropped)
            assert len(stuck.queue) <= broadcaster.queue_size and stuck.queue.dropped > 0
            assert broadcaster.frames_sent > sent and reader.error is None
        finally:
            stalled.close()
    assert _wait_for(lambda: not broadcaster.viewers)  # a closed connection lets go of its viewer


def _pump_steps(async_engine, seconds: float, per_call: int = 100, min_steps: int = 0) -> tuple:
    """Append synthetic step records on the engine thread, as fast as it takes them, for `seconds` and until
    min_steps were appended (at most 60 s more on a slow machine); (steps, seconds)."""
    async def pump():
        t0, n = time.monotonic(), 0

        def inject(engine):
            nonlocal n
            for _ in range(per_call):
                engine._step_counter += 1  # the engine's own numbering: later steps continue from here
                engine.step_records.append(StepRecord(
                    step=engine._step_counter, start_time=time.perf_counter(), wall_seconds=1e-4,
                    num_prefill_seqs=0, num_decode_seqs=4, num_prefill_tokens=0, num_decode_tokens=4,
                    context_lens=[40, 41, 42, 43], kv_blocks_used=20, kv_blocks_free=76, kv_blocks_cached=3,
                    kv_usage=20 / 96, num_running=4, num_waiting=0, num_preemptions_total=0))
                n += 1

        while time.monotonic() - t0 < seconds or (n < min_steps and time.monotonic() - t0 < seconds + 60):
            await async_engine.run_on_engine(inject)
            await asyncio.sleep(0.005)
        return n, time.monotonic() - t0

    return asyncio.run(pump())


def test_1000_steps_per_second_do_not_grow_memory(tiny_server, tiny_async_engine):
    app = tiny_server.server.config.app
    broadcaster = app.state.broadcaster
    engine = tiny_async_engine.engine
    history = engine.step_records
    # the engine keeps 100,000 records on its own (its history, bounded apart from the dashboard):
    # a short one here, so that what grows or not is the dashboard's part
    asyncio.run(tiny_async_engine.run_on_engine(
        lambda e: setattr(e, "step_records", collections.deque(history, maxlen=2000))))
    stalled = _stalled_viewer(tiny_server.url)
    _small_send_buffer(tiny_server, stalled)
    reader = DashboardViewer(tiny_server.url, TINY_KEY).start(wait_s=120)
    try:
        with _fast(broadcaster, 0.02):
            stalled_now = lambda: any(v.queue.dropped for v in broadcaster.viewers)  # noqa: E731
            for _ in range(60):  # until the stuck viewer's socket is full and its queue drops frames
                if stalled_now():
                    break
                _pump_steps(tiny_async_engine, 0.5)
            assert stalled_now()
            # traced from before the warm-up: by its end every record in the history, every queued
            # frame and buffer was allocated under tracing, so what is replaced later is freed in it too
            tracemalloc.start()
            _pump_steps(tiny_async_engine, 1.5)
            base = tracemalloc.get_traced_memory()[0]
            n, secs = _pump_steps(tiny_async_engine, 3.0, min_steps=3000)
            grown = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
        # the premise, as a count (not a rate, which a loaded machine decides): 3000 steps or more went by,
        # at whatever pace the machine allowed (a thousand or more a second on a quiet one)
        assert n >= 3000, f"the premise: {n} steps in {secs:.1f} s"
        assert grown < 1_000_000, f"memory grew {grown} bytes over {n} steps"
        stuck = max(broadcaster.viewers, key=lambda v: v.queue.dropped)
        assert len(stuck.queue) <= broadcaster.queue_size and stuck.queue.dropped > 0
        assert reader.frames > 0 and reader.error is None
    finally:
        reader.stop()
        stalled.close()
        asyncio.run(tiny_async_engine.run_on_engine(lambda e: setattr(e, "step_records", history)))
    assert _wait_for(lambda: not broadcaster.viewers)


def test_too_many_viewers_get_a_clear_error(tiny_server):
    broadcaster = tiny_server.server.config.app.state.broadcaster
    assert _wait_for(lambda: not broadcaster.viewers)  # the earlier tests' viewers have gone
    saved, broadcaster.max_viewers = broadcaster.max_viewers, 1
    viewer = DashboardViewer(tiny_server.url, TINY_KEY).start(wait_s=120)
    try:
        with httpx.stream("GET", tiny_server.url + "/v1/internals/stream", headers=AUTH, timeout=30) as r:
            assert r.status_code == 429 and json.loads(r.read())["error"]["code"] == "too_many_viewers"
        assert viewer.hello is not None and viewer.error is None  # the one admitted is unaffected
    finally:
        viewer.stop()
        broadcaster.max_viewers = saved


def test_a_slow_viewer_gets_the_frames_together_and_loses_no_step(tiny_server):
    """?interval=1: the server writes to the viewer about once a second (the page's draw rate), each
    write holding the frames since the last one, so the steps still arrive every one, in order."""
    arrivals, steps, done, buf = [], [], threading.Event(), ""
    load = threading.Thread(target=lambda: (_load(tiny_server.url, 6, 48), done.set()))
    with httpx.stream("GET", tiny_server.url + "/v1/internals/stream?interval=1", headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        load.start()
        for chunk in r.iter_text():
            buf += chunk
            *blocks, buf = buf.split("\n\n")
            for block in blocks:
                if block.startswith("event: frame"):
                    arrivals.append(time.monotonic())
                    steps += [s["step"] for s in json.loads(block.split("data: ", 1)[1])["steps"]]
            if done.is_set() and len(arrivals) >= 8:
                break
    load.join()
    # frames written together arrive within milliseconds; the writes are a second apart
    writes = [t for i, t in enumerate(arrivals) if i == 0 or t - arrivals[i - 1] > 0.1]
    gaps = [b - a for a, b in zip(writes, writes[1:])]
    assert steps and steps == list(range(steps[0], steps[-1] + 1))  # no step lost between writes
    assert gaps and min(gaps) >= 0.8 and len(arrivals) > len(writes), (gaps, len(arrivals))


@pytest.mark.parametrize("interval", ["-1", "11", "soon", "nan", "inf", "1e400", "", "-inf"])
def test_a_bad_interval_is_refused(tiny_server, interval):
    r = httpx.get(tiny_server.url + f"/v1/internals/stream?interval={interval}", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text
