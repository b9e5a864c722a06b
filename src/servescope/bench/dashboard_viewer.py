"""DashboardViewer: a headless reader of a server's /v1/internals/stream, in a daemon thread.

`bench serve --dashboard` keeps one open for the length of the run, so that the load is measured
with the dashboard's feed streaming, and reports what it saw (frames, the steps they covered,
frames the server dropped for it). It parses the same server-sent events as the page.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Optional

import httpx

from servescope.bench.serve_client import endpoint_url


class DashboardViewer:
    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 30.0):
        self.url = endpoint_url(base_url, "/v1/internals/stream")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.frames = 0
        self.first_step: Optional[int] = None
        self.last_step = 0
        self.dropped_frames = 0
        self.error: Optional[str] = None
        self.hello: Optional[dict] = None
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-viewer", daemon=True)

    def start(self, wait_s: float = 30.0) -> "DashboardViewer":
        """Connect and wait (at most wait_s) for the stream's first event."""
        self._thread.start()
        self._connected.wait(wait_s)
        return self

    def stop(self, settle_s: float = 2.0) -> None:
        """Stop after the next frame (at most settle_s): the server sends a frame every interval, so
        the steps of a run's last fraction of a second arrive after its last response."""
        seen, deadline = self.frames, time.monotonic() + settle_s
        while self.frames == seen and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        self._thread.join(self.timeout)

    def _run(self) -> None:
        try:
            with httpx.stream("GET", self.url, headers=self.headers,
                              timeout=httpx.Timeout(self.timeout, read=None)) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                    return
                event = None
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        self._on_event(event, json.loads(line[6:]))
        except Exception as e:  # noqa: BLE001 - reported after the run, never raised into it
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._connected.set()

    def _on_event(self, event: Optional[str], data: dict) -> None:
        if event == "hello":
            self.hello = data
            self._connected.set()
            data = data["frame"]
        if event in ("hello", "frame"):
            self.frames += 1
            if data["steps"] and self.first_step is None:
                self.first_step = data["steps"][0]["step"]
            self.last_step = data["last_step"]
        elif event == "dropped":
            self.dropped_frames = data["frames"]
        elif event == "closed":
            self.error = f"the server closed the feed: {data.get('reason')}"

    def summary(self) -> str:
        if self.error and not self.frames:
            return f"dashboard feed failed: {self.error}"
        steps = "no steps" if self.first_step is None else f"steps {self.first_step}..{self.last_step}"
        extra = f", {self.dropped_frames} frames dropped by the server" if self.dropped_frames else ""
        return f"dashboard feed: {self.frames} frames, {steps}{extra}" + (f" ({self.error})" if self.error else "")
