"""AsyncEngine: the LLMEngine behind an asyncio server.

Threading model (the invariant everything here relies on):
  - LLMEngine is not thread-safe. Every engine call (add_request, abort, step, kv_cache_state, ...)
    happens on ONE background thread, the engine thread. Other threads talk to it only through a
    command deque guarded by a condition variable; the thread sleeps on that condition while it has
    neither commands nor unfinished requests.
  - Results go back through one asyncio.Queue per request, fed with loop.call_soon_threadsafe; the
    engine thread never touches asyncio objects directly.
  - Tokenization and chat-template rendering run in worker threads (asyncio.to_thread), so a large
    prompt blocks neither the event loop nor the engine's step loop.

Admission: at most `max_queue` requests (waiting + running, counted from acceptance by `add_request`
until the engine lets go of them) are in flight; beyond that `QueueFullError` (HTTP 429).
Cancellation: leaving a stream before it finished (client disconnect) sends an abort command, which
the engine thread runs before its next step, so the request's KV blocks are freed within one step.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from servescope.config import SamplingParams
from servescope.engine.outputs import RequestOutput
from servescope.errors import InvalidParameterError, ServescopeError, WorkerFailedError

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


class QueueFullError(ServescopeError):
    """Too many requests in flight (waiting + running); retry later (HTTP 429)."""


class EngineClosedError(ServescopeError):
    """The engine was shut down (or its thread died) while a request was in flight."""


class EngineStepError(ServescopeError):
    """An engine step failed; the requests in that step were aborted."""


_ACCEPTED = object()  # first item on a request's queue once the engine thread queued it


class RequestStream:
    """Async iterator over the RequestOutputs of one request (outputs are cumulative).

    A slow consumer skips intermediate outputs: each `__anext__` returns the newest one, which holds
    everything before it. Call `abort()` (or use `AsyncEngine.generate`) when leaving early.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending_error: Optional[BaseException] = None
        self._done = False  # the consumer has seen the end (finished output or an error)
        self._held = True  # counts toward the engine's in-flight total (released exactly once)
        self._seen_tokens = 0  # engine thread only: output tokens already reported to listeners

    # -- engine thread side
    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody will read this; drop the request
            self._engine._send(("abort", self.request_id))

    # -- consumer side
    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._pending_error is not None:
            item, self._pending_error = self._pending_error, None
        else:
            item = await self._queue.get()
        while not isinstance(item, BaseException) and not self._queue.empty():
            nxt = self._queue.get_nowait()  # outputs are cumulative: the newest one suffices
            if isinstance(nxt, BaseException):
                self._pending_error = nxt  # hand out what came before the error first
                break
            item = nxt
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Stop the request if it still runs; its KV blocks are freed before the engine's next step."""
        if not self._done:
            self._done = True
            self._engine._send(("abort", self.request_id))


class AsyncEngine:
    """Owns an LLMEngine and the one thread that drives it. See the module docstring."""

    def __init__(self, engine, max_queue: Optional[int] = None, start: bool = True):
        self.engine = engine
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._inflight = 0  # guarded by _lock
        self._lock = threading.Lock()
        self._stopping = False
        self.closed_reason = "the engine is shut down"  # what requests are told once it stopped
        self._ids = itertools.count()
        # called on the engine thread with (RequestOutput, new output tokens); must be quick
        self.output_listeners: list[Callable[[RequestOutput, int], None]] = []
        self._thread = threading.Thread(target=self._run, name="servescope-engine", daemon=True)
        if start:
            self._thread.start()

    # ------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def num_inflight(self) -> int:
        with self._lock:
            return self._inflight

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    # ------------------------------------------------------------ off-loop tokenization
    async def encode(self, text: str, add_special_tokens: bool = True) -> list:
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidParameterError("prompt", "this model has no tokenizer: pass prompt token ids")
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)

    async def render_chat(self, messages: list, add_generation_prompt: bool = True, tools=None,
                          add_special_tokens: bool = False, **template_kw) -> tuple:
        """(prompt text, token ids) of a conversation; raises InvalidParameterError("messages", ...).
        template_kw: Tokenizer.apply_chat_template's (chat_template, continue_final_message, documents,
        the template's own variables)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidParameterError("messages", "this model has no tokenizer, so no chat template")

        def render():
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                           **template_kw)
            # the template already holds the special tokens (BOS): do not add them again, unless asked
            return text, tok.encode(text, add_special_tokens=add_special_tokens)

        return await asyncio.to_thread(render)

    async def compile_grammar(self, spec) -> None:
        """Compile a structured-output constraint off the engine thread (add_request then finds it in
        the compiler's cache); raises InvalidParameterError("structured", ...)."""
        await asyncio.to_thread(lambda: self.engine.grammar_compiler.compile(spec))

    # ------------------------------------------------------------ requests
    def check_capacity(self, k: int = 1, max_queue: Optional[int] = None) -> None:
        """Raise QueueFullError unless k more requests fit now (a hint: add_request checks again)."""
        limit = self._limit(max_queue)
        if limit is not None and self.num_inflight + k > limit:
            raise QueueFullError(f"the server is busy ({self.num_inflight} requests in flight, limit {limit})")

    def _limit(self, max_queue: Optional[int]) -> Optional[int]:
        limits = [x for x in (self.max_queue, max_queue) if x is not None]
        return min(limits) if limits else None

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                          priority: int = 0, max_queue: Optional[int] = None,
                          arrival_time: Optional[float] = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it. Raises InvalidParameterError (bad
        input, nothing queued), QueueFullError, EngineClosedError. Returns its RequestStream."""
        if not self.is_running:
            raise EngineClosedError(self.closed_reason)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError("prompt", "the prompt is empty")
            prompt = await self.encode(prompt)
        limit = self._limit(max_queue)
        with self._lock:
            if limit is not None and self._inflight >= limit:
                raise QueueFullError(f"the server is busy ({self._inflight} requests in flight, limit {limit})")
            self._inflight += 1
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        self._send(("add", request_id, list(prompt), params, priority, arrival, stream))
        try:
            first = await stream._queue.get()
        except BaseException:  # cancelled while the engine had not answered: take it back
            stream.abort()
            raise
        if isinstance(first, BaseException):
            stream._done = True
            raise first
        return stream

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       **kw: Any) -> AsyncIterator[RequestOutput]:
        """Async iterator of cumulative RequestOutputs; leaving it early (cancellation, a client
        disconnect, break + aclose) aborts the request."""
        stream = await self.add_request(request_id, prompt, params, **kw)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def run_on_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread (between steps) and return its result."""
        if not self.is_running:
            raise EngineClosedError(self.closed_reason)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(ok: bool, value):
            if fut.done():
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

        def call(engine):  # engine None: shut down before it ran
            try:
                if engine is None:
                    raise EngineClosedError("the engine is shut down")
                res = (True, fn(engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                res = (False, e)
            try:
                loop.call_soon_threadsafe(done, *res)
            except RuntimeError:
                pass

        self._send(("call", call))
        return await fut

    # ------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests still in flight end with EngineClosedError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    close = shutdown

    # ------------------------------------------------------------ engine thread
    def _send(self, cmd: tuple) -> None:
        with self._cond:
            self._commands.append(cmd)
            self._cond.notify()

    def _release(self, stream: RequestStream) -> None:
        with self._lock:
            if stream._held:
                stream._held = False
                self._inflight -= 1

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._stopping and not engine.has_unfinished():
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for cmd in commands:
                    self._apply(cmd)
                if engine.has_unfinished():
                    try:
                        outputs = engine.step()
                    except WorkerFailedError as e:  # a parallel worker is gone: no step can run again
                        logger.error("the engine stopped: %s", e)
                        self.closed_reason = f"the engine stopped: {e}"
                        break
                    except Exception as e:  # a bug, not a client mistake: fail what was running, go on
                        logger.exception("engine step failed; aborting %d requests", len(self._streams))
                        self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
                        continue
                    for out in outputs:
                        self._deliver(out)
        except BaseException:  # noqa: BLE001 - the thread must not die silently
            logger.exception("the engine thread died")
            raise
        finally:
            self._stopping = True
            with self._cond:
                commands = list(self._commands)
                self._commands.clear()
            for cmd in commands:  # answer requests queued but never added
                if cmd[0] == "add":
                    self._release(cmd[-1])
                    cmd[-1]._put(EngineClosedError(self.closed_reason))
                elif cmd[0] == "call":
                    cmd[1](None)
            self._fail_all(EngineClosedError(self.closed_reason))

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        engine = self.engine
        if kind == "add":
            _, rid, prompt, params, priority, arrival, stream = cmd
            try:
                engine.add_request(rid, prompt, params, priority=priority, arrival_time=arrival)
            except Exception as e:  # InvalidParameterError is the client's; anything else goes up as is
                self._release(stream)
                stream._put(e)
                return
            self._streams[rid] = stream
            stream._put(_ACCEPTED)
        elif kind == "abort":
            rid = cmd[1]
            engine.abort(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._release(stream)
        elif kind == "call":
            cmd[1](engine)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            self._streams.pop(out.request_id, None)
            self._release(stream)
        if self.output_listeners:
            n = sum(len(o.token_ids) for o in out.outputs)
            new, stream._seen_tokens = n - stream._seen_tokens, n
            for fn in self.output_listeners:
                try:
                    fn(out, new)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    logger.exception("output listener failed")
        stream._put(out)

    def _fail_all(self, err: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", rid)
            self._release(stream)
            stream._put(err)
        self._streams.clear()
