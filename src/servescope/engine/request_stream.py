"""RequestStream: the consumer's side of one request of an AsyncEngine (engine/async_engine.py).

The engine thread hands it items with `_put` (through the event loop's call_soon_threadsafe); the
consumer iterates it. It keeps at most one output and one error (see the class).
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from servescope.engine.outputs import RequestOutput

ACCEPTED = object()  # handed to a stream once the engine thread queued its request


class RequestStream:
    """Async iterator over the RequestOutputs of one request (outputs are cumulative).

    It holds at most one output: a new one replaces the one not yet read (it holds everything before
    it), so a slow consumer skips intermediate outputs and costs the memory of one output, whatever
    the number of steps it falls behind. An error is kept apart and handed out after the output
    that came before it. Call `abort()` (or use `AsyncEngine.generate`) when leaving early.
    """

    def __init__(self, send: Callable, request_id: str, loop: asyncio.AbstractEventLoop):
        """send: the AsyncEngine's message to its engine thread (how an abort reaches it)."""
        self.request_id = request_id
        self._send = send
        self._loop = loop
        self._latest: Optional[RequestOutput] = None  # the newest output not yet read
        self._error: Optional[BaseException] = None
        self._accepted = False
        self._ready = asyncio.Event()
        self._done = False  # the consumer has seen the end (finished output or an error)
        self._held = True  # counts toward the engine's in-flight total (released exactly once)
        self._seen_tokens = 0  # engine thread only: output tokens already reported to listeners

    # -- engine thread side
    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._offer, item)
        except RuntimeError:  # the event loop is gone: nobody will read this; drop the request
            self._send(("abort", self.request_id))

    def _offer(self, item) -> None:  # event loop
        if item is ACCEPTED:
            self._accepted = True
        elif isinstance(item, BaseException):
            self._error = self._error or item
        else:
            self._latest = item
        self._ready.set()

    @property
    def buffered(self) -> int:
        """Items held for the consumer: at most one output and one error."""
        return (self._latest is not None) + (self._error is not None)

    async def _wait(self, ready) -> None:
        while not ready():
            self._ready.clear()
            await self._ready.wait()

    # -- consumer side
    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self._wait(lambda: self._latest is not None or self._error is not None)
        if self._latest is not None:
            item, self._latest = self._latest, None
            if item.finished:
                self._done = True
            return item
        self._done = True
        raise self._error

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Stop the request if it still runs; its KV blocks are freed before the engine's next step."""
        if not self._done:
            self._done = True
            self._send(("abort", self.request_id))
