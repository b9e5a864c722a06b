"""Pure ASGI middleware run before any parsing: the API key check (401) and the body size limit (413).

The body limit looks at Content-Length first (a declared oversize body is refused unread), then
counts the bytes actually received (chunked bodies, lying headers) and buffers at most the limit;
the buffered body is replayed to the app, so nothing is parsed before the limit holds.
"""

from __future__ import annotations

import hmac
import json
from typing import Optional

from servescope.server.errors import ANTHROPIC_PREFIX, anthropic_error_body, error_body

_BODY_METHODS = {"POST", "PUT", "PATCH"}


async def _send_error(send, status: int, message: str, param=None, code=None, headers=(),
                      path: str = "") -> None:
    # /v1/messages speaks Anthropic's error shape (serving_messages.py), the rest OpenAI's
    if path.startswith(ANTHROPIC_PREFIX):
        err = anthropic_error_body(status, message)
    else:
        err = error_body(status, message, param, code)
    body = json.dumps(err).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app, max_body_bytes: Optional[int] = None, api_key: Optional[str] = None,
                 protected_prefix: str = "/v1"):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.protected_prefix = protected_prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith(self.protected_prefix):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if b"x-api-key" in headers and not auth:  # Anthropic's clients send the key this way
                scheme, token = "bearer", headers[b"x-api-key"].decode("latin-1")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                msg = "missing API key (send Authorization: Bearer KEY)" if not auth else "invalid API key"
                return await _send_error(send, 401, msg, code="invalid_api_key",
                                         headers=[(b"www-authenticate", b"Bearer")], path=path)
        if self.max_body_bytes is None or scope.get("method") not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                return await _send_error(send, 400, "invalid Content-Length header", code="invalid_header",
                                         path=path)
            if n > limit:
                return await _send_error(send, 413, f"the request body ({n} bytes) is over the limit of {limit} bytes",
                                         code="body_too_large", path=path)
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            body = msg.get("body", b"")
            total += len(body)
            if total > limit:
                return await _send_error(send, 413, f"the request body is over the limit of {limit} bytes",
                                         code="body_too_large", path=path)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
