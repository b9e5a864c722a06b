"""Raw HTTP: every client mistake is a 4xx with {"error": {message, type, param, code}} naming the
field, and a valid request succeeds right after."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import API_KEY, MAX_BODY, MODEL

CHAT = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "hello " * 9000  # > 8192 tokens, the model's context

C, CH = "/v1/completions", "/v1/chat/completions"

# (endpoint, body (dict, or str sent as is), status, param)
CASES = {
    "prompt_longer_than_context": (C, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    "max_tokens_zero": (C, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens_beyond_context": (C, {"prompt": "Hi", "max_tokens": 8192}, 400, "max_tokens"),
    "max_tokens_far_beyond_context": (C, {"prompt": "Hi", "max_tokens": 10**12}, 400, "max_tokens"),
    "chat_max_completion_tokens_beyond": (CH, {"messages": CHAT, "max_completion_tokens": 9000}, 400,
                                          "max_completion_tokens"),
    "temperature_negative": (C, {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    "top_p_above_one": (C, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    "chat_top_p_above_one": (CH, {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    "n_zero": (C, {"prompt": "Hi", "n": 0}, 400, "n"),
    "n_above_cap": (C, {"prompt": "Hi", "n": 9}, 400, "n"),
    "chat_n_above_cap": (CH, {"messages": CHAT, "n": 100}, 400, "n"),
    "logprobs_above_20": (C, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    "top_logprobs_above_20": (CH, {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    "malformed_json": (C, '{"prompt": "Hi", ', 400, None),
    "json_array_body": (C, '[{"prompt": "Hi"}]', 400, None),
    "json_string_body": (C, '"Hi"', 400, None),
    "max_tokens_string": (C, {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens"),
    "temperature_string": (C, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    "stream_string": (C, {"prompt": "Hi", "stream": "yes"}, 400, "stream"),
    "prompt_number": (C, {"prompt": 5}, 400, "prompt"),
    "prompt_booleans": (C, {"prompt": [True, False]}, 400, "prompt"),
    "messages_not_list": (CH, {"messages": "Hi"}, 400, "messages"),
    "nan_temperature": (C, '{"prompt": "Hi", "temperature": NaN}', 400, "temperature"),
    "missing_prompt": (C, {"max_tokens": 2}, 400, "prompt"),
    "unknown_model": (C, {"model": "gpt-17", "prompt": "Hi"}, 404, "model"),
    "chat_unknown_model": (CH, {"model": "gpt-17", "messages": CHAT}, 404, "model"),
    "empty_prompt": (C, {"prompt": ""}, 400, "prompt"),
    "empty_prompt_list": (C, {"prompt": []}, 400, "prompt"),
    "empty_token_list": (C, {"prompt": [[]]}, 400, "prompt"),
    "empty_string_in_list": (C, {"prompt": ["Hi", ""]}, 400, "prompt"),
    "empty_messages": (CH, {"messages": []}, 400, "messages"),
    "unknown_role": (CH, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role"),
    "null_content": (CH, {"messages": [{"role": "user", "content": None}]}, 400, "messages"),
    "token_id_outside_vocab": (C, {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    "negative_token_id": (C, {"prompt": [[1, -5]]}, 400, "prompt"),
    "empty_stop_string": (C, {"prompt": "Hi", "stop": [""]}, 400, "stop"),
    "min_tokens_above_max": (C, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    "presence_penalty_range": (C, {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty"),
    "seed_too_large": (C, {"prompt": "Hi", "seed": 2**70}, 400, "seed"),
    "unknown_field": (C, {"prompt": "Hi", "best_of_n": 3}, 400, "best_of_n"),
    "unsupported_suffix": (C, {"prompt": "Hi", "suffix": "!"}, 400, "suffix"),
    "chat_unsupported_audio": (CH, {"messages": CHAT, "audio": {"voice": "alloy", "format": "mp3"}}, 400, "audio"),
    "prompt_logprobs_above_20": (C, {"prompt": "Hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    "echo_logprobs_above_20": (C, {"prompt": "Hi", "echo": True, "logprobs": 21, "max_tokens": 0}, 400, "logprobs"),
    "invalid_json_schema": (CH, {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    "regex_does_not_parse": (C, {"prompt": "Hi", "structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs"),
    "regex_matches_nothing": (C, {"prompt": "Hi", "structured_outputs": {"regex": "a[^\\s\\S]b"}}, 400,
                              "structured_outputs"),
    "grammar_does_not_parse": (C, {"prompt": "Hi", "structured_outputs": {"grammar": "root ::= "}}, 400,
                               "structured_outputs"),
    "two_constraints": (C, {"prompt": "Hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
                        "structured_outputs"),
}


def assert_error(r: httpx.Response, status: int, param):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] == param, err


def assert_valid_request_works(http: httpx.Client):
    r = http.post(C, json={"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(http, name):
    path, body, status, param = CASES[name]
    if isinstance(body, str):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert_error(r, status, param)
    assert_valid_request_works(http)


@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_streaming_is_a_plain_400(http, stream):
    r = http.post(CH, json={"messages": CHAT, "temperature": -1, "stream": stream})
    assert_error(r, 400, "temperature")


def test_body_over_limit_content_length(http):
    body = json.dumps({"prompt": "x" * (MAX_BODY + 10)})
    r = http.post(C, content=body, headers={"content-type": "application/json"})
    assert_error(r, 413, None)
    assert_valid_request_works(http)


def test_body_over_limit_chunked(http):
    """No Content-Length (chunked transfer): the bytes received are counted."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'

    r = http.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, None)
    assert_valid_request_works(http)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_required(server, http, headers):
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        r = anon.post(C, json={"prompt": "Hi", "max_tokens": 1}, headers=headers)
        assert_error(r, 401, None)
        assert_error(anon.get("/v1/models", headers=headers), 401, None)
        assert anon.get("/health").status_code == 200  # health and metrics are open
    assert_valid_request_works(http)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404, None)
    assert_error(http.get(C), 405, None)
    assert_error(http.get("/v1/internals?n=-1"), 400, "n")
    assert_error(http.get("/v1/internals?n=abc"), 400, "n")
