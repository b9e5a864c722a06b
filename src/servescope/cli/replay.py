"""`servescope replay trace.json`: play a recorded run (a --trace file) back in the dashboard."""

from __future__ import annotations

import argparse

from servescope.cli.args import positive_float
from servescope.cli.live import announce_dashboard


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a recorded trace (from --trace) in the live dashboard")
    p.add_argument("trace", help="a Chrome trace written by generate/bench --trace")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--speed", type=positive_float, default=1.0, help="times real time (default 1)")
    p.add_argument("--loop", action="store_true", help="start over at the end")
    p.add_argument("--api-key", default=None, metavar="KEY", help="require 'Authorization: Bearer KEY' on the feed")
    p.add_argument("--no-browser", action="store_true", help="do not try to open a browser")


def run(args: argparse.Namespace) -> int:
    # the server (fastapi, uvicorn) is imported once the arguments are valid: seconds of `--help`
    import uvicorn

    from servescope.server.limits import ServerLimits
    from servescope.server.replay import ReplaySource, build_replay_app
    from servescope.telemetry.trace_replay import read_recorded_run

    run_ = read_recorded_run(args.trace)
    source = ReplaySource(run_, label=args.trace, speed=args.speed, loop=args.loop)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"servescope: replaying {len(run_.steps)} steps ({run_.duration_ms / 1e3:.1f} s recorded) "
          f"at {args.speed}x", flush=True)
    announce_dashboard(f"http://{host}:{args.port}/dashboard", open_browser=not args.no_browser)
    limits = ServerLimits().for_bind(args.host)
    uvicorn.run(build_replay_app(source, api_key=args.api_key, limits=limits), host=args.host, port=args.port,
                log_level="warning", timeout_graceful_shutdown=2)
    return 0
