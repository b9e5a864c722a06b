"""The real openai SDK (strict response validation) against a live server: completions and chat,
streaming and not, n = 2, several prompts, stop strings, logprobs, usage."""

from __future__ import annotations

from openai.types import Completion

from .conftest import MODEL

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_with_logprobs_and_usage(client, async_engine):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    c = r.choices[0]
    assert c.finish_reason == "length" and c.index == 0 and c.text
    prompt_ids = async_engine.tokenizer.encode(PROMPT)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 4 and r.usage.total_tokens == len(prompt_ids) + 4
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and tok in top and 1 <= len(top) <= 3
        assert logprob == max(top.values())  # greedy: the sampled token is the most likely one


def test_completion_n2_several_prompts_indexing(client):
    r = client.completions.create(model=MODEL, prompt=["Once upon a time", "1, 2, 3,"], max_tokens=2, n=2,
                                  temperature=0.8, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 8


def test_completion_token_id_prompts_and_echo(client, async_engine):
    ids = async_engine.tokenizer.encode(PROMPT)
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    b = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0)
    s = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert b.choices[0].text == b.choices[1].text == a.choices[0].text
    assert s.choices[0].text == PROMPT + a.choices[0].text


def test_completion_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0)
    text = full.choices[0].text
    assert len(text) > 2
    stop = text[2:4] if text[2:4].strip() else text[1:3]
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_completion_stream_with_usage(client, lenient_client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    chunks = list(lenient_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # every chunk is a valid Completion once its (still open) finish_reason is filled in
    for c in chunks:
        d = c.model_dump()
        for ch in d["choices"]:
            ch["finish_reason"] = ch["finish_reason"] or "length"
        Completion.model_validate(d)


def test_chat_greedy_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(c.message.content)
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token


def test_chat_stream_matches_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == full.choices[0].message.content
    assert content[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_n2_stream(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, n=2, seed=1,
                                                 temperature=1.0, stream=True))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert set(finished) == {0, 1}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, n=2, seed=1, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 6  # two choices of 1..3 tokens each


def test_chat_stop_and_seed_reproducible(client):
    a = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=1.0, seed=42)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=1.0, seed=42)
    assert a.choices[0].message.content == b.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stop=["e"])
    assert "e" not in r.choices[0].message.content
