"""POST /v1/messages and /v1/messages/count_tokens with the real anthropic SDK (strict response
validation) against the embedded model: plain and streamed (the stream reassembles to the plain
answer), tool_use / tool_result round trips, structured output, stop_sequences, and errors in
Anthropic's shape with nothing queued."""

from __future__ import annotations

import json

import anthropic
import httpx
import pydantic
import pytest

from .conftest import API_KEY, MODEL

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the SDK no longer has temperature as an argument; the API still takes it
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(
        base_url=server.url, api_key=API_KEY, max_retries=0, timeout=300, _strict_response_validation=True
    )


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_and_streamed_agree(claude):
    whole = claude.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY)
    assert "Paris" in _text(whole) and whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_system_blocks_and_stop_sequences(claude):
    m = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        messages=ASK,
        stop_sequences=["Paris"],
        system=[
            {"type": "text", "text": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}
        ],
        extra_body=GREEDY,
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris" and "Paris" not in _text(m)


def test_tool_use_round_trip_plain_and_streamed(claude):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and isinstance(uses[0].input["city"], str)
    with claude.messages.stream(
        model=MODEL,
        max_tokens=40,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    ) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"] and streamed.content[0].input == uses[0].input
    history = ask + [
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 24 C"}],
        },
    ]
    answer = claude.messages.create(
        model=MODEL, max_tokens=24, messages=history, tools=[WEATHER], extra_body=GREEDY
    )
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


class Capital(pydantic.BaseModel):
    country: str
    capital: str


def test_structured_output(claude):
    parsed = claude.messages.parse(
        model=MODEL, max_tokens=40, messages=ASK, output_format=Capital, extra_body=GREEDY
    )
    assert isinstance(parsed.parsed_output, Capital)


def test_count_tokens_matches_the_prompt(claude):
    counted = claude.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])
    m = claude.messages.create(model=MODEL, max_tokens=1, messages=ASK, tools=[WEATHER], extra_body=GREEDY)
    assert counted.input_tokens == m.usage.input_tokens


def test_prefill_continues_the_assistant_turn(claude):
    m = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        messages=ASK + [{"role": "assistant", "content": "The capital of France is"}],
    )
    assert _text(m).strip().startswith("Paris")


BAD = [
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"messages": [{"role": "system", "content": "x"}]},
    {"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"messages": ASK, "tool_choice": {"type": "tool"}, "tools": [WEATHER]},
    {"messages": ASK, "max_tokens": 0},
    {"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 64}},  # no reasoning parser here
    {"messages": ASK, "output_config": {"format": {"type": "json_schema", "schema": {"type": "strin"}}}},
    {"messages": ASK, "mcp_servers": []},
    {"messages": [], "max_tokens": 4},
]


def test_errors_are_anthropic_shaped_and_queue_nothing(claude, server, async_engine):
    with httpx.Client(base_url=server.url, headers={"x-api-key": API_KEY}, timeout=60) as c:
        for body in BAD:
            r = c.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, **body})
            assert r.status_code == 400, (body, r.text)
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        r = c.post("/v1/messages", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/v1/messages", json={"model": "claude-x", "max_tokens": 4, "messages": ASK})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": ASK})
        assert r.status_code == 401 and r.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
        }
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": []}])
    assert async_engine.num_inflight == 0
    state = httpx.get(server.url + "/v1/internals?n=0", headers={"x-api-key": API_KEY}).json()
    assert state["num_unfinished"] == 0 and state["kv_cache"]["blocks_used"] == 0


def test_streamed_error_event_is_anthropic_shaped():
    from servescope.server.errors import anthropic_error_body

    assert anthropic_error_body(429, "busy") == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "busy"},
    }
    assert json.loads(json.dumps(anthropic_error_body(500, "x")))["error"]["type"] == "api_error"
