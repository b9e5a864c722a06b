"""POST /v1/completions: prompts -> choices indexed prompt_i * n + j, streamed or not."""

from __future__ import annotations

from typing import Optional

from starlette.requests import Request

from servescope.errors import InvalidParameterError
from servescope.server.errors import APIError, error_body, to_api_error
from servescope.server.protocol import CompletionRequest
from servescope.server.serving_common import (SSE_DONE, ServingContext, SSEResponse, check_finish, check_model,
                                              finite, merge_streams, new_id, run_until_disconnect,
                                              sampling_params, sse, start_streams)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_PROMPTS = 256


async def _prompt_ids(ctx: ServingContext, prompt) -> tuple:
    """(list of token id lists, list of prompt texts) from any of the four prompt forms."""
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise InvalidParameterError("prompt", "the prompt is empty")
    elif isinstance(prompt[0], int):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if len(items) > MAX_PROMPTS:
        raise InvalidParameterError("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(items)}")
    if ctx.max_queue is not None and len(items) > ctx.max_queue:
        raise InvalidParameterError("prompt", f"{len(items)} prompts is more than this server queues at once "
                                              f"({ctx.max_queue})")
    ids, texts = [], []
    for p in items:
        if isinstance(p, str):
            if not p:
                raise InvalidParameterError("prompt", "the prompt is empty")
            ids.append(await ctx.engine.encode(p))
            texts.append(p)
        else:
            if not p:
                raise InvalidParameterError("prompt", "the prompt is empty (no tokens)")
            ids.append(list(p))
            texts.append(None)  # decoded only when echo needs it (after the engine checked the ids)
    return ids, texts


class _ChoiceState:
    """What one choice has sent so far (streaming) or its offsets (logprobs)."""

    def __init__(self, prefix: str = ""):
        self.sent_text = ""
        self.sent_logprobs = 0
        self.offset = len(prefix)
        self.finished = False


def _logprobs_block(ctx: ServingContext, entries: list, state: _ChoiceState) -> dict:
    """OpenAI completions logprobs for `entries` (TokenLogprobs), continuing state's text offset."""
    tt = ctx.token_text
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for e in entries:
        s = tt.text(e.token_id)
        tokens.append(s)
        token_logprobs.append(finite(e.logprob))
        top = {tt.text(tid): finite(lp) for tid, lp in e.top}
        top.setdefault(s, finite(e.logprob))  # the sampled token is always listed (vLLM does too)
        top_logprobs.append(top)
        offsets.append(state.offset)
        state.offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request):
    check_model(ctx, req.model)
    if req.echo and req.logprobs is not None:
        raise InvalidParameterError("echo", "echo together with logprobs is not supported (no prompt logprobs)")
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = sampling_params(ctx, req, max_tokens=max_tokens, logprobs=req.logprobs)
    ids, texts = await _prompt_ids(ctx, req.prompt)
    streams = await start_streams(ctx, ids, params)
    if req.echo:
        tok = ctx.engine.tokenizer
        texts = [t if t is not None else (tok.decode(i, skip_special_tokens=False) if tok else "")
                 for t, i in zip(texts, ids)]
    n = params.n
    rid, created = new_id("cmpl"), ctx.created
    states = {pi * n + j: _ChoiceState(texts[pi] if req.echo else "") for pi in range(len(ids)) for j in range(n)}
    usage = {"prompt_tokens": sum(len(i) for i in ids), "completion_tokens": 0, "total_tokens": 0}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        gen = _stream(ctx, streams, req, n, rid, created, texts, states, usage, include_usage)
        return SSEResponse(gen, on_close=lambda: [s.abort() for s in streams])
    finals = await run_until_disconnect(request, _collect(streams))
    choices = []
    for pi, out in sorted(finals.items()):
        for o in out.outputs:
            idx = pi * n + o.index
            st = states[idx]
            text = (texts[pi] + o.text) if req.echo else o.text
            lp = _logprobs_block(ctx, o.logprobs, st) if req.logprobs is not None and o.logprobs is not None else None
            choices.append({"index": idx, "text": text, "logprobs": lp,
                            "finish_reason": check_finish(o, out.error)})
            usage["completion_tokens"] += len(o.token_ids)
    choices.sort(key=lambda c: c["index"])
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
            "choices": choices, "usage": usage}


async def _collect(streams: list) -> dict:
    finals = {}
    async for pi, out in merge_streams(streams):
        if out.finished:
            finals[pi] = out
    return finals


async def _stream(ctx, streams, req, n, rid, created, texts, states, usage, include_usage):
    def chunk(choices, with_usage: Optional[dict] = None) -> str:
        obj = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
               "choices": choices}
        if include_usage:
            obj["usage"] = with_usage
        return sse(obj)

    try:
        if req.echo:  # the prompt text comes first, as its own chunk per choice
            yield chunk([{"index": i, "text": texts[i // n], "logprobs": None, "finish_reason": None}
                         for i in sorted(states)])
        async for pi, out in merge_streams(streams):
            for o in out.outputs:
                idx = pi * n + o.index
                st = states[idx]
                if st.finished:
                    continue
                finish = check_finish(o, out.error)
                delta = o.text[len(st.sent_text):] if o.text.startswith(st.sent_text) else ""
                new_lp = (o.logprobs or [])[st.sent_logprobs:] if req.logprobs is not None else []
                if not delta and not new_lp and finish is None:
                    continue
                if delta:
                    st.sent_text = o.text
                st.sent_logprobs += len(new_lp)
                lp = _logprobs_block(ctx, new_lp, st) if req.logprobs is not None else None
                if finish is not None:
                    st.finished = True
                    usage["completion_tokens"] += len(o.token_ids)
                yield chunk([{"index": idx, "text": delta, "logprobs": lp, "finish_reason": finish}])
        if include_usage:
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield chunk([], with_usage=usage)
    except Exception as e:  # noqa: BLE001 - after the 200 went out, errors travel in the stream
        a = to_api_error(e)
        yield sse(error_body(a.status, a.message, a.param, a.code, a.type))
    yield SSE_DONE


__all__ = ["create_completion", "APIError"]
