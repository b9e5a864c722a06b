"""1 prefill + 1 decode engine process behind the real server on loopback (the embedded SmolLM2): greedy
tokens are the single engine's, through the openai client; bad input is refused with nothing queued; a
request aborted while its prompt is in the prefill process leaves no block held; a killed prefill
process turns into 503s naming it, without a hang, and shutdown leaves no process behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from servescope.cli import main as cli_main
from servescope.config import SamplingParams
from servescope.engine.async_engine import AsyncEngine
from servescope.engine.disaggregated import DisaggregatedEngine
from servescope.engine.llm_engine import LLMEngine
from servescope.server.app import build_app
from server.server_utils import LiveServer, openai_client

MODEL, KEY = "smollm2-135m", "sk-disagg-test"
PROMPTS = [
    "The capital of France is",  # under one block: the decode engine takes it at once
    "Write a short story about a robot who learns to paint. Once upon a time, in a small town by the sea, "
    "there lived a robot named",
    "The moon is Earth's only natural satellite. It orbits at an average distance of about 384,400 km and "
    "takes about 27 days to go around the planet. Its surface is covered in craters, and it has no air. "
    "Here are three more facts about the moon:\n1.",
]
MAX_TOKENS = 12
STAGES = ("arrival", "dispatched", "received", "scheduled", "prefilled", "exported", "announced", "landed",
          "adopting", "adopted")


def _greedy_ids(engine: LLMEngine) -> list:
    """Each prompt's greedy tokens on the plain engine, one request at a time."""
    out = []
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"ref-{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    out.append(o.outputs[0].token_ids)
    return out


def _disaggregated_meanwhile(decode: LLMEngine, meanwhile):
    """(DisaggregatedEngine(decode), meanwhile()): the prefill process starts (spawn, imports, weights:
    seconds of a core of its own) while `meanwhile` runs here. The constructor only reads the decode
    engine's config, and no request reaches the new engine before meanwhile has returned."""
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(DisaggregatedEngine, decode)
        try:
            result = meanwhile()
        except BaseException:
            with contextlib.suppress(Exception):
                starting.result().shutdown()
            raise
        return starting.result(), result


@pytest.fixture(scope="module")
def setup(smollm2_engine):
    engine = smollm2_engine(max_model_len=1024, num_kv_blocks=256, num_threads=1)

    def reference():
        expected = _greedy_ids(engine)
        engine.kv_manager.reset_prefix_cache()  # the decode engine starts as cold as the single one did
        return expected

    dis, expected = _disaggregated_meanwhile(engine, reference)
    ae = AsyncEngine(dis)
    server = LiveServer(build_app(ae, model_name=MODEL, api_key=KEY)).start()
    yield dis, ae, server, expected
    server.stop()
    ae.shutdown()
    dis.shutdown()


def test_greedy_tokens_are_the_single_engines(setup):
    dis, _, server, expected = setup
    client = openai_client(server, KEY, timeout=120)
    texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    tok = dis.decode.tokenizer
    assert texts == [tok.decode(ids) for ids in expected]
    sent = [t for t in dis.timelines.values() if "landed" in t]  # the two prompts with a full block
    assert len(sent) == 2 and all(t["blocks"] >= 1 and t["bytes"] > 0 for t in sent)
    for t in sent:  # one clock for both processes: every stage of the hand-over in order
        times = [t[stage] for stage in STAGES]
        assert times == sorted(times), t
    # a streamed request too: the same text in chunks
    stream = openai_client(server, KEY, strict=False, timeout=120).completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == texts[1]
    _wait_idle(dis)


def _wait_idle(dis, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while dis.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    km = dis.decode.kv_manager
    assert not dis.has_unfinished() and km.num_used_blocks == 0  # only cached, evictable blocks remain


def test_bad_input_is_refused_and_nothing_is_queued(setup):
    dis, _, server, _ = setup
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "prompt": "word " * 1100, "max_tokens": 4})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert not dis._pending


def test_an_abort_during_the_prefill_leaves_no_block_held_and_its_id_can_come_back(setup):
    """The aborted request's KV (of another prompt) must not be taken for the next request of its id."""
    dis, ae, _, expected = setup

    def add_and_abort(engine):
        engine.add_request("again", PROMPTS[1], SamplingParams(max_tokens=4))
        return engine.abort("again")

    async def scenario():
        assert await ae.run_on_engine(add_and_abort) is True
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        last = None
        async for out in ae.generate("again", PROMPTS[2], params):
            last = out
        return last.outputs[0].token_ids

    assert asyncio.run(scenario()) == expected[2]
    _wait_idle(dis)
    dis.decode.kv_manager.check_invariants()


def test_a_model_with_windowed_and_full_layers_disaggregates_with_the_single_engines_tokens(tmp_path):
    """Gemma 2 (alternating windowed and full layers: a block table per group) in two processes: each group's
    view of the prompt crosses, the decode engine hits it and its greedy tokens are one engine's."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
    from tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path, "gemma2", sliding_window=16, num_hidden_layers=2, with_tokenizer=False)
    kw = dict(model=str(path), max_model_len=256, num_kv_blocks=64, num_threads=1)
    prompts = [[(11 * i + 5 * j) % 500 + 5 for i in range(40 + 31 * j)] for j in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    single, decode = LLMEngine(**kw), LLMEngine(**kw)

    def reference():
        expected = {}
        for j, p in enumerate(prompts):
            single.add_request(f"r{j}", p, params)
            while single.has_unfinished():
                expected.update({o.request_id: o.outputs[0].token_ids for o in single.step() if o.finished})
        return expected

    dis, expected = _disaggregated_meanwhile(decode, reference)
    try:
        assert dis.decode.kv_manager.num_groups == 2
        got, deadline = {}, time.monotonic() + 120
        for j, p in enumerate(prompts):
            dis.add_request(f"r{j}", p, params)
        while len(got) < len(prompts) and time.monotonic() < deadline:
            got.update({o.request_id: o.outputs[0].token_ids for o in dis.step() if o.finished})
        assert got == expected
        assert [dis.timelines[f"r{j}"]["blocks"] for j in range(3)] == [2, 4, 6]  # (40 - 1) // 16, ...
        km = dis.decode.kv_manager
        km.check_invariants()
        assert km.num_used_blocks == 0
    finally:
        dis.shutdown()


def test_bad_layouts_are_refused_before_anything_loads(capsys):
    assert cli_main(["serve", "--disaggregate", "2P1D"]) == 2
    assert "--disaggregate must be one of 1P1D" in capsys.readouterr().err
    assert cli_main(["serve", "--disaggregate", "1P1D", "--no-prefix-caching"]) == 2
    assert "needs prefix caching" in capsys.readouterr().err


def test_zz_a_killed_prefill_process_gives_503s_not_a_hang(setup):
    """Runs last in this module: it kills the shared engine's prefill process."""
    dis, _, server, _ = setup
    os.kill(dis._worker.pid, signal.SIGKILL)
    dis._worker.join(10)
    headers = {"Authorization": f"Bearer {KEY}"}
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4})
    assert r.status_code == 503, r.text
    msg = r.json()["error"]["message"]
    assert "prefill process exited with code -9" in msg and "restarted" in msg
    assert time.monotonic() - t0 < 30
    assert dis.decode.kv_manager.num_used_blocks == 0
    dis.shutdown()
    assert dis._worker.exitcode is not None
