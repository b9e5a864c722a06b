"""AsyncEngine on its own: results, errors that reach the caller, abort on cancellation (the KV
blocks are free before the engine's next step), the bounded queue, tokenization off the loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from servescope.config import SamplingParams
from servescope.engine.async_engine import AsyncEngine, EngineClosedError, QueueFullError
from servescope.errors import InvalidParameterError

GREEDY = SamplingParams(temperature=0, max_tokens=3)
LONG = SamplingParams(temperature=0.9, max_tokens=4000, ignore_eos=True, seed=3)


def run(coro):
    return asyncio.run(coro)


def test_generate_matches_sync_engine_and_runs_on_one_thread(async_engine):
    threads = set()
    async_engine.engine.step_listeners.append(lambda rec: threads.add(threading.get_ident()))
    try:
        async def go():
            outs = [o async for o in async_engine.generate(async_engine.new_request_id(), "The sky is", GREEDY)]
            return outs
        outs = run(go())
    finally:
        async_engine.engine.step_listeners.pop()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert all(not o.finished for o in outs[:-1])
    assert threads == {async_engine._thread.ident}


@pytest.mark.parametrize("prompt,params,param", [
    ("", GREEDY, "prompt"),
    ([1, 2, 10**7], GREEDY, "prompt"),
    ("Hi", SamplingParams(max_tokens=9000), "max_tokens"),
])
def test_add_request_errors_reach_the_caller(async_engine, prompt, params, param):
    async def go():
        async for _ in async_engine.generate(async_engine.new_request_id(), prompt, params):
            pass
    with pytest.raises(InvalidParameterError) as e:
        run(go())
    assert e.value.param == param
    assert async_engine.num_inflight == 0


def test_cancel_frees_kv_before_next_step(async_engine):
    async def go():
        got_first = asyncio.Event()

        async def consume():
            async for _ in async_engine.generate(async_engine.new_request_id(), "Once upon a time", LONG):
                got_first.set()

        task = asyncio.create_task(consume())
        await got_first.wait()
        used = await async_engine.run_on_engine(lambda e: e.kv_cache_state()["blocks_used"])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # the abort command was queued before this call, and commands run before the next step
        state = await async_engine.run_on_engine(lambda e: (e.kv_cache_state(), e.num_unfinished))
        return used, state

    used, (kv, unfinished) = run(go())
    assert used > 0
    assert kv["blocks_used"] == 0 and unfinished == 0
    assert async_engine.num_inflight == 0


def test_bounded_queue(async_engine):
    async def go():
        streams = [await async_engine.add_request(async_engine.new_request_id(), "Hello", LONG, max_queue=2)
                   for _ in range(2)]
        with pytest.raises(QueueFullError):
            await async_engine.add_request(async_engine.new_request_id(), "Hello", LONG, max_queue=2)
        with pytest.raises(QueueFullError):
            async_engine.check_capacity(1, max_queue=2)
        for s in streams:
            s.abort()
        await async_engine.run_on_engine(lambda e: None)  # the aborts have run
        assert async_engine.num_inflight == 0
        s = await async_engine.add_request(async_engine.new_request_id(), "Hello", GREEDY, max_queue=2)
        return [o async for o in s][-1]

    assert run(go()).finished


def test_tokenization_runs_off_the_event_loop(async_engine):
    loop_thread = []
    seen = []
    tok = async_engine.engine.tokenizer
    original = tok.encode

    def spy(*a, **kw):
        seen.append(threading.get_ident())
        return original(*a, **kw)

    async def go():
        loop_thread.append(threading.get_ident())
        tok.encode = spy
        try:
            await async_engine.encode("hello " * 2000)
            await async_engine.render_chat([{"role": "user", "content": "hi"}])
        finally:
            del tok.encode

    run(go())
    assert seen and loop_thread[0] not in seen


class _StubEngine:
    """Just enough of LLMEngine for lifecycle tests: requests that never finish."""

    tokenizer = None
    max_model_len = 100

    def __init__(self):
        self.requests = {}

    def add_request(self, rid, prompt, params, priority=0, arrival_time=None):
        self.requests[rid] = prompt

    def abort(self, rid):
        return self.requests.pop(rid, None) is not None

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.005)
        return []


def test_shutdown_ends_requests_and_refuses_new_ones():
    stub = _StubEngine()
    ae = AsyncEngine(stub)

    async def go():
        s = await ae.add_request("a", [1, 2, 3], GREEDY)
        assert stub.has_unfinished()
        await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineClosedError):
            async for _ in s:
                pass
        with pytest.raises(EngineClosedError):
            await ae.add_request("b", [1, 2], GREEDY)
        with pytest.raises(EngineClosedError):
            await ae.run_on_engine(lambda e: None)

    run(go())
    assert ae.num_inflight == 0 and not stub.has_unfinished() and not ae._thread.is_alive()
