"""Structured outputs and tool calls against the real server with the embedded SmolLM2 and the real
openai SDK: every output parses and validates, `chat.completions.parse(response_format=<pydantic>)`
works, named/required tool calls validate, streamed deltas reassemble to the non-streamed answer,
and refused requests leave nothing behind."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import List, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from .conftest import API_KEY, MODEL

S = {"type": "string", "maxLength": 16}  # bounded strings: a small model cannot ramble inside one


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(required or props), "additionalProperties": False}


SCHEMAS = [
    _obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"city": S, "address": _obj({"street": S, "number": {"type": "integer", "minimum": 1, "maximum": 999}})}),
    _obj({"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}),
    _obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    _obj({"people": {"type": "array", "maxItems": 2, "items": _obj({"first": S, "last": S})}}),
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}, "currency": {"enum": ["EUR", "USD"]}}),
    _obj({"order": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 99999}, "status": {
        "enum": ["open", "shipped", "closed"]}, "items": {"type": "array", "maxItems": 3, "items": _obj({
            "sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}})}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _obj({"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
    _obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "genres": {
        "type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "minItems": 1, "maxItems": 2}},
        required=["title", "year"]),
]
N = 3  # samples per request
PER_SCHEMA = 2 * N  # 2 requests per schema: one through response_format, one through structured_outputs


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def _ask(http, i: int, j: int) -> list:
    schema = SCHEMAS[i]
    body = {"model": MODEL, "n": N, "temperature": 0.8, "seed": 100 * i + j, "max_tokens": 300,
            "messages": [{"role": "user", "content": f"Answer in JSON. Example {j} for: {json.dumps(schema)}"}]}
    if j % 2:
        body["structured_outputs"] = {"json": schema}  # vLLM's extra
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                            "strict": True}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return [(i, c) for c in r.json()["choices"]]


@pytest.mark.slow
def test_every_structured_output_parses_and_validates(http, async_engine):
    jobs = [(i, j) for i in range(len(SCHEMAS)) for j in range(PER_SCHEMA // N)]
    with ThreadPoolExecutor(16) as pool:
        results = [c for part in pool.map(lambda ij: _ask(http, *ij), jobs) for c in part]
    assert len(results) == len(SCHEMAS) * PER_SCHEMA
    for i, choice in results:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[i])


class Address(BaseModel):
    street: str = Field(max_length=16)
    number: int = Field(ge=1, le=999)


class Person(BaseModel):
    name: str = Field(max_length=16)
    role: Literal["admin", "user"]
    address: Address
    nicknames: List[str] = Field(max_length=2)


def test_openai_sdk_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(model=MODEL, response_format=Person, temperature=0, max_tokens=200,
                                         messages=[{"role": "user", "content": "Describe a person as JSON."}])
    msg = done.choices[0].message
    assert isinstance(msg.parsed, Person), msg
    assert done.choices[0].finish_reason == "stop"


def test_json_object_regex_choice(client):
    base = dict(model=MODEL, temperature=0, max_tokens=60)
    r = client.chat.completions.create(messages=[{"role": "user", "content": "A short JSON object about a cat"}],
                                       response_format={"type": "json_object"}, frequency_penalty=1.0,
                                       **dict(base, max_tokens=300))  # the penalty: greedy loops in arrays
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(prompt="My phone:", extra_body={"structured_outputs": {
        "regex": r"\+1-[0-9]{3}-[0-9]{4}"}}, **base)
    assert re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.completions.create(prompt="Is the sky blue?", extra_body={"structured_outputs": {
        "choice": ["Absolutely", "Never"]}}, **base)
    assert r.choices[0].text in ("Absolutely", "Never")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _stream_calls(client, **kw) -> tuple:
    calls, content, finish = {}, "", None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function and tc.function.name:
                c["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    return [calls[k] for k in sorted(calls)], content, finish


@pytest.mark.parametrize("choice", ["named", "required"])
def test_named_and_required_tool_calls_validate_and_stream_the_same(client, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0,
              max_tokens=120, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name]["function"]["parameters"])
    assert r.choices[0].finish_reason == ("stop" if choice == "named" else "tool_calls")
    streamed, content, finish = _stream_calls(client, **kw)
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    assert finish == r.choices[0].finish_reason and not content


def test_auto_tool_calls_history_and_streaming_agree(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    for messages in (ASK, history):
        kw = dict(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=60)
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        streamed, content, finish = _stream_calls(client, **kw)
        assert content == (m.content or "")
        assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
        assert finish == r.choices[0].finish_reason


def test_tool_call_parsers():
    from servescope.server.protocol import ChatCompletionRequest
    from servescope.server.tool_calls import ToolPlan, ToolStreamer

    req = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER, TIME]})
    plan = ToolPlan(req)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}' \
           '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    content, calls = plan.parse(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "UTC"})]
    content, calls = plan.parse('{"name": "get_time", "parameters": {"zone": "CET"}}')  # Llama-3 JSON
    assert content is None and calls[0]["function"]["name"] == "get_time"
    assert plan.parse("Just text.") == ("Just text.", [])
    # streamed token by token, the deltas reassemble to the same content and calls
    st, sent, deltas = ToolStreamer(plan), "", []
    for k in range(1, len(text) + 1):
        c, d = st.feed(text[:k], k == len(text))
        sent += c
        deltas += d
    assert sent == "Let me check." and [d["function"]["arguments"] for d in deltas] == \
        [c["function"]["arguments"] for c in plan.parse(text)[1]]
    # gpt-oss's harmony: calls to functions.NAME (recipient in the channel or the role header), the rest after
    # the reasoning parser took the analysis; the final channel is content
    harmony = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
               '{"city": "Oslo"}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json'
               '<|message|>{"zone": "UTC"}')
    content, calls = plan.parse(harmony)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    content, calls = plan.parse("<|channel|>final<|message|>It is sunny.")
    assert (content, calls) == ("<|channel|>final<|message|>It is sunny.", [])  # no call: the text as it is
    st, sent, deltas = ToolStreamer(plan), "", []
    for k in range(1, len(harmony) + 1):
        c, d = st.feed(harmony[:k], k == len(harmony))
        sent, deltas = sent + c, deltas + d
    assert sent == "" and [d["function"]["name"] for d in deltas] == ["get_weather", "get_time"]


BAD = [
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format"),
    ({"messages": ASK, "structured_outputs": {"regex": "(a|[^\\s\\S])[^\\d\\D]"}}, "structured_outputs"),
    ({"messages": ASK, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": ASK, "functions": [{"name": "f"}]}, "functions"),
]


def test_bad_structured_and_tool_requests_leave_nothing_behind(http, async_engine):
    for body, param in BAD:
        r = http.post("/v1/chat/completions", json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
    assert async_engine.num_inflight == 0
    state = http.get("/v1/internals?n=0").json()
    assert state["num_unfinished"] == 0 and state["kv_cache"]["blocks_used"] == 0
