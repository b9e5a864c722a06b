"""POST /v1/chat/completions: messages -> the model's (sandboxed) chat template -> n choices."""

from __future__ import annotations

from starlette.requests import Request

from servescope.errors import InvalidParameterError
from servescope.server.protocol import MAX_LOGPROBS, ChatCompletionRequest
from servescope.server.serving_common import (ServingContext, SSEResponse, StreamFrame, check_finish, check_model,
                                              finite, merge_streams, new_id, run_until_disconnect,
                                              sampling_params, start_streams, vllm_prompt_logprobs)
from servescope.server.serving_structured import compile_structure, requested_structure
from servescope.server.request_checks import check_request, render_options
from servescope.server.tool_calls import ToolPlan, ToolStreamer
from servescope.server.unsupported import check_fields


def _logprob_content(ctx: ServingContext, entries: list, top_n: int) -> list:
    tt = ctx.token_text
    content = []
    for e in entries:
        content.append({
            "token": tt.text(e.token_id), "logprob": finite(e.logprob), "bytes": tt.bytes(e.token_id),
            "top_logprobs": [{"token": tt.text(tid), "logprob": finite(lp), "bytes": tt.bytes(tid)}
                             for tid, lp in e.top[:top_n]]})
    return content


def _structure(req, tools: ToolPlan) -> tuple:
    structure, sparam = requested_structure(req)
    tool_structure = tools.constraint()
    if tool_structure is not None:
        if structure is not None:
            raise InvalidParameterError(sparam, f"{sparam} cannot be combined with tool_choice {tools.mode}")
        return tool_structure, "tool_choice"
    return structure, sparam


def _messages(req) -> list:
    """The conversation as plain dicts; OpenAI's `developer` role is a system message here."""
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True, exclude={"annotations"})  # an empty list: nothing to render
        if d["role"] == "developer":
            d["role"] = "system"
        out.append(d)
    return out


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request):
    check_model(ctx, req.model)
    check_fields(req)
    check_request(ctx, req)
    top_n = None
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError("top_logprobs", f"top_logprobs must be between 0 and {MAX_LOGPROBS}, "
                                                        f"got {req.top_logprobs}")
        if not req.logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs needs logprobs: true")
    if req.logprobs:
        top_n = req.top_logprobs or 0
    tools = ToolPlan(req)
    structure, sparam = _structure(req, tools)
    if structure is not None:
        ctx.grammars.check_size(structure, sparam)
    mt_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # validate the cheap fields before rendering the template (max_tokens checked again below)
    kw = dict(logprobs=top_n, max_tokens_param=mt_param, prompt_logprobs=req.prompt_logprobs)
    sampling_params(ctx, req, max_tokens=max_tokens if max_tokens is not None else ctx.engine.max_model_len - 1, **kw)
    _, ids = await ctx.engine.render_chat(_messages(req), tools=tools.rendered, **render_options(ctx))
    if max_tokens is None:  # OpenAI: as many as the context allows
        max_tokens = max(1, ctx.engine.max_model_len - len(ids))
    params = sampling_params(ctx, req, max_tokens=max_tokens, **kw)
    params = params.replace(structured=await compile_structure(ctx, structure, sparam))
    streams = await start_streams(ctx, [ids], params, max_tokens_param=mt_param)
    rid, created, n = new_id("chatcmpl"), ctx.created, params.n
    usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": 0}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        frame = StreamFrame(ctx, rid, created, "chat.completion.chunk", usage, include_usage)
        gen = frame.wrap(_stream(ctx, streams, n, top_n, tools, frame))
        return SSEResponse(gen, on_close=lambda: [s.abort() for s in streams])

    async def collect():
        async for _, out in merge_streams(streams):
            if out.finished:
                return out

    out = await run_until_disconnect(request, collect())
    choices = []
    for o in out.outputs:
        lp = None
        if top_n is not None:
            lp = {"content": _logprob_content(ctx, o.logprobs or [], top_n), "refusal": None}
        content, calls = tools.parse(o.text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": o.index, "message": message, "logprobs": lp,
                        "finish_reason": tools.finish_reason(calls, check_finish(o, out.error))})
        usage["completion_tokens"] += len(o.token_ids)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    body = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
            "choices": choices, "usage": usage}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(ctx.token_text, out.prompt_logprobs)
    return body


async def _stream(ctx, streams, n, top_n, tools: ToolPlan, frame: StreamFrame):
    chunk, usage = frame.chunk, frame.usage
    streamers = [ToolStreamer(tools) for _ in range(n)]
    sent_lp = [0] * n
    done = [False] * n
    for i in range(n):  # the role first, as OpenAI does
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for _, out in merge_streams(streams):
        for o in out.outputs:
            i = o.index
            if done[i]:
                continue
            finish = check_finish(o, out.error)
            content, call_deltas = streamers[i].feed(o.text, finish is not None)
            new_lp = (o.logprobs or [])[sent_lp[i]:] if top_n is not None else []
            if not content and not call_deltas and not new_lp and finish is None:
                continue
            sent_lp[i] += len(new_lp)
            lp = {"content": _logprob_content(ctx, new_lp, top_n), "refusal": None} if top_n is not None else None
            if finish is not None:
                done[i] = True
                usage["completion_tokens"] += len(o.token_ids)
                finish = tools.finish_reason(call_deltas or streamers[i].named_id, finish)
            delta = {"content": content} if content or (finish is None and not call_deltas) else {}
            if call_deltas:
                delta["tool_calls"] = call_deltas
            yield chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}])
