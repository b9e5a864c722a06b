"""GET /v1/internals/stream: server-sent events of the engine's internals, for the dashboard.

One Broadcaster per app takes a snapshot of the engine a few times a second while at least one
viewer is connected (none otherwise), encodes it once and hands the bytes to every viewer's
FrameQueue. The engine's side of it is one short call between two steps per snapshot, whatever
the number of viewers; a viewer that reads slowly or not at all only fills its own queue, which
drops its oldest frames (the next "dropped" event says how many) — the broadcaster never waits
for a viewer, and a viewer's memory is at most `queue_size` frames plus the socket's buffer.

Events: `hello` (once: what is being watched, the roofline, and the history: a frame with the
latest steps), then `frame` (the steps since the previous frame and the state now), `dropped`
(frames this viewer missed), `closed` (the engine stopped); a comment line every 15 s keeps idle
connections alive. Frames carry at most `max_steps` steps each; more steps than that between two
frames are counted in `steps_dropped`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional, Protocol

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from servescope.engine.async_engine import AsyncEngine
from servescope.engine.live_view import LiveView
from servescope.errors import ServescopeError
from servescope.server.errors import error_response
from servescope.telemetry.live import FrameQueue, LatencyHistograms

logger = logging.getLogger(__name__)

KEEPALIVE_S = 15.0


class FrameSource(Protocol):
    """What a Broadcaster watches: a live engine or a replayed trace."""

    def info(self) -> dict: ...

    async def snapshot(self, since_step: int) -> dict: ...


class EngineSource:
    """Snapshots of an AsyncEngine's LLMEngine, taken on the engine thread."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, max_steps: int = 500,
                 previews: bool = True):
        self.async_engine = async_engine
        self.previews = previews  # prompt previews in the queues (off: viewers may hold no key)
        self.model_name = model_name
        self.max_steps = max_steps
        self.histograms = LatencyHistograms()
        async_engine.output_listeners.append(self.histograms.on_output)
        self._view: Optional[LiveView] = None  # attached to the engine when the first viewer comes

    def _frame(self, engine, since_step: int) -> dict:  # engine thread
        if self._view is None:
            self._view = LiveView(engine, self.histograms, max_steps=self.max_steps, previews=self.previews)
        return self._view.frame(since_step)

    def info(self) -> dict:
        return {"source": "live", "model": self.model_name,
                "hardware": None if self._view is None else self._view.hardware()}

    async def snapshot(self, since_step: int) -> dict:
        return await self.async_engine.run_on_engine(lambda engine: self._frame(engine, since_step))


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, allow_nan=False, separators=(',', ':'))}\n\n".encode()


MAX_VIEWER_INTERVAL_S = 10.0


class Viewer:
    """One connected viewer. min_gap_s: it is written to at most that often; the frames in between are
    sent together (each frame holds only its own steps, so none is skipped). A browser woken 4 times a
    second on a 2-core server cost the engine more than its CPU time: every wake-up can stall one of
    the engine's two threads, and with them the step's parallel region."""

    def __init__(self, queue_size: int, min_gap_s: float = 0.0):
        self.queue = FrameQueue(queue_size)
        self.wake = asyncio.Event()
        self.reported_drops = 0
        self.min_gap_s = min_gap_s


class Broadcaster:
    def __init__(self, source: FrameSource, interval_s: float = 0.25, max_viewers: int = 16,
                 queue_size: int = 8):
        if interval_s <= 0 or max_viewers < 1:
            raise ValueError("interval_s must be > 0 and max_viewers at least 1")
        self.source = source
        self.interval_s = interval_s
        self.max_viewers = max_viewers
        self.queue_size = queue_size
        self.viewers: set = set()
        self.last_step = 0
        self.frames_sent = 0
        self._task: Optional[asyncio.Task] = None

    # ------------------------------------------------------------ viewers
    def connect(self, interval_s: float = 0.0) -> Viewer:
        """A new viewer written to at most every interval_s (ServescopeError when max_viewers are
        connected); the loop starts if idle."""
        if len(self.viewers) >= self.max_viewers:
            raise ServescopeError(f"{self.max_viewers} dashboard viewers are connected already")
        # enough queue for the frames of one gap, so that batching them never drops one
        per_gap = int(interval_s / self.interval_s) + 2
        viewer = Viewer(max(self.queue_size, per_gap), interval_s)
        self.viewers.add(viewer)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return viewer

    async def events(self, viewer: Viewer):
        """The viewer's event stream: hello (with the history), then frames as they come."""
        try:
            history = await self.source.snapshot(0)
            yield sse("hello", {**self.source.info(), "frame": history})
            while True:
                try:
                    await asyncio.wait_for(viewer.wake.wait(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield b": keepalive\n\n"
                    continue
                if viewer.min_gap_s > 0:
                    await asyncio.sleep(viewer.min_gap_s)  # the frames of the gap, in one write
                viewer.wake.clear()
                if viewer.queue.dropped > viewer.reported_drops:
                    viewer.reported_drops = viewer.queue.dropped
                    yield sse("dropped", {"frames": viewer.queue.dropped})
                items = []
                while (item := viewer.queue.get()) is not None:
                    items.append(item)
                    if item.startswith(b"event: closed"):
                        break
                if items:
                    yield b"".join(items)
                if items and items[-1].startswith(b"event: closed"):
                    return
        except ServescopeError as e:  # the engine is shut down: say so and end the stream
            yield sse("closed", {"reason": str(e)})
        finally:
            self.viewers.discard(viewer)

    # ------------------------------------------------------------ the loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.viewers:
            started = loop.time()
            try:
                frame = await self.source.snapshot(self.last_step)
                item = sse("frame", frame)
                self.last_step = frame.get("last_step", self.last_step)
            except ServescopeError as e:
                item = sse("closed", {"reason": str(e)})
            except Exception:  # noqa: BLE001 - a bug in a snapshot must not kill the stream silently
                logger.exception("dashboard snapshot failed")
                item = sse("closed", {"reason": "the snapshot failed (see the server log)"})
            self.frames_sent += 1
            for viewer in list(self.viewers):
                viewer.queue.put(item)
                viewer.wake.set()
            if item.startswith(b"event: closed"):
                return
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))


def install_internals_stream(app: FastAPI, source: FrameSource, **broadcaster_kw) -> Broadcaster:
    """Add GET /v1/internals/stream to `app`, fed by one Broadcaster over `source`."""
    broadcaster = Broadcaster(source, **broadcaster_kw)
    app.state.broadcaster = broadcaster

    @app.get("/v1/internals/stream", summary="Server-sent events of the engine's internals (the dashboard's feed)")
    async def internals_stream(interval: float = 0.0):
        """interval: write to this viewer at most every `interval` seconds (0: every frame)."""
        if not 0.0 <= interval <= MAX_VIEWER_INTERVAL_S:
            return error_response(400, f"interval must be between 0 and {MAX_VIEWER_INTERVAL_S:g} seconds, "
                                       f"got {interval:g}", param="interval", code="invalid_interval")
        try:
            viewer = broadcaster.connect(interval)
        except ServescopeError as e:
            # the client's doing (one more viewer), not the server's failure: 429, as for a full queue
            return error_response(429, str(e), code="too_many_viewers", headers={"Retry-After": "1"})
        return StreamingResponse(broadcaster.events(viewer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return broadcaster
