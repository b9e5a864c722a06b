"""No silent ignores: every request field of the openai SDK's completions and chat-completions
types is either implemented (answered 200) or rejected with a 400 naming it. A field the SDK gains
later fails this test until it is given a sample value here and a decision in the server."""

from __future__ import annotations

import typing

import httpx
import pytest
from openai.types import completion_create_params as cp
from openai.types.chat import completion_create_params as ccp

from servescope.server.unsupported import NEUTRAL, UNSUPPORTED

from .conftest import API_KEY, MODEL

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}

# field -> (a value a client would send, extra fields it needs, "ok" | "reject")
COMPLETION_FIELDS = {
    "best_of": (2, {}, "reject"), "echo": (True, {}, "ok"), "frequency_penalty": (0.5, {}, "ok"),
    "logit_bias": ({"50": 5}, {}, "ok"), "logprobs": (2, {}, "ok"), "max_tokens": (2, {}, "ok"),
    "model": (MODEL, {}, "ok"), "n": (2, {}, "ok"), "presence_penalty": (0.5, {}, "ok"), "prompt": ("Hi", {}, "ok"),
    "seed": (7, {}, "ok"), "stop": (["\n"], {}, "ok"), "stream": (True, {}, "ok"),
    "stream_options": ({"include_usage": True}, {"stream": True}, "ok"), "suffix": ("!", {}, "reject"),
    "temperature": (0.5, {}, "ok"), "top_p": (0.9, {}, "ok"), "user": ("u-1", {}, "ok"),
}
CHAT_FIELDS = {
    "audio": ({"voice": "alloy", "format": "wav"}, {}, "reject"),
    "frequency_penalty": (0.5, {}, "ok"), "function_call": ("auto", {}, "reject"),
    "functions": ([{"name": "f", "parameters": {}}], {}, "reject"), "logit_bias": ({"50": 5}, {}, "ok"),
    "logprobs": (True, {}, "ok"), "max_completion_tokens": (2, {}, "ok"), "max_tokens": (2, {}, "ok"),
    "messages": ([{"role": "user", "content": "Hi"}], {}, "ok"), "metadata": ({"k": "v"}, {}, "reject"),
    "modalities": (["text", "audio"], {}, "reject"), "model": (MODEL, {}, "ok"),
    "moderation": ({"type": "auto"}, {}, "reject"), "n": (2, {}, "ok"),
    "parallel_tool_calls": (False, {"tools": [WEATHER]}, "ok"),
    "prediction": ({"type": "content", "content": "Hello"}, {}, "reject"), "presence_penalty": (0.5, {}, "ok"),
    "prompt_cache_key": ("user-7", {}, "ok"), "prompt_cache_options": ({"mode": "x"}, {}, "reject"),
    "prompt_cache_retention": ("24h", {}, "reject"), "reasoning_effort": ("low", {}, "ok"),
    "response_format": ({"type": "json_object"}, {}, "ok"), "safety_identifier": ("s-1", {}, "ok"),
    "seed": (7, {}, "ok"), "service_tier": ("flex", {}, "reject"), "stop": (["\n"], {}, "ok"),
    "store": (True, {}, "reject"), "stream": (True, {}, "ok"),
    "stream_options": ({"include_usage": True}, {"stream": True}, "ok"), "temperature": (0.5, {}, "ok"),
    "tool_choice": ("required", {"tools": [WEATHER]}, "ok"), "tools": ([WEATHER], {}, "ok"),
    "top_logprobs": (2, {"logprobs": True}, "ok"), "top_p": (0.9, {}, "ok"), "user": ("u-1", {}, "ok"),
    "verbosity": ("low", {}, "reject"), "web_search_options": ({}, {}, "reject"),
}


def _sdk_fields(*typed_dicts) -> set:
    out = set()
    for td in typed_dicts:
        out |= set(typing.get_type_hints(td))
    return out


SDK = {"/v1/completions": (_sdk_fields(cp.CompletionCreateParamsNonStreaming, cp.CompletionCreateParamsStreaming),
                           COMPLETION_FIELDS, {"prompt": "Hi"}),
       "/v1/chat/completions": (_sdk_fields(ccp.CompletionCreateParamsNonStreaming,
                                            ccp.CompletionCreateParamsStreaming),
                                CHAT_FIELDS, {"messages": [{"role": "user", "content": "Hi"}]})}


@pytest.mark.parametrize("path", list(SDK))
def test_every_sdk_field_has_a_decision(path):
    fields, table, _ = SDK[path]
    assert fields - set(table) == set(), "new SDK fields: give them a sample value and a decision"
    for name, (_, _, verdict) in table.items():
        if verdict == "reject":
            assert name in UNSUPPORTED, name  # and the reason is written there


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.mark.parametrize("path", list(SDK))
def test_every_sdk_field_is_answered_or_rejected_by_name(http, path, async_engine):
    fields, table, base = SDK[path]
    for name in sorted(fields):
        value, needs, verdict = table[name]
        body = {**base, "max_tokens": 2, "temperature": 0, **needs, name: value}
        r = http.post(path, json=body)
        if verdict == "ok":
            assert r.status_code == 200, (name, r.text)
        else:
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == name, r.json()
        neutral = NEUTRAL.get(name, ())
        if verdict == "reject" and neutral:  # the value that changes nothing is accepted
            r = http.post(path, json={**base, "max_tokens": 2, name: neutral[-1]})
            assert r.status_code == 200, (name, r.text)
    assert async_engine.num_inflight == 0
