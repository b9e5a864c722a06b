"""The dashboard from the command line: `bench serve --dashboard` watches the feed during its run,
`generate --dashboard` serves the view of a one-off run, and its --trace replays in the dashboard."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx

from servescope.bench.dashboard_viewer import DashboardViewer
from servescope.cli import build_parser, main
from servescope.server.background import BackgroundServer
from servescope.server.replay import ReplaySource, build_replay_app
from servescope.telemetry.trace_replay import read_recorded_run

from .conftest import TINY_KEY
from .test_internals_stream import _events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_serve_watches_the_feed(tiny_server, capsys):
    rc = main(["bench", "serve", "--base-url", tiny_server.url, "--api-key", TINY_KEY, "--num-prompts", "4",
               "--input-len", "16", "--output-len", "24", "--vocab-size", "49152", "--no-progress", "--dashboard"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"dashboard at {tiny_server.url}/dashboard" in out
    m = re.search(r"dashboard feed: (\d+) frames, steps (\d+)\.\.(\d+)", out)
    assert m and int(m.group(1)) >= 1 and int(m.group(3)) > int(m.group(2)), out


def test_generate_dashboard_serves_the_run_and_its_trace_replays(tmp_path, capsys):
    from tiny_models import make_tiny_hf_model  # tests/model is on sys.path (tests/conftest.py)

    model = str(make_tiny_hf_model(tmp_path, "llama_plain"))
    port, trace = _free_port(), tmp_path / "run.json"
    argv = ["generate", "Hello <b>there</b>", "--model", model, "--max-tokens", "12", "--ignore-eos",
            "--dashboard", "--dashboard-port", str(port), "--dashboard-hold", "5", "--no-browser",
            "--trace", str(trace)]
    rc = []
    run = threading.Thread(target=lambda: rc.append(main(argv)), daemon=True)
    run.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not trace.exists():  # written after the run, while the dashboard holds
        assert run.is_alive() and time.monotonic() < deadline
        time.sleep(0.1)
    (_, hello), = _events(url, 1, headers={})
    steps = hello["frame"]["steps"]
    assert hello["source"] == "live" and len(steps) == 12  # one prefill step, then 11 decodes
    assert [s["phase"] for s in steps] == ["prefill"] + ["decode"] * 11
    assert hello["frame"]["latency"]["finished"] == 1
    assert httpx.get(url + "/dashboard").status_code == 200

    # the recorded run replays in the dashboard, with the same steps
    recorded = read_recorded_run(trace)
    assert [s["step"] for s in recorded.steps] == [s["step"] for s in steps]
    replay = BackgroundServer(build_replay_app(ReplaySource(recorded, "run.json", speed=100.0), api_key="k")).start()
    try:
        assert httpx.get(replay.url + "/v1/internals/stream").status_code == 401
        time.sleep(recorded.duration_ms / 100.0 / 1e3 + 0.2)  # the whole run, replayed at 100x
        (_, rhello), = _events(replay.url, 1, headers={"Authorization": "Bearer k"})
        assert rhello["source"] == "replay" and [s["phase"] for s in rhello["frame"]["steps"]] == \
            [s["phase"] for s in steps]
        assert rhello["frame"]["latency"]["finished"] == 1
        assert httpx.get(replay.url + "/dashboard").status_code == 401  # every route but /health needs it
        assert httpx.get(replay.url + "/dashboard", auth=("viewer", "k")).status_code == 200  # a browser's Basic
    finally:
        replay.stop()
    run.join(60)
    assert rc == [0]
    out = capsys.readouterr().out
    assert f"dashboard at {url}/dashboard" in out


def test_replay_and_dashboard_arguments():
    a = build_parser().parse_args(["replay", "t.json", "--port", "9002", "--speed", "4", "--loop", "--no-browser"])
    assert (a.command, a.trace, a.port, a.speed, a.loop, a.no_browser) == ("replay", "t.json", 9002, 4.0, True, True)
    a = build_parser().parse_args(["generate", "hi", "--dashboard", "--dashboard-port", "0", "--dashboard-hold", "2"])
    assert (a.dashboard, a.dashboard_port, a.dashboard_hold) == (True, 0, 2.0)
    assert main(["replay", "/nonexistent/trace.json", "--no-browser"]) != 0  # a clear error, no server


def test_viewer_reports_a_refused_feed(tiny_server):
    viewer = DashboardViewer(tiny_server.url, api_key="wrong").start()
    viewer.stop()
    assert viewer.frames == 0 and "401" in viewer.summary()
