"""`servescope replay`: a recorded run (a Chrome trace from --trace) played back in the dashboard.

ReplaySource is a FrameSource on a clock: a frame holds the steps whose start the replay clock has
passed (at `speed` times real time), the counters of the last of them, and the latency histograms
of the requests finished by then. The trace has no block map, so the map shows the used blocks
first and the rest free (`synthetic`: the page says so). At the end the replay holds the final
state, or starts over with `loop`.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Optional

from fastapi import FastAPI

from servescope.analysis.hardware import get_hardware
from servescope.errors import InvalidParameterError
from servescope.server.dashboard import install_dashboard
from servescope.server.errors import install_error_handlers
from servescope.server.limits import ServerLimits
from servescope.server.middleware import GuardMiddleware
from servescope.telemetry.live import LatencyHistograms
from servescope.telemetry.trace_replay import RecordedRun


def _roofline(name: Optional[str]) -> Optional[dict]:
    """The datasheet (or cached local probe) roofline of the trace's hardware, when it is known here."""
    if not name:
        return None
    try:
        hw = get_hardware(name)
    except InvalidParameterError:
        return None
    peak = hw.flops("float32")
    return {"name": hw.name, "dtype": "float32", "peak_flops": peak, "bandwidth": hw.memory_bandwidth,
            "ridge": peak / hw.memory_bandwidth}


class ReplaySource:
    def __init__(self, run: RecordedRun, label: str, speed: float = 1.0, loop: bool = False,
                 clock: Callable[[], float] = time.monotonic, max_steps: int = 500):
        if not speed > 0:
            raise InvalidParameterError("speed", f"the replay speed must be > 0, got {speed}")
        self.run, self.label, self.speed, self.loop = run, label, speed, loop
        self.clock, self.max_steps = clock, max_steps
        self._start = clock()
        self._times = [s["t"] for s in run.steps]
        self._prefill = self._decode = 0
        self._cum = []  # cumulative (prefill, decode) tokens after each step
        for s in run.steps:
            self._prefill += s["prefill_tokens"]
            self._decode += s["decode_tokens"]
            self._cum.append((self._prefill, self._decode))
        self.num_blocks = run.num_blocks or max((s["kv_used"] for s in run.steps), default=0) or 1
        self.hardware = _roofline(run.hardware)

    def info(self) -> dict:
        return {"source": "replay", "model": "recorded run", "trace": self.label, "speed": self.speed,
                "hardware": self.hardware}

    def now_ms(self) -> float:
        """Where the replay is, in the trace's milliseconds."""
        t = (self.clock() - self._start) * 1e3 * self.speed
        duration = self.run.duration_ms
        return t % (duration + 1000.0) if self.loop and duration > 0 else t

    async def snapshot(self, since_step: int) -> dict:
        now = self.now_ms()
        n = bisect.bisect_right(self._times, now)  # steps started by now
        steps = self.run.steps[:n]
        if n and steps[-1]["step"] < since_step:  # the loop started over: everything is new again
            since_step = 0
        new = [s for s in steps[-self.max_steps:] if s["step"] > since_step]
        last = steps[-1] if steps else None
        hist = LatencyHistograms()
        for finish, ttft, tpot in self.run.requests:
            if finish > now:
                break
            hist.add_request(ttft, tpot)
        return {
            "time": round(now / 1e3, 4), "last_step": last["step"] if last else 0, "steps": new,
            "steps_dropped": max(0, len([s for s in steps if s["step"] > since_step]) - len(new)),
            "totals": dict(zip(("prefill_tokens", "decode_tokens"), self._cum[n - 1] if n else (0, 0))),
            "kv": self._block_map(last), "kv_state": self._kv_state(last), "queues": self._queues(last),
            "latency": hist.as_dict(),
        }

    def _block_map(self, last: Optional[dict]) -> dict:
        used = min(self.num_blocks, last["kv_used"]) if last else 0
        return {"num_blocks": self.num_blocks, "block_size": None, "synthetic": True,
                "states": "1" * used + "0" * (self.num_blocks - used),
                "owners": [[-1, self.num_blocks]], "requests": [],
                "counts": {"free": self.num_blocks - used, "used": used, "cached": 0, "evictable": 0}}

    def _kv_state(self, last: Optional[dict]) -> dict:
        used = last["kv_used"] if last else 0
        return {"num_blocks": self.num_blocks, "blocks_used": used, "blocks_free": self.num_blocks - used,
                "blocks_cached": last["kv_cached"] if last else 0, "usage": used / self.num_blocks}

    @staticmethod
    def _queues(last: Optional[dict]) -> dict:
        return {"running": {"count": last["running"] if last else 0, "entries": []},
                "waiting": {"count": last["waiting"] if last else 0, "entries": []},
                "preempted": {"count": 0, "entries": []}}


def build_replay_app(source: ReplaySource, api_key: Optional[str] = None,
                     limits: Optional[ServerLimits] = None) -> FastAPI:
    """/dashboard over a replay (and /health); every route but /health needs the API key when one is
    given; limits: the HTTP ones apply (Host allow-list, body size and deadline)."""
    app = FastAPI(title="servescope replay", version="0.1.0")
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, limits=limits, api_key=api_key)
    install_dashboard(app, source)

    @app.get("/health")
    async def health():
        return {"status": "ok", "replay": source.label}

    @app.get("/v1/internals")
    async def internals():
        frame = await source.snapshot(0)
        return {"steps": frame["steps"], "kv_cache": frame["kv_state"]}

    return app

