"""POST /v1/chat/completions: messages -> the model's (sandboxed) chat template -> n choices.
The engine request path is chat_engine.py's (shared with /v1/responses and /v1/messages)."""

from __future__ import annotations

from starlette.requests import Request

from servescope.server.chat_engine import (
    ChatRun,
    SampleStreamer,
    collect_final,
    count_reasoning,
    parse_sample,
    start_chat,
)
from servescope.server.protocol import ChatCompletionRequest
from servescope.server.serving_common import (
    ServingContext,
    SSEResponse,
    StreamFrame,
    check_finish,
    finite,
    merge_streams,
    new_id,
    stream_frame,
    vllm_prompt_logprobs,
)
from servescope.server.vllm_fields import response_id


def _logprob_content(ctx: ServingContext, entries: list, top_n: int) -> list:
    tt = ctx.token_text
    content = []
    for e in entries:
        content.append(
            {
                "token": tt.text(e.token_id),
                "logprob": finite(e.logprob),
                "bytes": tt.bytes(e.token_id),
                "top_logprobs": [
                    {"token": tt.text(tid), "logprob": finite(lp), "bytes": tt.bytes(tid)}
                    for tid, lp in e.top[:top_n]
                ],
            }
        )
    return content


def _usage(run: ChatRun, reasoning_tokens: int) -> dict:
    usage = run.usage
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if run.reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request):
    run = await start_chat(ctx, req)
    rid = response_id("chatcmpl", req, new_id("chatcmpl"))
    if req.stream:
        frame = stream_frame(run.ctx, rid, "chat.completion.chunk", run.usage, req)
        return SSEResponse(frame.wrap(_stream(run, frame)), on_close=run.abort)
    out = await collect_final(run, request)
    choices, reasoning_tokens = [], 0
    for o in out.outputs:
        lp = None
        if run.top_n is not None:
            lp = {"content": _logprob_content(run.ctx, o.logprobs or [], run.top_n), "refusal": None}
        p = parse_sample(run, o, check_finish(o, out.error))
        message = {"role": run.role, "content": p.content}
        if p.reasoning is not None:
            message["reasoning_content"] = p.reasoning
        if p.calls:
            message["tool_calls"] = p.calls
        choices.append(
            {
                "index": o.index,
                "message": message,
                "logprobs": lp,
                "finish_reason": p.finish_reason,
                "stop_reason": o.stop_reason,
            }
        )
        run.usage["completion_tokens"] += len(o.token_ids)
        reasoning_tokens += p.reasoning_tokens
    count_reasoning(run, reasoning_tokens)
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": _usage(run, reasoning_tokens),
    }
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(run.ctx.token_text, out.prompt_logprobs)
    return body


async def _stream(run: ChatRun, frame: StreamFrame):
    chunk, n = frame.chunk, run.params.n
    streamers = [SampleStreamer(run) for _ in range(n)]
    sent_lp = [0] * n
    done = [False] * n
    reasoning_tokens = 0
    for i in range(n):  # the role first, as OpenAI does; vLLM's echo next
        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": run.role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        if run.echo:
            yield chunk(
                [{"index": i, "delta": {"content": run.echo}, "logprobs": None, "finish_reason": None}]
            )
    async for _, out in merge_streams(run.streams):
        for o in out.outputs:
            i = o.index
            if done[i]:
                continue
            frame.tokens_so_far[i] = len(o.token_ids)
            finish = check_finish(o, out.error)
            reasoning, content, call_deltas = streamers[i].feed(o.text, finish is not None)
            new_lp = (o.logprobs or [])[sent_lp[i] :] if run.top_n is not None else []
            if not reasoning and not content and not call_deltas and not new_lp and finish is None:
                continue
            sent_lp[i] += len(new_lp)
            lp = None
            if run.top_n is not None:
                lp = {"content": _logprob_content(run.ctx, new_lp, run.top_n), "refusal": None}
            if finish is not None:
                done[i] = True
                run.usage["completion_tokens"] += len(o.token_ids)
                finish = run.tools.finish_reason(call_deltas or streamers[i].named_call, finish)
                if run.reasoning is not None:
                    reasoning_tokens += run.reasoning.count_tokens(o.text, o.token_ids)
            delta = (
                {"content": content}
                if content or (finish is None and not call_deltas and not reasoning)
                else {}
            )
            if reasoning:
                delta["reasoning_content"] = reasoning
            if call_deltas:
                delta["tool_calls"] = call_deltas
            c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            if finish is not None:
                c["stop_reason"] = o.stop_reason
            yield chunk([c])
    count_reasoning(run, reasoning_tokens)
    _usage(run, reasoning_tokens)
