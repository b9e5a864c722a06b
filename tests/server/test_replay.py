"""ReplaySource: a recorded run revealed on the replay's clock (the frames the dashboard draws)."""

import asyncio
import json

import pytest

from servescope.errors import InvalidParameterError
from servescope.server.replay import ReplaySource
from servescope.telemetry.trace import chrome_trace
from servescope.telemetry.trace_replay import read_recorded_run

from telemetry.test_trace import _outputs, _records  # tests/ is on sys.path (the packages under it)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_replay_reveals_steps_on_its_clock():
    clock = Clock()
    src = ReplaySource(read_recorded_run(chrome_trace(_records(), _outputs())), "t.json", speed=2.0, clock=clock)
    snap = lambda since: asyncio.run(src.snapshot(since))  # noqa: E731
    assert snap(0)["steps"] == [] and snap(0)["last_step"] == 0
    clock.now = 0.030  # 60 ms of the trace at 2x: steps 1 (10 ms) is out, 2 (61 ms) not yet
    f = snap(0)
    assert [s["step"] for s in f["steps"]] == [1] and f["kv"]["counts"]["used"] == 3
    assert f["latency"]["finished"] == 0 and f["totals"] == {"prefill_tokens": 32, "decode_tokens": 0}
    clock.now = 1.0
    f = snap(1)
    assert [s["step"] for s in f["steps"]] == [2, 3] and f["last_step"] == 3
    assert f["latency"]["finished"] == 1 and f["kv"]["counts"] == {"free": 5, "used": 5, "cached": 0, "evictable": 0}
    assert f["totals"] == {"prefill_tokens": 48, "decode_tokens": 2}
    json.dumps(f, allow_nan=False)


def test_looping_replay_starts_over():
    clock = Clock()
    src = ReplaySource(read_recorded_run(chrome_trace(_records())), "t", loop=True, clock=clock)
    clock.now = 0.2
    assert asyncio.run(src.snapshot(0))["last_step"] == 3
    clock.now = src.run.duration_ms / 1e3 + 1.0 + 0.001  # the second lap: only step 1 (at 0 ms) again
    f = asyncio.run(src.snapshot(3))
    assert f["last_step"] == 1 and [s["step"] for s in f["steps"]] == [1]


def test_bad_speed_is_refused():
    with pytest.raises(InvalidParameterError, match="speed"):
        ReplaySource(read_recorded_run(chrome_trace(_records())), "t", speed=0)
