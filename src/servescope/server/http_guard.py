"""The connection-level limits, below the ASGI app: a cap on open connections and a deadline for a
request's headers (uvicorn has neither: 12 of 12 slow clients sending a header byte every few
seconds held their connections for as long as they liked). The deadline runs from a new
connection, and from the first bytes of each later request on it (idle keep-alive connections are
uvicorn's keep-alive timeout's).

`uvicorn_options(limits)` gives the keyword arguments for uvicorn.Config / uvicorn.run: uvicorn's
h11 protocol, subclassed here, and the keep-alive timeout. The deadline for the body is the ASGI
middleware's (server/middleware.py); once the headers are in, the app owns the connection.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from servescope.server.errors import error_body
from servescope.server.limits import ServerLimits


def _raw_response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with `limits.max_connections` and `limits.header_timeout_s`."""

    limits: ServerLimits = ServerLimits()
    refused = 0  # connections answered 429 (class-wide: one server per subclass)
    header_timeouts = 0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        if len(self.connections) > self.limits.max_connections:
            type(self).refused += 1
            transport.write(
                _raw_response(
                    429,
                    "Too Many Requests",
                    f"more than {self.limits.max_connections} connections are open",
                    "too_many_connections",
                    "retry-after: 1\r\n",
                )
            )
            transport.close()
            return
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_deadline)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the first bytes of a request: its headers have a deadline
        super().data_received(data)

    def _header_deadline(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # closed, or the request's headers are in (its body has a deadline of its own)
        type(self).header_timeouts += 1
        self.transport.write(
            _raw_response(
                408,
                "Request Timeout",
                f"the request headers did not arrive within {self.limits.header_timeout_s:g} s",
                "header_timeout",
            )
        )
        self.transport.close()

    def on_response_complete(self) -> None:
        # between requests the keep-alive timeout governs; the next request's first bytes arm a deadline
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def protocol_class(limits: ServerLimits) -> type:
    """A GuardedH11Protocol subclass bound to `limits` (uvicorn builds one instance per connection)."""
    return type(
        "ServescopeH11Protocol", (GuardedH11Protocol,), {"limits": limits, "refused": 0, "header_timeouts": 0}
    )


def uvicorn_options(limits: ServerLimits) -> dict:
    return {"http": protocol_class(limits), "timeout_keep_alive": limits.keep_alive_timeout_s}
