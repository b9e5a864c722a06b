"""Pure ASGI middleware run before any parsing, cheapest check first: the Host allow-list (400), the
API key (401), the body size limit (413) and the body deadline (408).

- Host: a browser page on another site can reach a loopback server by DNS rebinding (its own name
  re-pointed at 127.0.0.1); it cannot choose the Host header, which stays its own name. So a server
  bound to loopback accepts only the loopback names by default (ServerLimits.allowed_hosts).
- The key: with one set, every route but /health needs it (/metrics too, unless metrics_public):
  `Authorization: Bearer KEY` (or `x-api-key: KEY`, as Anthropic's clients send it), or HTTP Basic
  with the key as the password, which is what a browser can send for the pages (/dashboard, /docs):
  their 401 asks for Basic, so the browser prompts.
- The body limit looks at Content-Length first (a declared oversize body is refused unread), then
  counts the bytes actually received (chunked bodies, lying headers) and buffers at most the limit;
  the buffered body is replayed to the app, so nothing is parsed before the limit holds. The whole
  body must arrive within body_timeout_s (a client trickling bytes holds nothing for long).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
from typing import Optional

from servescope.server.errors import ANTHROPIC_PREFIX, anthropic_error_body, error_body
from servescope.server.limits import ServerLimits

_BODY_METHODS = {"POST", "PUT", "PATCH"}
OPEN_PATHS = ("/health",)
PAGE_PREFIXES = ("/dashboard", "/docs", "/redoc", "/openapi.json")


def error_json(status: int, message: str, param, code, path: str) -> dict:
    """The error body for a request to `path` (the one place to pick an API's own error shape):
    /v1/messages speaks Anthropic's (serving_messages.py), the rest OpenAI's."""
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)


async def _send_error(send, path: str, status: int, message: str, param=None, code=None, headers=()) -> None:
    body = json.dumps(error_json(status, message, param, code, path)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def key_matches(auth: str, api_key: str) -> bool:
    """Bearer KEY, or Basic base64(any user:KEY); compared in constant time."""
    scheme, _, token = auth.partition(" ")
    token = token.strip()
    if scheme.lower() == "basic":
        try:
            token = base64.b64decode(token, validate=True).decode("utf-8").partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
    elif scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode())


class GuardMiddleware:
    def __init__(self, app, limits: Optional[ServerLimits] = None, api_key: Optional[str] = None):
        self.app = app
        self.limits = limits or ServerLimits()
        self.api_key = api_key
        self.open_paths = OPEN_PATHS + (("/metrics",) if self.limits.metrics_public else ())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.limits.host_allowed(host):
            return await _send_error(
                send,
                path,
                400,
                f"the Host {host!r} is not allowed on this server (see --allowed-hosts)",
                code="invalid_host",
            )
        if self.api_key is not None and path not in self.open_paths:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not auth and b"x-api-key" in headers:  # Anthropic's clients send the key this way
                auth = "Bearer " + headers[b"x-api-key"].decode("latin-1")
            if not key_matches(auth, self.api_key):
                msg = "missing API key (send Authorization: Bearer KEY)" if not auth else "invalid API key"
                page = path.startswith(PAGE_PREFIXES)
                challenge = b'Basic realm="servescope", charset="UTF-8"' if page else b"Bearer"
                return await _send_error(
                    send, path, 401, msg, code="invalid_api_key", headers=[(b"www-authenticate", challenge)]
                )
        if scope.get("method") not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                return await _send_error(
                    send, path, 400, "invalid Content-Length header", code="invalid_header"
                )
            if n > limit:
                return await _send_error(
                    send,
                    path,
                    413,
                    f"the request body ({n} bytes) is over the limit of {limit} bytes",
                    code="body_too_large",
                )
        try:
            body = await asyncio.wait_for(self._read_body(receive, limit), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            return await _send_error(
                send,
                path,
                408,
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                code="body_timeout",
                headers=[(b"connection", b"close")],
            )
        if body is None:
            return  # the client left before sending its body: nothing to answer
        if isinstance(body, int):
            return await _send_error(
                send, path, 413, f"the request body is over the limit of {limit} bytes", code="body_too_large"
            )
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    @staticmethod
    async def _read_body(receive, limit: int):
        """The body (bytes), its size when over the limit (int), or None when the client left."""
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > limit:
                return total
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)
