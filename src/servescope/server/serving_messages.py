"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): a thin translation
onto the chat engine path (protocol_messages.py builds the chat request; chat_engine queues it and
parses reasoning, content and tool calls). Content blocks out: thinking (reasoning parser on), text,
tool_use. Streamed, Anthropic's events: message_start, ping, content_block_start / _delta / _stop
per block, message_delta (stop_reason, usage), message_stop. Every error, before or inside a
stream, is Anthropic's {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
import uuid

from fastapi import FastAPI
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from servescope.errors import InvalidParameterError
from servescope.server.chat_engine import (
    ChatRun,
    SampleStreamer,
    chat_messages,
    count_reasoning,
    final_sample,
    sse_response,
    start_chat,
    template_kwargs,
)
from servescope.server.errors import anthropic_error_body, to_api_error, validation_param
from servescope.server.protocol import ChatCompletionRequest
from servescope.server.protocol_messages import NEUTRAL, PARAM_NAMES, MessagesRequest, chat_request_body
from servescope.server.serving_common import ServingContext, check_finish, check_model, merge_streams
from servescope.server.tool_calls import ToolPlan
from servescope.server.unsupported import check_fields


def _renamed(e: Exception) -> Exception:
    if isinstance(e, InvalidParameterError) and e.param in PARAM_NAMES:
        name = PARAM_NAMES[e.param]
        return InvalidParameterError(name, e.message.replace(e.param, name, 1))
    return e


def _parse(raw: bytes, model=MessagesRequest):
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            raise InvalidParameterError(None, "the request body is not valid JSON") from None
        param = validation_param(err.get("loc", ()))
        raise InvalidParameterError(
            param, f"{param}: {err.get('msg')}" if param else err.get("msg")
        ) from None


def _chat_request(ctx: ServingContext, req: MessagesRequest) -> ChatCompletionRequest:
    check_fields(req, NEUTRAL, {})
    try:
        return ChatCompletionRequest.model_validate(chat_request_body(req, ctx.reasoning is not None))
    except ValidationError as e:
        err = e.errors()[0]
        param = validation_param(err.get("loc", ()))
        raise _renamed(InvalidParameterError(param, f"{param}: {err.get('msg')}")) from None


def _stop_reason(run: ChatRun, o, calls: list) -> tuple:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if calls and run.tools.mode != "named":
        return "tool_use", None
    if o.finish_reason == "length":
        return "max_tokens", None
    if isinstance(o.stop_reason, str) and o.stop_reason in (run.req.stop or []):
        return "stop_sequence", o.stop_reason
    return ("tool_use" if calls else "end_turn"), None


def _tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:  # a named call cut off by max_tokens: what the model wrote
        return {"type": "text", "text": call["function"]["arguments"]}
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": args,
    }


def _usage(run: ChatRun, out, output_tokens: int) -> dict:
    return {
        "input_tokens": len(run.prompt_ids),
        "output_tokens": output_tokens,
        "cache_read_input_tokens": out.num_cached_tokens if out is not None else 0,
        "cache_creation_input_tokens": 0,
    }


async def create_message(ctx: ServingContext, req: MessagesRequest, request: Request):
    if req.max_tokens is None:
        raise InvalidParameterError("max_tokens", "max_tokens: field required")
    chat = _chat_request(ctx, req)
    try:
        run = await start_chat(ctx, chat)
    except Exception as e:  # noqa: BLE001 - renamed to the Messages field, then answered
        raise _renamed(e) from None
    mid = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return sse_response(_stream(ctx, run, mid))
    out, o, p = await final_sample(run, request)
    content = []
    if p.reasoning is not None:
        content.append({"type": "thinking", "thinking": p.reasoning, "signature": ""})
    if p.content:
        content.append({"type": "text", "text": p.content})
    content += [_tool_use(c) for c in p.calls]
    stop_reason, stop_sequence = _stop_reason(run, o, p.calls)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": ctx.model_name,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(run, out, len(o.token_ids)),
    }


def _event(kind: str, data: dict) -> str:
    payload = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n"


class _Blocks:
    """The open content block and the events that open, grow and close blocks."""

    def __init__(self):
        self.index, self.kind, self.call_id = -1, None, None

    def grow(self, kind: str, delta: str, start: dict, call_id=None) -> list:
        evs = []
        if kind != self.kind or call_id != self.call_id:
            evs = self.close()
            self.index, self.kind, self.call_id = self.index + 1, kind, call_id
            evs.append(_event("content_block_start", {"index": self.index, "content_block": start}))
        if delta:
            key = {
                "text": ("text_delta", "text"),
                "thinking": ("thinking_delta", "thinking"),
                "tool_use": ("input_json_delta", "partial_json"),
            }[kind]
            evs.append(
                _event("content_block_delta", {"index": self.index, "delta": {"type": key[0], key[1]: delta}})
            )
        return evs

    def close(self) -> list:
        if self.kind is None:
            return []
        evs = []
        if self.kind == "thinking":
            evs.append(
                _event(
                    "content_block_delta",
                    {"index": self.index, "delta": {"type": "signature_delta", "signature": ""}},
                )
            )
        evs.append(_event("content_block_stop", {"index": self.index}))
        self.kind = None
        return evs


def _call_events(blocks: _Blocks, deltas: list) -> list:
    evs = []
    for d in deltas:
        if "id" in d:
            blocks.call_id = None  # a new call opens a new block
            start = {
                "type": "tool_use",
                "id": "toolu_" + d["id"].removeprefix("call_"),
                "name": d["function"]["name"],
                "input": {},
            }
            evs += blocks.grow("tool_use", "", start, call_id=d["id"])
        args = d.get("function", {}).get("arguments", "")
        if args:
            evs += blocks.grow("tool_use", args, {}, call_id=blocks.call_id)
    return evs


async def _stream(ctx: ServingContext, run: ChatRun, mid: str):
    start = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": ctx.model_name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(run, None, 0),
    }
    yield _event("message_start", {"message": start})
    yield _event("ping", {})
    blocks, streamer, any_call = _Blocks(), SampleStreamer(run), False
    try:
        async for _, out in merge_streams(run.streams):
            o = out.outputs[0]
            reason = check_finish(o, out.error)
            dr, dc, calls = streamer.feed(o.text, reason is not None)
            evs = (
                blocks.grow("thinking", dr, {"type": "thinking", "thinking": "", "signature": ""})
                if dr
                else []
            )
            evs += blocks.grow("text", dc, {"type": "text", "text": ""}) if dc else []
            evs += _call_events(blocks, calls)
            any_call = any_call or bool(calls)
            for e in evs:
                yield e
            if reason is None:
                continue
            for e in blocks.close():
                yield e
            n_reasoning = run.reasoning.count_tokens(o.text, o.token_ids) if run.reasoning is not None else 0
            count_reasoning(run, n_reasoning)
            stop_reason, stop_sequence = _stop_reason(run, o, [None] if any_call else [])
            yield _event(
                "message_delta",
                {
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": len(o.token_ids)},
                },
            )
            yield _event("message_stop", {})
            return
    except Exception as e:  # noqa: BLE001 - after the 200 went out, errors travel in the stream
        a = to_api_error(e)
        yield _event("error", {"error": anthropic_error_body(a.status, a.message)["error"]})
    finally:
        run.abort()


async def count_tokens(ctx: ServingContext, req: MessagesRequest) -> dict:
    check_model(ctx, req.model)
    chat = _chat_request(ctx, req)
    _, ids = await ctx.engine.render_chat(
        chat_messages(chat),
        add_generation_prompt=chat.add_generation_prompt is not False,
        tools=ToolPlan(chat).rendered,
        **template_kwargs(chat),
    )
    return {"input_tokens": len(ids)}


def _error(e: Exception) -> JSONResponse:
    a = to_api_error(e)
    return JSONResponse(anthropic_error_body(a.status, a.message), status_code=a.status, headers=a.headers)


def install_messages(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            return await create_message(ctx, _parse(await request.body()), request)
        except Exception as e:  # every error in Anthropic's shape
            return _error(e)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request):
        try:
            return await count_tokens(ctx, _parse(await request.body()))
        except Exception as e:
            return _error(e)
