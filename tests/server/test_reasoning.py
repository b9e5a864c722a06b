"""Reasoning parsers: the split of <think>...</think> from the answer (deepseek_r1, qwen3 styles),
streamed deltas that reassemble to it, and end to end through the server on a tiny random model
(the SmolLM2 tokenizer writes </think> as several tokens; the thinking budget forces them)."""

from __future__ import annotations

import json

import httpx
import pytest

from servescope.server.app import build_app
from servescope.server.reasoning import PARSERS, ReasoningStreamer, make_reasoning_parser

from .server_utils import LiveServer

CASES = [  # style, output text, (reasoning, answer)
    ("deepseek_r1", "I think so.</think>\n\nParis.", ("I think so.", "\n\nParis.")),
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "still thinking", ("still thinking", None)),
    ("qwen3", "<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "\n\nParis.")),
    ("qwen3", "  <think>a</think>b", ("a", "b")),
    ("qwen3", "Paris.", (None, "Paris.")),
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("qwen3", "<thin", (None, "<thin")),
    # gpt-oss's harmony channels (the markers are special tokens, kept in these requests' text)
    ("openai_gptoss", "<|channel|>analysis<|message|>Sky: Rayleigh.<|end|><|start|>assistant<|channel|>final"
                      "<|message|>Blue light scatters most.", ("Sky: Rayleigh.", "Blue light scatters most.")),
    ("openai_gptoss", "<|channel|>final<|message|>Paris.", (None, "Paris.")),  # no analysis
    ("openai_gptoss", "<|channel|>analysis<|message|>cut off", ("cut off", None)),
    ("openai_gptoss", "<|channel|>analysis<|message|>a<|end|>", ("a", None)),  # the header not yet written
    ("openai_gptoss", "plain", (None, "plain")),
]


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


@pytest.mark.parametrize("style,text,expected", CASES)
def test_split(style, text, expected):
    assert make_reasoning_parser(style, _Tok()).split(text) == expected


@pytest.mark.parametrize("style,text,expected", CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_streamed_deltas_reassemble_to_the_split(style, text, expected, step):
    s = ReasoningStreamer(PARSERS[style])
    reasoning, answer = "", ""
    for end in list(range(step, len(text), step)) + [len(text)]:
        dr, da = s.feed(text[:end], end == len(text))
        reasoning, answer = reasoning + dr, answer + da
    assert (reasoning or None, answer or None) == expected


def test_token_count_runs_through_the_end_marker():
    p = make_reasoning_parser("deepseek_r1", _Tok())
    text = "ab</think>cd"
    assert p.count_tokens(text, [ord(c) for c in text]) == len("ab</think>")
    assert p.count_tokens("abc", [1, 2, 3]) == 3  # never closed: all of it
    assert make_reasoning_parser("qwen3", _Tok()).count_tokens("plain", [1, 2]) == 0


def test_unknown_parser_is_an_error():
    with pytest.raises(ValueError):
        make_reasoning_parser("nope", None)


# ---- end to end: a tiny random model behind a server with --reasoning-parser deepseek_r1
KEY = "sk-reasoning"
BUDGET = 5


@pytest.fixture(scope="module")
def rserver(tiny_async_engine):
    s = LiveServer(
        build_app(tiny_async_engine, model_name="tiny", api_key=KEY, reasoning_parser="deepseek_r1")
    ).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rhttp(rserver):
    with httpx.Client(base_url=rserver.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


CHAT = {
    "messages": [{"role": "user", "content": "Why is the sky blue?"}],
    "max_tokens": 14,
    "temperature": 0,
    "max_reasoning_tokens": BUDGET,
}


def _sse(r) -> list:
    return [
        json.loads(line[6:])
        for line in r.iter_lines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_budget_forces_the_end_of_reasoning_and_usage_counts_it(rhttp):
    r = rhttp.post(
        "/v1/chat/completions", json={**CHAT, "logprobs": True, "return_tokens_as_token_ids": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [int(t["token"].removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["content"]]
    end = rhttp.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
    assert ids[BUDGET : BUDGET + len(end)] == end  # forced right after the budget
    msg = body["choices"][0]["message"]
    detok = lambda t: rhttp.post("/detokenize", json={"tokens": t}).json()["prompt"]  # noqa: E731
    assert msg["reasoning_content"] == detok(ids[:BUDGET])
    assert (msg["content"] or "") == detok(ids[BUDGET + len(end) :])
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET + len(end)
    metrics = rhttp.get("/metrics").text
    assert any(
        line.startswith("servescope:reasoning_tokens_total") and float(line.split()[-1]) > 0
        for line in metrics.splitlines()
    )


def test_streamed_chat_reassembles_to_the_whole_answer(rhttp):
    whole = rhttp.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    with rhttp.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        chunks = _sse(r)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert reasoning == whole["reasoning_content"]
    assert content == (whole["content"] or "")


def test_include_reasoning_false_drops_it(rhttp):
    msg = rhttp.post("/v1/chat/completions", json={**CHAT, "include_reasoning": False}).json()["choices"][0][
        "message"
    ]
    assert "reasoning_content" not in msg


def test_reasoning_in_responses_and_messages(rhttp):
    whole = rhttp.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    r = rhttp.post(
        "/v1/responses",
        json={
            "input": CHAT["messages"][0]["content"],
            "max_output_tokens": 14,
            "temperature": 0,
            "store": False,
            "reasoning": {"effort": "low"},
        },
    )
    assert r.status_code == 200, r.text  # no budget field in the Responses API: the model runs to 14 tokens
    items = r.json()["output"]
    assert items[0]["type"] == "reasoning" and items[0]["content"][0]["type"] == "reasoning_text"
    m = rhttp.post(
        "/v1/messages",
        json={
            "model": "tiny",
            "max_tokens": 14,
            "temperature": 0,
            "messages": CHAT["messages"],
            "thinking": {"type": "enabled", "budget_tokens": BUDGET},
        },
    )
    assert m.status_code == 200, m.text
    blocks = m.json()["content"]
    assert blocks[0] == {"type": "thinking", "thinking": whole["reasoning_content"], "signature": ""}
    assert "".join(b.get("text", "") for b in blocks[1:]) == (whole["content"] or "")


def test_budget_without_a_parser_is_a_400(tiny_server):
    r = httpx.post(
        tiny_server.url + "/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": "Bearer sk-dashboard-test"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_reasoning_tokens"


def test_streamed_reasoning_reassembles_in_responses_and_messages(rserver, rhttp):
    import anthropic
    import openai

    body = {"input": CHAT["messages"][0]["content"], "max_output_tokens": 14, "temperature": 0, "store": False}
    whole = rhttp.post("/v1/responses", json=body).json()
    client = openai.OpenAI(base_url=rserver.url + "/v1", api_key=KEY, max_retries=0,
                           _strict_response_validation=True)
    events = list(client.responses.create(model="tiny", stream=True, **body))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == whole["output"][0]["content"][0]["text"]
    final = events[-1].response.model_dump(exclude={"id", "created_at"}, exclude_none=True)
    assert [o["type"] for o in final["output"]] == [o["type"] for o in whole["output"]]

    claude = anthropic.Anthropic(base_url=rserver.url, api_key=KEY, max_retries=0,
                                 _strict_response_validation=True)
    kw = dict(model="tiny", max_tokens=14, messages=CHAT["messages"], extra_body={"temperature": 0},
              thinking={"type": "enabled", "budget_tokens": BUDGET})
    plain = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]


def test_harmony_requests_keep_special_tokens_and_a_budget_forces_the_final_header(tmp_path):
    """--reasoning-parser openai_gptoss: the channels' markers are special tokens, so its requests are decoded
    with them (a random model pushed to write one shows it in the text); its budget closes the analysis with the
    end marker and the final channel's header, tokens of the model's own tokenizer."""
    from tiny_models import make_tiny_hf_model
    from transformers import AutoTokenizer

    from servescope.engine.async_engine import AsyncEngine
    from servescope.engine.llm_engine import LLMEngine

    markers = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"]
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=49160)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": markers})
    tok.save_pretrained(path)
    ae = AsyncEngine(LLMEngine(model=str(path), num_kv_blocks=32, block_size=8, max_model_len=128))
    s = LiveServer(build_app(ae, model_name="tiny", api_key=KEY, reasoning_parser="openai_gptoss")).start()
    try:
        with httpx.Client(base_url=s.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            channel = tok.convert_tokens_to_ids("<|channel|>")
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
                    "logit_bias": {str(channel): 100}}
            msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert msg["content"].startswith("<|channel|>")  # kept: skip_special_tokens would drop it
        parser = make_reasoning_parser("openai_gptoss", ae.tokenizer)
        budget = parser.budget(4)
        assert budget.start_token_ids == tuple(tok.encode("<|channel|>analysis<|message|>", add_special_tokens=False))
        closing = "<|end|><|start|>assistant<|channel|>final<|message|>"
        assert budget.end_token_ids == tuple(tok.encode(closing, add_special_tokens=False))
        assert tok.convert_tokens_to_ids("<|end|>") == budget.end_token_ids[0]
    finally:
        s.stop()
        ae.shutdown()
