"""POST /v1/responses with the real openai SDK (its strict response validation on) against the
embedded model: plain and streamed (the events reassemble to the non-streamed answer), function
tools and their outputs, json_schema text, previous_response_id over the bounded store, and bad
input answered 4xx in OpenAI's error shape with nothing queued."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from servescope.server.serving_responses import ResponseStore

from .conftest import MODEL

ASK = "What is the capital of France?"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_plain_and_streamed_agree(client):
    whole = client.responses.create(
        model=MODEL, input=ASK, instructions=SYSTEM, temperature=0, max_output_tokens=16
    )
    assert whole.status in ("completed", "incomplete") and "Paris" in whole.output_text
    assert whole.usage.output_tokens > 0 and whole.usage.input_tokens > 0
    events = list(
        client.responses.create(
            model=MODEL, input=ASK, instructions=SYSTEM, temperature=0, max_output_tokens=16, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_function_call_round_trip_with_items_and_with_previous_response_id(client):
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=40,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}
    again = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            calls[0].model_dump(exclude_none=True),
            result,
        ],
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=24,
    )
    assert again.status in ("completed", "incomplete") and again.output
    chained = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=24,
    )
    assert chained.usage.input_tokens == again.usage.input_tokens  # the same conversation, from the store
    assert chained.output_text == again.output_text


def test_streamed_function_call_events(client):
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Rome?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=40,
            stream=True,
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args and json.loads(args)["city"]
    final = events[-1].response.output[0]
    assert final.type == "function_call" and final.arguments == args


class Capital(pydantic.BaseModel):
    country: str
    capital: str


def test_json_schema_text_format(client):
    r = client.responses.parse(
        model=MODEL, input=ASK, text_format=Capital, temperature=0, max_output_tokens=40
    )
    assert isinstance(r.output_parsed, Capital)
    raw = client.responses.create(
        model=MODEL, input=ASK, temperature=0, max_output_tokens=40, text={"format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(raw.output_text), dict)


def test_previous_response_id_continues_and_store_is_bounded(client):
    first = client.responses.create(
        model=MODEL, input="My name is Alice.", temperature=0, max_output_tokens=8
    )
    second = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=8,
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).id == first.id
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id)
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"r{i}", {}, [])
    assert store.get("r0") is None and store.get("r2") is not None
    small = ResponseStore(capacity=100, max_bytes=200)
    for i in range(5):
        small.put(f"r{i}", {"text": "x" * 60}, [])
    assert small.get("r0") is None and small.get("r4") is not None and small._bytes <= 200


BAD = [
    ({"input": [{"type": "input_image"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "strin"}}}},
        "text.format",
    ),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "model": "gpt-9"}, "model"),
]


def test_bad_input_is_4xx_in_openai_shape_and_queues_nothing(http, async_engine):
    for body, param in BAD:
        r = http.post("/v1/responses", json=body)
        assert 400 <= r.status_code < 500, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"], (body, err)
    assert async_engine.num_inflight == 0
    state = http.get("/v1/internals?n=0").json()
    assert state["num_unfinished"] == 0 and state["kv_cache"]["blocks_used"] == 0


def test_no_key_is_401(server):
    r = httpx.post(server.url + "/v1/responses", json={"input": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
