"""BackgroundServer: a uvicorn server in a daemon thread on a socket bound up front (port 0: any
free one), so that the caller knows the URL before serving starts. Used by one-off runs that show
the dashboard (`generate --dashboard`) and by the tests."""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional

import uvicorn

from servescope.server.http_guard import uvicorn_options
from servescope.server.limits import ServerLimits


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, limits: Optional[ServerLimits] = None,
                 keep_alive_s: Optional[float] = 30.0):
        """limits: the connection limits (default: the app's own, app.state.limits, else the defaults).
        keep_alive_s: idle keep-alive connections stay this long (None: the limits' keep_alive_timeout_s);
        long, because a client without retries that reuses a connection as the server closes it fails."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        limits = limits or getattr(getattr(app, "state", None), "limits", None) or ServerLimits()
        options = uvicorn_options(limits)
        if keep_alive_s is not None:
            options["timeout_keep_alive"] = keep_alive_s
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2, **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
