"""A real uvicorn server on 127.0.0.1 (a free port), run in a background thread."""

from servescope.server.background import BackgroundServer as LiveServer

__all__ = ["LiveServer"]
