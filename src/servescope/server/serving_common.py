"""What completions and chat share: request -> SamplingParams, queuing several prompts at once,
merging their streams, token text/bytes for logprobs, SSE framing, and aborting on disconnect."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

from starlette.requests import Request
from starlette.responses import StreamingResponse

from servescope.config import SamplingParams, StructuredOutput
from servescope.engine.async_engine import AsyncEngine, RequestStream
from servescope.engine.outputs import CompletionOutput
from servescope.errors import InvalidParameterError
from servescope.server.errors import APIError, error_body, to_api_error
from servescope.server.grammar_service import GrammarService
from servescope.server.limits import ServerLimits
from servescope.server.protocol import MAX_LOGPROBS

logger = logging.getLogger(__name__)

SEED_LIMIT = 2**63 - 1024  # torch seeds are 64-bit; n samples use seed + i
MAX_REPETITION_PENALTY = 10.0
MIN_REPETITION_PENALTY = 0.01


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    max_n: int = 8
    max_queue: Optional[int] = None
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: Optional["TokenText"] = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    grammars: Optional[GrammarService] = None  # structured outputs' checks and compiles
    derived_prompt_chars: Optional[int] = None  # request_checks.max_prompt_chars, computed once
    reasoning: Optional[object] = None  # a reasoning.ReasoningParser (serve --reasoning-parser)
    metrics: Optional[object] = None  # the app's ServerMetrics


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(ctx: ServingContext, model: Optional[str]) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")


def sampling_params(ctx: ServingContext, req, *, max_tokens: int, logprobs: Optional[int],
                    max_tokens_param: str = "max_tokens", prompt_logprobs: Optional[int] = None,
                    structured: Optional[StructuredOutput] = None,
                    extra: Optional[dict] = None) -> SamplingParams:
    """Server-side limits first (n cap, seed range, penalties), then SamplingParams' own checks,
    which name the field."""
    n = 1 if req.n is None else req.n
    if n < 1 or n > ctx.max_n:
        raise InvalidParameterError("n", f"n must be between 1 and {ctx.max_n} on this server, got {n}")
    if req.seed is not None and not -SEED_LIMIT <= req.seed <= SEED_LIMIT:
        raise InvalidParameterError("seed", f"seed must be a 64-bit integer (|seed| <= {SEED_LIMIT})")
    if req.repetition_penalty is not None and not (
            MIN_REPETITION_PENALTY <= req.repetition_penalty <= MAX_REPETITION_PENALTY):
        raise InvalidParameterError("repetition_penalty", f"repetition_penalty must be in "
                                    f"[{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                                    f"got {req.repetition_penalty}")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidParameterError("logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise InvalidParameterError("prompt_logprobs",
                                    f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {prompt_logprobs}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])  # counted by check_request
    top_k = req.top_k if req.top_k is not None else 0
    if top_k >= ctx.engine.vocab_size:
        top_k = 0  # every token is in the top k: off
    if max_tokens is not None and max_tokens > ctx.engine.max_model_len:
        raise InvalidParameterError(max_tokens_param, f"{max_tokens_param} ({max_tokens}) is beyond this model's "
                                                      f"context of {ctx.engine.max_model_len} tokens")
    try:
        return SamplingParams(
            n=n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            seed=req.seed, stop=tuple(stop), max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0, ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
            stop_token_ids=tuple(req.stop_token_ids or ()), prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=bool(req.include_stop_str_in_output), structured=structured,
            **{"skip_special_tokens": req.skip_special_tokens is not False, **(extra or {})})
    except InvalidParameterError as e:
        raise rename_param(e, max_tokens_param) from None


def rename_param(e: InvalidParameterError, max_tokens_param: str) -> InvalidParameterError:
    if e.param == "max_tokens" and max_tokens_param != "max_tokens":
        return InvalidParameterError(max_tokens_param, e.message.replace("max_tokens", max_tokens_param))
    return e


async def start_streams(ctx: ServingContext, prompts: list, params: SamplingParams,
                        max_tokens_param: str = "max_tokens", priority: int = 0) -> list:
    """Queue every prompt (token ids); all or nothing: on an error the ones queued are aborted."""
    ctx.engine.check_capacity(len(prompts), ctx.max_queue)
    streams: list[RequestStream] = []
    try:
        for ids in prompts:
            rid = ctx.engine.new_request_id()
            streams.append(await ctx.engine.add_request(rid, ids, params, priority=priority,
                                                        max_queue=ctx.max_queue))
    except InvalidParameterError as e:
        for s in streams:
            s.abort()
        raise rename_param(e, max_tokens_param) from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def merge_streams(streams: list) -> AsyncIterator[tuple]:
    """(prompt index, newest RequestOutput) from several streams as they come; leaving early or an
    error aborts every stream. Holds at most one output per stream: a newer one replaces the one not
    yet taken (outputs are cumulative), so a consumer held up by a slow client costs bounded memory."""
    latest: dict = {}  # prompt index -> the newest output not yet yielded
    errors: list = []
    ended = 0
    ready = asyncio.Event()

    async def pump(i: int, s: RequestStream):
        nonlocal ended
        try:
            async for out in s:
                latest[i] = out
                ready.set()
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            errors.append(e)
        finally:
            ended += 1
            ready.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            if latest:
                i = next(iter(latest))
                yield i, latest.pop(i)
            elif errors:
                raise errors[0]
            elif ended == len(streams):
                return
            else:
                ready.clear()
                await ready.wait()
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def check_finish(o: CompletionOutput, error: Optional[str]) -> Optional[str]:
    """The OpenAI finish_reason of a sample; engine-side failures become errors."""
    if o.finish_reason in (None, "stop", "length"):
        return o.finish_reason
    raise APIError(500, f"the request failed in the engine: {error or o.finish_reason}", code="engine_error")


async def run_until_disconnect(request: Request, coro):
    """Await coro; if the client disconnects first, cancel it (its finally blocks abort the engine
    requests) and give up."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "the client disconnected", code="client_disconnected")
    return task.result()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class StreamFrame:
    """One streamed response's chunk envelope and its tail: the usage chunk (stream_options.
    include_usage), an error after the 200 went out as an error event in the stream, then [DONE]."""

    ctx: ServingContext
    rid: str
    created: int
    object: str  # "chat.completion.chunk" | "text_completion"
    usage: dict
    include_usage: bool
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: the usage so far in every chunk
    tokens_so_far: dict = field(default_factory=dict)  # choice index -> its output tokens so far

    def chunk(self, choices: list, with_usage: Optional[dict] = None) -> str:
        obj = {"id": self.rid, "object": self.object, "created": self.created, "model": self.ctx.model_name,
               "choices": choices}
        if with_usage is None and self.continuous_usage:
            done = sum(self.tokens_so_far.values())
            with_usage = {"prompt_tokens": self.usage["prompt_tokens"], "completion_tokens": done,
                          "total_tokens": self.usage["prompt_tokens"] + done}
        if self.include_usage or self.continuous_usage:
            obj["usage"] = with_usage
        return sse(obj)

    async def wrap(self, body: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for c in body:
                yield c
            if self.include_usage or self.continuous_usage:
                self.usage["total_tokens"] = self.usage["prompt_tokens"] + self.usage["completion_tokens"]
                yield self.chunk([], with_usage=self.usage)
        except Exception as e:  # noqa: BLE001 - after the 200 went out, errors travel in the stream
            a = to_api_error(e)
            yield sse(error_body(a.status, a.message, a.param, a.code, a.type))
        yield SSE_DONE


def stream_frame(ctx: ServingContext, rid: str, obj: str, usage: dict, req) -> StreamFrame:
    """The frame of a streamed answer, by the request's stream_options (vLLM: continuous_usage_stats
    puts the usage so far in every chunk, unless include_usage is false)."""
    so = req.stream_options
    include = bool(so and so.include_usage)
    continuous = bool(so and so.continuous_usage_stats and so.include_usage is not False)
    return StreamFrame(ctx, rid, ctx.created, obj, usage, include, continuous_usage=continuous)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that calls `on_close` however the response ends (done, error, client gone)."""

    def __init__(self, content, on_close: Callable[[], None], **kw):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def finite(x: float) -> float:
    """JSON has no -inf/NaN: a token the model rules out gets a very negative logprob instead."""
    return x if math.isfinite(x) else -9999.0


def vllm_prompt_logprobs(tt: "TokenText", entries: Optional[list]) -> Optional[list]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt token and its top alternatives."""
    if entries is None:
        return None
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": finite(e.logprob), "rank": e.rank, "decoded_token": tt.text(e.token_id)}}
        for r, (tid, lp) in enumerate(e.top, start=1):
            d.setdefault(str(tid), {"logprob": finite(lp), "rank": r, "decoded_token": tt.text(tid)})
        out.append(d)
    return out


class TokenText:
    """Per-token strings and raw bytes for logprobs, cached by token id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list] = {}
        self._byte_decoder = _byte_level_decoder()

    def text(self, tid: int) -> str:
        s = self._text.get(tid)
        if s is None:
            s = self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None else f"<{tid}>"
            self._text[tid] = s
        return s

    def bytes(self, tid: int) -> list:
        b = self._bytes.get(tid)
        if b is None:
            raw = None
            if self.tok is not None:
                piece = self.tok.id_to_token(tid)
                # byte-level BPE stores bytes as printable characters ('Ġ' is a space): map them back,
                # so a token holding part of a UTF-8 character reports its true bytes
                if isinstance(piece, str) and piece and all(ch in self._byte_decoder for ch in piece):
                    raw = bytes(self._byte_decoder[ch] for ch in piece)
            if raw is None:
                raw = self.text(tid).encode("utf-8")
            b = list(raw)
            self._bytes[tid] = b
        return b


def _byte_level_decoder() -> dict:
    """Inverse of GPT-2's bytes_to_unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
