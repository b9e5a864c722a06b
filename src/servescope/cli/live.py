"""The live dashboard for one-off runs: `generate --dashboard` serves the engine's /dashboard on a
loopback port while the run goes on (and after, until Ctrl-C or --dashboard-hold seconds)."""

from __future__ import annotations

import os
import sys
import time
from typing import Optional


def announce_dashboard(url: str, open_browser: bool = True) -> None:
    print(f"servescope: dashboard at {url}", flush=True)
    # only where a browser can show it: a desktop session (not over ssh, not in CI)
    if open_browser and (sys.platform == "darwin" or os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        import webbrowser  # start-up time of `servescope --help` (docs/BENCHMARKS.md, start-up)

        webbrowser.open(url)


def add_dashboard_args(p) -> None:
    g = p.add_argument_group("dashboard")
    g.add_argument("--dashboard", action="store_true",
                   help="serve the live dashboard of this run on a loopback port (see --dashboard-port)")
    g.add_argument("--dashboard-port", type=int, default=8000, help="default 8000 (0: any free port)")
    g.add_argument("--dashboard-hold", type=float, default=None, metavar="S",
                   help="keep the dashboard S seconds after the run (default: until Ctrl-C)")
    g.add_argument("--no-browser", action="store_true", help="do not try to open a browser")


async def _stream(async_engine, prompt, params, out):
    printed, final = 0, None
    async for o in async_engine.generate("cli-0", prompt, params):
        text = o.outputs[0].text
        if len(text) > printed:
            out.write(text[printed:])
            out.flush()
            printed = len(text)
        final = o
    out.write("\n")
    return final


class DashboardRun:
    """An engine behind an AsyncEngine and the full server app on a background loopback port."""

    def __init__(self, engine, port: int, model_name: str, open_browser: bool = True):
        # the server side (fastapi, uvicorn) only for --dashboard runs (start-up time of the CLI)
        from servescope.engine.async_engine import AsyncEngine
        from servescope.server.app import build_app
        from servescope.server.background import BackgroundServer

        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.server = BackgroundServer(build_app(self.async_engine, model_name=model_name), port=port).start()
        announce_dashboard(f"{self.server.url}/dashboard", open_browser)

    def generate(self, prompt, params, out=sys.stdout) -> tuple:
        """Like cli/generate.stream_one, through the AsyncEngine: (final RequestOutput, its steps)."""
        import asyncio  # start-up time of `servescope --help` (docs/BENCHMARKS.md, start-up)

        first_step = len(self.engine.step_records)
        final = asyncio.run(_stream(self.async_engine, prompt, params, out))
        return final, list(self.engine.step_records)[first_step:]

    def hold(self, seconds: Optional[float]) -> None:
        print(f"servescope: the dashboard stays at {self.server.url}/dashboard "
              + ("until Ctrl-C" if seconds is None else f"for {seconds:g} s"), flush=True)
        try:
            time.sleep(10 ** 9 if seconds is None else seconds)
        except KeyboardInterrupt:
            pass

    def close(self) -> None:
        self.server.stop()
        self.async_engine.shutdown()
