"""GET /dashboard: a live view of the engine, fed by /v1/internals/stream.

The page is static (server/static/: HTML, one script, one stylesheet; shipped as package data, no
CDN, no build step) and holds no data, so it is served without the API key; its data comes from
/v1/internals/stream, which sits under /v1 and so needs the key when one is set (the page asks for
it and sends it as a Bearer header; EventSource cannot, so the page reads the stream with fetch).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from servescope.server.errors import error_response
from servescope.server.internals_stream import Broadcaster, FrameSource, install_internals_stream

STATIC_TYPES = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
# the page runs only its own script and style, and talks only to its own server
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def static_text(name: str) -> str:
    return resources.files("servescope.server").joinpath("static", name).read_text(encoding="utf-8")


def install_dashboard(app: FastAPI, source: FrameSource, **broadcaster_kw) -> Broadcaster:
    """Add /dashboard (the page), its static files and /v1/internals/stream (its feed) to `app`."""
    broadcaster = install_internals_stream(app, source, **broadcaster_kw)
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard():
        return HTMLResponse(static_text("dashboard.html"), headers=headers)

    @app.get("/dashboard/", include_in_schema=False)
    async def dashboard_slash():
        return RedirectResponse("/dashboard")

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str):
        if name not in STATIC_TYPES:  # a fixed list: no path ever reaches the file system
            return error_response(404, f"no dashboard file {name!r}", code="not_found")
        return Response(static_text(name), media_type=STATIC_TYPES[name], headers=headers)

    return broadcaster
