"""POST /v1/completions: prompts -> choices indexed prompt_i * n + j, streamed or not."""

from __future__ import annotations

from typing import Optional

from starlette.requests import Request

from servescope.errors import InvalidParameterError
from servescope.server.errors import APIError
from servescope.server.protocol import CompletionRequest
from servescope.server.serving_common import (ServingContext, SSEResponse, StreamFrame, check_finish, check_model,
                                              finite, merge_streams, new_id, run_until_disconnect,
                                              sampling_params, start_streams, stream_frame,
                                              vllm_prompt_logprobs)
from servescope.server.request_checks import check_prompt_chars, check_request
from servescope.server.serving_structured import compile_structure, requested_structure
from servescope.server.unsupported import check_fields
from servescope.server.vllm_fields import (check_vllm_fields, logit_controls, response_id, truncate_prompt,
                                           with_token_ids)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


async def _prompt_ids(ctx: ServingContext, prompt, add_special_tokens: bool = True) -> tuple:
    """(list of token id lists, list of prompt texts) from any of the four prompt forms."""
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise InvalidParameterError("prompt", "the prompt is empty")
    elif isinstance(prompt[0], int):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if len(items) > ctx.limits.max_prompts:
        raise InvalidParameterError("prompt", f"at most {ctx.limits.max_prompts} prompts per request, "
                                              f"got {len(items)}")
    if ctx.max_queue is not None and len(items) > ctx.max_queue:
        raise InvalidParameterError("prompt", f"{len(items)} prompts is more than this server queues at once "
                                              f"({ctx.max_queue})")
    for p in items:
        if isinstance(p, str):
            check_prompt_chars(ctx, len(p), "prompt")
        elif len(p) > ctx.engine.max_model_len:
            raise InvalidParameterError("prompt", f"a prompt of {len(p)} tokens is longer than this model's "
                                                  f"context of {ctx.engine.max_model_len} tokens")
    ctx.engine.check_capacity(len(items), ctx.max_queue)
    ids, texts = [], []
    for p in items:
        if isinstance(p, str):
            if not p:
                raise InvalidParameterError("prompt", "the prompt is empty")
            ids.append(await ctx.engine.encode(p, add_special_tokens))
            texts.append(p)
        else:
            if not p:
                raise InvalidParameterError("prompt", "the prompt is empty (no tokens)")
            ids.append(list(p))
            texts.append(None)  # decoded only when echo needs it (after the engine checked the ids)
    return ids, texts


class _ChoiceState:
    """What one choice has sent so far (streaming) and its text offset (logprobs). With echoed
    prompt logprobs the offsets count the prompt's token texts from 0; otherwise they start after
    the echoed prompt (or at 0)."""

    def __init__(self, ctx: ServingContext, prompt_ids: list, prefix: str, echo_logprobs: bool):
        self.sent_text = ""
        self.sent_logprobs = 0
        self.offset = 0 if echo_logprobs else len(prefix)
        self.first_token_text = ctx.token_text.text(prompt_ids[0])
        self.finished = False
        self.echoed = False


def _logprobs_block(ctx: ServingContext, entries: list, state: _ChoiceState) -> dict:
    """OpenAI completions logprobs for `entries` (TokenLogprobs; None for the first echoed prompt
    token, which has no logprob), continuing state's text offset."""
    tt = ctx.token_text
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for e in entries:
        s = tt.text(e.token_id) if e is not None else state.first_token_text
        tokens.append(s)
        offsets.append(state.offset)
        state.offset += len(s)
        if e is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(finite(e.logprob))
        top = {tt.text(tid): finite(lp) for tid, lp in e.top}
        top.setdefault(s, finite(e.logprob))  # the sampled token is always listed (vLLM does too)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


class _Plan:
    """How one completions request maps onto the engine: echo, prompt logprobs, max_tokens 0."""

    def __init__(self, req: CompletionRequest):
        if req.max_tokens == 0 and not req.echo:
            raise InvalidParameterError("max_tokens", "max_tokens 0 needs echo (it returns the prompt only)")
        self.echo = bool(req.echo)
        self.logprobs = req.logprobs
        self.no_output = req.max_tokens == 0  # the engine samples one token (logits it computes anyway); dropped
        # echo with logprobs scores the prompt's tokens too (lm-eval's loglikelihood requests)
        self.echo_logprobs = self.echo and req.logprobs is not None
        self.prompt_logprobs = req.prompt_logprobs
        wanted = [x for x in (req.prompt_logprobs, req.logprobs if self.echo_logprobs else None) if x is not None]
        self.engine_prompt_logprobs = max(wanted) if wanted else None  # the engine computes the larger top-k
        self.max_tokens = 1 if self.no_output else (DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens)

    def output(self, o) -> tuple:
        """(text, token count, logprobs entries) of one sample as the client sees it."""
        if self.no_output:
            return "", 0, []
        return o.text, len(o.token_ids), o.logprobs or []


def _choice(ctx, plan: _Plan, idx: int, out, o, text_prefix: str, state: _ChoiceState) -> dict:
    text, _, gen_lp = plan.output(o)
    lp = None
    if plan.logprobs is not None:
        prompt_lp = (_top_limited(out.prompt_logprobs, plan.logprobs) or []) if plan.echo_logprobs else []
        lp = _logprobs_block(ctx, prompt_lp + list(gen_lp), state)
    choice = {"index": idx, "text": text_prefix + text, "logprobs": lp, "finish_reason": check_finish(o, out.error)}
    if plan.prompt_logprobs is not None:
        choice["prompt_logprobs"] = _vllm_prompt_logprobs(ctx, plan, out)
    return choice


def _top_limited(entries: Optional[list], k: int) -> Optional[list]:
    if entries is None:
        return None
    return [e if e is None or len(e.top) <= k else e.__class__(e.token_id, e.logprob, e.rank, e.top[:k])
            for e in entries]


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request):
    check_model(ctx, req.model)
    check_fields(req)
    check_vllm_fields(req)
    check_request(ctx, req)
    ctx = with_token_ids(ctx, req)
    plan = _Plan(req)
    structure, sparam = requested_structure(req)
    if structure is not None:
        ctx.grammars.check_size(structure, sparam)
    extra = dict(logit_controls(ctx.engine.tokenizer, ctx.engine.vocab_size, req), cache_salt=req.cache_salt)
    params = sampling_params(ctx, req, max_tokens=plan.max_tokens, logprobs=req.logprobs,
                             prompt_logprobs=plan.engine_prompt_logprobs, extra=extra)
    ids, texts = await _prompt_ids(ctx, req.prompt, req.add_special_tokens is not False)
    if req.truncate_prompt_tokens is not None:
        ids = [truncate_prompt(i, req.truncate_prompt_tokens, ctx.engine.max_model_len) for i in ids]
        texts = [None] * len(ids)  # echo shows the prompt the model saw
    params = params.replace(structured=await compile_structure(ctx, structure, sparam))
    streams = await start_streams(ctx, ids, params, priority=req.priority or 0)
    if plan.echo:
        tok = ctx.engine.tokenizer
        texts = [t if t is not None else (tok.decode(i, skip_special_tokens=False) if tok else "")
                 for t, i in zip(texts, ids)]
    n = params.n
    rid, created = response_id("cmpl", req, new_id("cmpl")), ctx.created
    states = {pi * n + j: _ChoiceState(ctx, ids[pi], texts[pi] if plan.echo else "", plan.echo_logprobs)
              for pi in range(len(ids)) for j in range(n)}
    usage = {"prompt_tokens": sum(len(i) for i in ids), "completion_tokens": 0, "total_tokens": 0}
    if req.stream:
        frame = stream_frame(ctx, rid, "text_completion", usage, req)
        gen = frame.wrap(_stream(ctx, streams, plan, n, texts, states, frame))
        return SSEResponse(gen, on_close=lambda: [s.abort() for s in streams])
    finals = await run_until_disconnect(request, _collect(streams))
    choices = []
    for pi, out in sorted(finals.items()):
        for o in out.outputs:
            idx = pi * n + o.index
            choices.append(_choice(ctx, plan, idx, out, o, texts[pi] if plan.echo else "", states[idx]))
            usage["completion_tokens"] += plan.output(o)[1]
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


async def _stream(ctx, streams, plan: _Plan, n, texts, states, frame: StreamFrame):
    chunk, usage = frame.chunk, frame.usage
    async for pi, out in merge_streams(streams):
        for o in out.outputs:
            idx = pi * n + o.index
            st = states[idx]
            if st.finished:
                continue
            frame.tokens_so_far[idx] = len(o.token_ids)
            if not st.echoed and (plan.echo or plan.prompt_logprobs is not None):
                st.echoed = True  # the prompt (and its logprobs) first, as its own chunk
                yield chunk([_prompt_chunk(ctx, plan, idx, out, texts[pi] if plan.echo else "", st)])
            finish = check_finish(o, out.error)
            text, ntok, gen_lp = plan.output(o)
            delta = text[len(st.sent_text):] if text.startswith(st.sent_text) else ""
            new_lp = list(gen_lp)[st.sent_logprobs:] if plan.logprobs is not None else []
            if not delta and not new_lp and finish is None:
                continue
            if delta:
                st.sent_text = text
            st.sent_logprobs += len(new_lp)
            lp = _logprobs_block(ctx, new_lp, st) if plan.logprobs is not None else None
            if finish is not None:
                st.finished = True
                usage["completion_tokens"] += ntok
            yield chunk([{"index": idx, "text": delta, "logprobs": lp, "finish_reason": finish}])


def _prompt_chunk(ctx, plan: _Plan, idx: int, out, text: str, st: _ChoiceState) -> dict:
    lp = None
    if plan.echo_logprobs:
        lp = _logprobs_block(ctx, _top_limited(out.prompt_logprobs, plan.logprobs) or [], st)
    c = {"index": idx, "text": text, "logprobs": lp, "finish_reason": None}
    if plan.prompt_logprobs is not None:
        c["prompt_logprobs"] = _vllm_prompt_logprobs(ctx, plan, out)
    return c


def _vllm_prompt_logprobs(ctx, plan: _Plan, out):
    return vllm_prompt_logprobs(ctx.token_text, _top_limited(out.prompt_logprobs, plan.prompt_logprobs))


__all__ = ["create_completion", "APIError"]
