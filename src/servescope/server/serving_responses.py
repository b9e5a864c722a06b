"""POST /v1/responses (OpenAI's Responses API), GET/DELETE /v1/responses/{id}: a thin translation
onto the chat engine path (protocol_responses.py turns the request into a chat request; chat_engine
queues it and parses reasoning, content and tool calls). Output items: a reasoning item (reasoning
parser on), the message, function_call items. Streamed, the events are OpenAI's (response.created,
response.in_progress, output_item.added, content_part.added, output_text.delta, ..., their done
events, response.completed), each with its sequence_number; the final response is the one the
items reassemble to. Stored responses (store, the default) live in a bounded in-memory store, so
previous_response_id continues a conversation; the oldest are dropped beyond MAX_STORED responses or
MAX_STORED_BYTES of their JSON.
"""

from __future__ import annotations

import collections
import json
import time

from fastapi import FastAPI
from pydantic import ValidationError
from starlette.requests import Request

from servescope.errors import InvalidParameterError
from servescope.server.chat_engine import final_sample, sse_response, start_chat
from servescope.server.errors import APIError, to_api_error, validation_param
from servescope.server.protocol import ChatCompletionRequest
from servescope.server.protocol_responses import (
    NEUTRAL,
    PARAM_NAMES,
    ResponsesRequest,
    chat_request_body,
)
from servescope.server.unsupported import check_fields
from servescope.server.responses_stream import ResponseBuilder, stream_events
from servescope.server.serving_common import ServingContext, new_id

MAX_STORED = 1024
MAX_STORED_BYTES = 64 * 2**20


class ResponseStore:
    """Responses by id with the conversation that led to them, bounded by count and by bytes (their
    JSON size): the oldest go first."""

    def __init__(self, capacity: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0

    def put(self, rid: str, response: dict, messages: list) -> None:
        self.delete(rid)
        size = len(json.dumps(response, default=str)) + len(json.dumps(messages, default=str))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept (previous_response_id will say so)
        self._items[rid] = (response, messages, size)
        self._bytes += size
        while len(self._items) > self.capacity or self._bytes > self.max_bytes:
            self._bytes -= self._items.popitem(last=False)[1][2]

    def get(self, rid: str):
        item = self._items.get(rid)
        return None if item is None else item[:2]

    def delete(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is not None:
            self._bytes -= item[2]
        return item is not None


def _chat_request(req: ResponsesRequest, store: ResponseStore) -> ChatCompletionRequest:
    history = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise APIError(
                404,
                f"previous response {req.previous_response_id!r} not found (not stored, or "
                "dropped from the bounded store)",
                param="previous_response_id",
                code="not_found",
            )
        history = prev[1]
    body = chat_request_body(req, history)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = validation_param(err.get("loc", ()))
        raise InvalidParameterError(
            _responses_param(param), f"{_responses_param(param)}: {err.get('msg')}"
        ) from None


def _responses_param(param):
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    head, bracket, idx = head.partition("[")
    return PARAM_NAMES.get(head, head) + bracket + idx + dot + rest


def _renamed(e: Exception) -> Exception:
    if isinstance(e, InvalidParameterError) and e.param:
        name = _responses_param(e.param)
        return InvalidParameterError(name, e.message.replace(e.param, name, 1))
    return e


def _output_messages(body: dict) -> list:
    """The assistant turn of a response as chat messages (for previous_response_id)."""
    content, calls, reasoning = "", [], None
    for item in body["output"]:
        if item["type"] == "message":
            content += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
        elif item["type"] == "reasoning":
            reasoning = "".join(p["text"] for p in item.get("content") or [])
    msg = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = reasoning
    return [msg]


async def create_response(ctx: ServingContext, req: ResponsesRequest, request: Request, store: ResponseStore):
    check_fields(req, NEUTRAL, {})
    chat = _chat_request(req, store)
    try:
        run = await start_chat(ctx, chat)
    except Exception as e:  # noqa: BLE001 - renamed to the Responses field, then answered
        raise _renamed(e) from None
    builder = ResponseBuilder(ctx, req, run, new_id("resp").replace("resp-", "resp_"), int(time.time()))

    def finish(body: dict) -> None:
        if req.store is not False:
            store.put(
                body["id"], body, chat.model_dump(exclude_none=True)["messages"] + _output_messages(body)
            )

    if req.stream:
        events = stream_events(builder, finish)
        return sse_response(_closing(events, run))
    out, o, p = await final_sample(run, request)
    body = builder.final(p, o, out.num_cached_tokens)
    finish(body)
    return body


async def _closing(events, run):
    try:
        async for e in events:
            yield e
    finally:
        run.abort()


def install_responses(app: FastAPI, ctx: ServingContext) -> None:
    store = app.state.responses_store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        try:
            return await create_response(ctx, body, request, store)
        except Exception as e:  # answered here: Starlette's catch-all would re-raise and drop the connection
            raise to_api_error(e) from None

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        item = store.get(response_id)
        if item is None:
            raise APIError(404, f"response {response_id!r} not found", param="response_id", code="not_found")
        return item[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise APIError(404, f"response {response_id!r} not found", param="response_id", code="not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


__all__ = ["install_responses", "ResponseStore"]
