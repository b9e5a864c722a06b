"""The one engine request path of a conversation, shared by /v1/chat/completions, /v1/responses and
/v1/messages: a ChatCompletionRequest (the other two APIs translate theirs into one) -> checks,
the rendered prompt, SamplingParams with tools, structured outputs, stops and vLLM's controls ->
queued streams (start_chat); and the output side: one sample's text -> reasoning, content and tool
calls, whole (parse_sample) or as deltas (SampleStreamer). The APIs differ only in their shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from starlette.responses import StreamingResponse

from servescope.errors import InvalidParameterError
from servescope.server.protocol import MAX_LOGPROBS, ChatCompletionRequest
from servescope.server.serving_common import (
    ServingContext,
    check_finish,
    check_model,
    merge_streams,
    run_until_disconnect,
    sampling_params,
    start_streams,
)
from servescope.server.request_checks import check_request, render_options
from servescope.server.serving_structured import compile_structure, requested_structure
from servescope.server.tool_calls import ToolPlan, ToolStreamer
from servescope.server.unsupported import check_fields
from servescope.server.vllm_fields import check_vllm_fields, logit_controls, truncate_prompt, with_token_ids

RESERVED_TEMPLATE_KWARGS = (
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "chat_template",
    "continue_final_message",
)


@dataclass
class ChatRun:
    """A queued conversation: its streams and how to read their outputs."""

    ctx: ServingContext  # with "token_id:N" token strings when the request asked
    req: ChatCompletionRequest
    streams: list
    prompt_ids: list
    params: object
    tools: ToolPlan
    top_n: Optional[int]  # logprobs: alternatives per token (None: no logprobs)
    reasoning: Optional[object]  # ReasoningParser, None when off (or for constrained outputs)
    role: str  # the answer's role: assistant, or the last message's without a generation prompt
    echo: str = ""  # vLLM's chat echo: the last message's content, prepended to the answer
    usage: dict = field(default_factory=dict)

    def abort(self) -> None:
        for s in self.streams:
            s.abort()


@dataclass
class ParsedSample:
    reasoning: Optional[str]
    content: Optional[str]
    calls: list
    finish_reason: Optional[str]
    reasoning_tokens: int


def _top_n(req) -> Optional[int]:
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError(
                "top_logprobs", f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}"
            )
        if not req.logprobs and req.top_logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs needs logprobs: true")
    return (req.top_logprobs or 0) if req.logprobs else None


def _structure(req, tools: ToolPlan) -> tuple:
    structure, sparam = requested_structure(req)
    tool_structure = tools.constraint()
    if tool_structure is not None:
        if structure is not None:
            raise InvalidParameterError(sparam, f"{sparam} cannot be combined with tool_choice {tools.mode}")
        return tool_structure, "tool_choice"
    return structure, sparam


def chat_messages(req) -> list:
    """The conversation as plain dicts; OpenAI's `developer` role is a system message here."""
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True, exclude={"annotations"})  # an empty list: nothing to render
        if d["role"] == "developer":
            d["role"] = "system"
        out.append(d)
    return out


def template_kwargs(req) -> dict:
    """What the chat template gets besides messages and tools (vLLM's chat_template_kwargs et al.)."""
    kw = dict(req.chat_template_kwargs or {})
    bad = [k for k in kw if k in RESERVED_TEMPLATE_KWARGS]
    if bad:
        raise InvalidParameterError(
            "chat_template_kwargs", f"chat_template_kwargs may not set {bad[0]!r}; use the request field"
        )
    if getattr(req, "reasoning_effort", None) is not None:
        kw.setdefault("reasoning_effort", req.reasoning_effort)
    if req.chat_template is not None:
        from servescope.tokenizer.chat_template import compile_chat_template  # lazy: jinja2 already loaded

        try:
            compile_chat_template(req.chat_template)
        except Exception as e:  # jinja2's syntax errors: the request's template is broken
            raise InvalidParameterError("chat_template", f"chat_template does not compile: {e}") from None
        kw["chat_template"] = req.chat_template
    if req.documents is not None:
        kw["documents"] = req.documents
    if req.continue_final_message:
        kw["continue_final_message"] = True
    return kw


def _extras(ctx: ServingContext, req, reasoning) -> dict:
    extra = dict(logit_controls(ctx.engine.tokenizer, ctx.engine.vocab_size, req), cache_salt=req.cache_salt)
    if req.max_reasoning_tokens is not None:
        if reasoning is None:
            raise InvalidParameterError(
                "max_reasoning_tokens",
                "max_reasoning_tokens needs a reasoning parser (serve --reasoning-parser)",
            )
        extra["thinking_budget"] = reasoning.budget(req.max_reasoning_tokens)
    if reasoning is not None and reasoning.style.special_markers:  # (harmony's channels are special tokens)
        extra["skip_special_tokens"] = False
    return extra


async def start_chat(ctx: ServingContext, req: ChatCompletionRequest) -> ChatRun:
    """Check, render and queue a conversation (nothing is queued on any error)."""
    check_model(ctx, req.model)
    check_fields(req)
    check_vllm_fields(req)
    check_request(ctx, req)  # the server's limits and the queue, before any render
    ctx = with_token_ids(ctx, req)
    top_n = _top_n(req)
    tools = ToolPlan(req)
    structure, sparam = _structure(req, tools)
    if structure is not None:
        ctx.grammars.check_size(structure, sparam)
    # a constrained output has no reasoning block (the grammar holds from its first token)
    reasoning = ctx.reasoning if structure is None else None
    mt_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    kw = dict(
        logprobs=top_n,
        max_tokens_param=mt_param,
        prompt_logprobs=req.prompt_logprobs,
        structured=structure,
        extra=_extras(ctx, req, reasoning),
    )
    # validate the cheap fields before rendering the template (max_tokens checked again below)
    sampling_params(
        ctx, req, max_tokens=max_tokens if max_tokens is not None else ctx.engine.max_model_len - 1, **kw
    )
    messages = chat_messages(req)
    _, ids = await ctx.engine.render_chat(
        messages,
        add_generation_prompt=req.add_generation_prompt is not False,
        tools=tools.rendered,
        add_special_tokens=bool(req.add_special_tokens),
        **template_kwargs(req),
        **render_options(ctx),
    )
    ids = truncate_prompt(ids, req.truncate_prompt_tokens, ctx.engine.max_model_len)
    if max_tokens is None:  # OpenAI: as many as the context allows
        max_tokens = max(1, ctx.engine.max_model_len - len(ids))
    params = sampling_params(ctx, req, max_tokens=max_tokens, **kw)
    params = params.replace(structured=await compile_structure(ctx, structure, sparam))
    streams = await start_streams(ctx, [ids], params, max_tokens_param=mt_param, priority=req.priority or 0)
    role = "assistant" if req.add_generation_prompt is not False else messages[-1]["role"]
    echo = ""
    if req.echo and messages[-1]["role"] == role:
        echo = _text_of(messages[-1].get("content"))
    return ChatRun(
        ctx,
        req,
        streams,
        ids,
        params,
        tools,
        top_n,
        reasoning,
        role,
        echo,
        usage={"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": 0},
    )


def _text_of(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content)
    return content or ""


def parse_sample(run: ChatRun, o, finish: Optional[str]) -> ParsedSample:
    """A finished sample: reasoning (None without a parser), content, tool calls, finish_reason."""
    reasoning, answer = (None, o.text)
    n_reasoning = 0
    if run.reasoning is not None:
        reasoning, answer = run.reasoning.split(o.text)
        n_reasoning = run.reasoning.count_tokens(o.text, o.token_ids)
        answer = answer or ""
    content, calls = run.tools.parse(answer)
    if run.reasoning is not None and content == "":
        content = None
    if run.echo:
        content = run.echo + (content or "")
    if run.req.include_reasoning is False:
        reasoning = None
    return ParsedSample(reasoning, content, calls, run.tools.finish_reason(calls, finish), n_reasoning)


class SampleStreamer:
    """One sample's growing text -> (reasoning delta, content delta, tool call deltas); the deltas
    reassemble to parse_sample's answer (reasoning: ReasoningStreamer, tools: ToolStreamer)."""

    def __init__(self, run: ChatRun):
        self.run = run
        self.reasoning = run.reasoning.streamer() if run.reasoning is not None else None
        self.tools = ToolStreamer(run.tools)
        self.answer = ""

    def feed(self, text: str, finished: bool) -> tuple:
        dr = ""
        if self.reasoning is not None:
            dr, da = self.reasoning.feed(text, finished)
            self.answer += da
            text = self.answer
        content, calls = self.tools.feed(text, finished)
        if self.run.req.include_reasoning is False:
            dr = ""
        return dr, content, calls

    @property
    def named_call(self) -> bool:
        return self.tools.named_id is not None


def count_reasoning(run: ChatRun, n: int) -> None:
    """Reasoning tokens into /metrics."""
    m = run.ctx.metrics
    if n and m is not None and hasattr(m, "reasoning_tokens"):
        m.reasoning_tokens.inc(n)


async def collect_final(run: ChatRun, request):
    """The finished RequestOutput of a run (a client that leaves aborts it)."""

    async def collect():
        async for _, out in merge_streams(run.streams):
            if out.finished:
                return out

    return await run_until_disconnect(request, collect())


async def final_sample(run: ChatRun, request) -> tuple:
    """(the finished RequestOutput, its one sample, that sample parsed) of a one-sample run, the
    reasoning counted: what a non-streamed Responses or Messages answer is built from."""
    out = await collect_final(run, request)
    o = out.outputs[0]
    p = parse_sample(run, o, check_finish(o, out.error))
    count_reasoning(run, p.reasoning_tokens)
    return out, o, p


def sse_response(events) -> StreamingResponse:
    """A server-sent-events response over `events` (byte or str chunks), unbuffered by proxies."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
