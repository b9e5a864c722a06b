"""vLLM's request fields through the server (docs/API.md's table), on the tiny random model (fast)
and the embedded model where the text matters."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import TINY_KEY

MSG = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def th(tiny_server):
    with httpx.Client(
        base_url=tiny_server.url, timeout=120, headers={"Authorization": f"Bearer {TINY_KEY}"}
    ) as c:
        yield c


def _sse(r) -> list:
    return [
        json.loads(line[6:])
        for line in r.iter_lines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _chat(th, **kw):
    r = th.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 6, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _ids(body) -> list:
    return [int(t["token"].removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "Hi there"})]
)
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(th, path, body):
    with th.stream(
        "POST",
        path,
        json={
            **body,
            "max_tokens": 5,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ) as r:
        chunks = _sse(r)
    assert all("usage" in c and c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
        for c in chunks
    )


def test_logit_controls_change_the_tokens(th):
    base = _ids(_chat(th, logprobs=True, return_tokens_as_token_ids=True))
    forced = _ids(_chat(th, logprobs=True, return_tokens_as_token_ids=True, logit_bias={"42": 100}))
    assert forced == [42] * 6 and base != forced
    allowed = _ids(_chat(th, logprobs=True, return_tokens_as_token_ids=True, allowed_token_ids=[7, 9]))
    assert set(allowed) <= {7, 9}
    word = th.post("/detokenize", json={"tokens": [base[0]]}).json()["prompt"]
    banned = _ids(_chat(th, logprobs=True, return_tokens_as_token_ids=True, bad_words=[word]))
    assert banned[0] != base[0]


@pytest.mark.parametrize(
    "field,value",
    [
        ("logit_bias", {"99999999": 1}),
        ("logit_bias", {"x": 1}),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", []),
        ("logits_processors", ["my.Proc"]),
        ("use_beam_search", True),
        ("truncate_prompt_tokens", 0),
        ("kv_transfer_params", {}),
        ("guided_whitespace_pattern", " "),
        ("mm_processor_kwargs", {"a": 1}),
        ("chat_template_kwargs", {"messages": []}),
        ("chat_template", "{% if %}"),
    ],
)
def test_refused_values_name_the_field(th, field, value):
    r = th.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_continue_final_message_and_add_generation_prompt(th):
    both = th.post(
        "/v1/chat/completions",
        json={"messages": MSG, "continue_final_message": True, "add_generation_prompt": True},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    conv = MSG + [{"role": "assistant", "content": "The answer is"}]
    tok = th.post(
        "/tokenize", json={"messages": conv, "continue_final_message": True, "add_generation_prompt": False}
    ).json()
    text = th.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("The answer is")
    closed = th.post("/tokenize", json={"messages": conv, "add_generation_prompt": False}).json()
    assert closed["count"] > tok["count"]  # the end-of-turn the continuation leaves out
    body = _chat(th, messages=conv, continue_final_message=True, add_generation_prompt=False, echo=True)
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].startswith("The answer is")  # echo: vLLM's prefix


def test_chat_template_and_its_kwargs_reach_the_template(th):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if flag %}FLAG{% endif %}"
    on = th.post(
        "/tokenize", json={"messages": MSG, "chat_template": template, "chat_template_kwargs": {"flag": True}}
    )
    off = th.post("/tokenize", json={"messages": MSG, "chat_template": template})

    def detok(r):
        return th.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]

    assert detok(on) == "Hi thereFLAG" and detok(off) == "Hi there"
    body = _chat(th, chat_template=template, chat_template_kwargs={"flag": True})
    assert body["usage"]["prompt_tokens"] == on.json()["count"]


def test_truncate_prompt_tokens_keeps_the_last_ones(th):
    full = _chat(th)["usage"]["prompt_tokens"]
    assert full > 3
    assert _chat(th, truncate_prompt_tokens=3)["usage"]["prompt_tokens"] == 3
    r = th.post(
        "/v1/completions",
        json={
            "prompt": "one two three four five",
            "max_tokens": 1,
            "truncate_prompt_tokens": 2,
            "echo": True,
        },
    )
    assert r.json()["usage"]["prompt_tokens"] == 2
    assert r.json()["choices"][0]["text"].startswith(" four five")


def test_request_id_priority_and_cache_salt(th):
    body = _chat(th, request_id="abc-123", priority=-5, cache_salt="s1")
    assert body["id"] == "chatcmpl-abc-123"
    r = th.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "request_id": "q9"})
    assert r.json()["id"] == "cmpl-q9"


def test_cache_salt_separates_prefix_cache_hits(th):
    text = "the quick brown fox jumps over the lazy dog " * 6  # several full KV blocks

    def cached(**kw):
        r = th.post("/v1/responses", json={"input": text, "max_output_tokens": 1, "store": False, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0  # the same prompt again: its blocks are shared
    assert cached(cache_salt="alice") == 0  # another salt: nothing shared
    assert cached(cache_salt="alice") > 0
    assert cached(cache_salt="bob") == 0


def test_guided_fields_are_structured_outputs(th):
    body = _chat(th, guided_choice=["yes", "no"], max_tokens=4)
    assert body["choices"][0]["message"]["content"] in ("yes", "no")
    r = th.post("/v1/chat/completions", json={"messages": MSG, "guided_choice": ["a"], "guided_regex": "b"})
    assert r.status_code == 400


def test_tokenize_and_detokenize(th):
    r = th.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 256
    assert th.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "hello world"
    assert th.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert th.post("/tokenize", json={"prompt": "x", "messages": MSG}).status_code == 400


def test_embeddings_from_messages_and_truncated_input(th):
    r = th.post("/v1/embeddings", json={"messages": MSG})
    assert r.status_code == 200, r.text
    n_chat = r.json()["usage"]["prompt_tokens"]
    assert n_chat == th.post("/tokenize", json={"messages": MSG}).json()["count"]
    r = th.post(
        "/v1/embeddings",
        json={"input": "one two three four", "truncate_prompt_tokens": 2, "request_id": "e1"},
    )
    assert r.json()["usage"]["prompt_tokens"] == 2 and r.json()["id"] == "embd-e1"


def test_guidellm_shaped_request(http):
    """What guidellm sends on every streamed chat request (the embedded model)."""
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
        "max_completion_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = _sse(r)
    assert chunks[-1]["usage"]["completion_tokens"] == 8


QWEN3_TAIL = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}")


def test_enable_thinking_reaches_a_qwen3_style_template(th):
    def prompt(**kw):
        r = th.post("/tokenize", json={"messages": MSG, "chat_template": QWEN3_TAIL, **kw})
        return th.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]

    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    assert prompt(chat_template_kwargs={"enable_thinking": True}).endswith("assistant\n")
    assert prompt().endswith("assistant\n")
