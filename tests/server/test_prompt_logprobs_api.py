"""Prompt logprobs over HTTP: echo + logprobs (max_tokens 0 and 1, lm-eval's requests), vLLM's
prompt_logprobs on both endpoints, streamed echo; all agree with each other and with the engine
(whose prompt logprobs are checked against transformers in tests/engine/test_prompt_logprobs.py)."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from .conftest import API_KEY, MODEL

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def test_echo_logprobs_and_prompt_logprobs_agree(lenient_client, http, async_engine):
    # lenient: the first echoed token has a null logprob (as OpenAI's and vLLM's APIs answer), which
    # the SDK's Completion model types as a float
    client = lenient_client
    zero = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    c = zero.choices[0]
    assert c.text == PROMPT and zero.usage.completion_tokens == 0
    lp = c.logprobs
    ids = async_engine.engine.tokenizer.encode(PROMPT)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and lp.text_offset[0] == 0
    one = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert one.choices[0].logprobs.token_logprobs[:-1] == lp.token_logprobs
    assert len(one.choices[0].logprobs.tokens) == len(ids) + 1
    # lm-eval's is_greedy: the top alternative's logprob is the max of each position's dict
    for tok_lp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert max(top.values()) >= tok_lp
    # vLLM's prompt_logprobs: the same numbers, on completions and chat
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                           "prompt_logprobs": 0}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for p, want in zip(plp[1:], lp.token_logprobs[1:]):
        (entry,) = p.values()
        assert math.isclose(entry["logprob"], want, abs_tol=1e-6) and entry["rank"] >= 1
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "prompt_logprobs": 2,
                                                  "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["prompt_logprobs"][0] is None and all(1 <= len(p) <= 3 for p in chat["prompt_logprobs"][1:])


def test_streamed_echo_carries_the_prompt_logprobs_first(http):
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"] == PROMPT
    text = "".join(c["text"] for c in chunks)
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
    offsets = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["text_offset"]]
    assert text == full["text"] and tokens == full["logprobs"]["token_logprobs"]
    assert offsets == full["logprobs"]["text_offset"]
