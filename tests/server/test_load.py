"""Load: a disconnect storm frees every KV block, a burst of 64 concurrent requests all complete
correctly, and a small --max-queue answers the overflow with 429 + Retry-After.

Timing limits are the spec's (generous); nothing here measures speed."""

from __future__ import annotations

import asyncio
import time

import httpx

from .conftest import API_KEY, MODEL, SMALL_QUEUE

C = "/v1/completions"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _internals(http: httpx.Client) -> dict:
    return http.get("/v1/internals?n=1").json()


def _wait_idle(http: httpx.Client, baseline_blocks: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _internals(http)
        if st["num_in_flight"] == 0 and st["kv_cache"]["blocks_used"] == baseline_blocks:
            return st
        assert time.monotonic() < deadline, f"KV blocks not freed: {st['kv_cache']} in flight {st['num_in_flight']}"
        time.sleep(0.1)


def _long_request(i: int, stream: bool) -> dict:
    # would run for minutes if its abort were lost
    return {"model": MODEL, "prompt": f"Tell me story number {i}:", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0.9, "seed": i, "stream": stream}


def test_disconnect_storm_frees_kv(server, http):
    baseline = _wait_idle(http, 0)["kv_cache"]["blocks_used"]

    async def drop_after_first_token(client: httpx.AsyncClient, i: int) -> bool:
        async with client.stream("POST", C, json=_long_request(i, True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def storm():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(drop_after_first_token(client, i) for i in range(50)))

    assert all(asyncio.run(storm()))
    st = _wait_idle(http, baseline)
    assert st["kv_cache"]["usage"] == 0.0 and st["kv_cache"]["num_running"] == 0
    t0 = time.monotonic()
    r = http.post(C, json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert time.monotonic() - t0 < 5.0


def test_non_streaming_disconnect_aborts(server, http):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=1.5) as impatient:
        try:
            impatient.post(C, json=_long_request(99, False))
        except httpx.TimeoutException:
            pass
        else:
            raise AssertionError("a 4000-token request finished within 1.5 s")
    _wait_idle(http, 0)


PROMPTS = [f"Here is fact number {i} about the ocean:" for i in range(8)]


def test_burst_of_64_all_complete_and_correct(server, http):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    expected = {}
    for p in PROMPTS:  # one at a time: the single-request answer
        r = http.post(C, json={**body, "prompt": p})
        expected[p] = r.json()["choices"][0]["text"]

    async def burst():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=600, limits=limits) as client:
            return await asyncio.gather(*(client.post(C, json={**body, "prompt": PROMPTS[i % 8]})
                                          for i in range(64)))

    responses = asyncio.run(burst())
    assert len(responses) == 64
    ids = set()
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        d = r.json()
        ids.add(d["id"])
        c = d["choices"][0]
        assert c["text"] == expected[PROMPTS[i % 8]], (i, c["text"], expected[PROMPTS[i % 8]])
        assert c["finish_reason"] in ("stop", "length") and d["usage"]["completion_tokens"] <= 6
    assert len(ids) == 64
    _wait_idle(http, 0)


def test_small_queue_overflow_gets_429(small_queue_server, http):
    url = small_queue_server.url

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as client:
            # hold every slot with streams that have produced a token
            holders = []  # (response, its line iterator): dropping the iterator would close the stream
            for i in range(SMALL_QUEUE):
                req = client.build_request("POST", C, json=_long_request(200 + i, True))
                resp = await client.send(req, stream=True)
                assert resp.status_code == 200
                lines = resp.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                holders.append((resp, lines))
            over = await asyncio.gather(*(client.post(C, json={"prompt": "Hi", "max_tokens": 2}) for _ in range(5)))
            for r in over:
                assert r.status_code == 429, r.text
                assert int(r.headers["Retry-After"]) >= 1
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and set(err) == {"message", "type", "param", "code"}
            for resp, _ in holders:
                await resp.aclose()
            # slots come back: once the aborts ran, a request succeeds
            deadline = time.monotonic() + 60
            while True:
                r = await client.post(C, json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
                if r.status_code == 200:
                    break
                assert r.status_code == 429 and time.monotonic() < deadline
                await asyncio.sleep(0.2)
            # a concurrent burst: each request either completes or gets 429, nothing else
            burst = await asyncio.gather(*(client.post(C, json={"prompt": f"Count to {i}:", "max_tokens": 8,
                                                                "ignore_eos": True}) for i in range(16)))
            codes = [r.status_code for r in burst]
            assert set(codes) <= {200, 429} and codes.count(200) >= SMALL_QUEUE and 429 in codes
            for r in burst:
                if r.status_code == 200:
                    assert r.json()["usage"]["completion_tokens"] == 8

    asyncio.run(scenario())
    _wait_idle(http, 0)
