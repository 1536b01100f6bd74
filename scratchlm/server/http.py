"""uvicorn settings and a guarded h11 protocol: header timeouts, 431 for oversized heads (issue 16).

uvicorn's h11 protocol has no time limit on receiving a request head (its keep-alive timer is reset by
every byte, so a client trickling one header byte at a time holds a connection forever), and it answers
an over-long head with a plain 400. :class:`GuardedH11Protocol` adds:

- a header timeout: a connection that has not completed a request head within ``header_timeout_s``
  of connecting (or of its previous response) gets ``408`` (when it sent part of a head) and is closed;
- ``431 Request Header Fields Too Large`` when the head exceeds ``max_header_bytes`` (h11's
  ``max_incomplete_event_size``, the same condition h11 itself tags with status hint 431).

Both answers carry an OpenAI-shaped JSON error body and ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with a request-head timeout and 431 for oversized heads."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 16384

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a request is being served (or the connection is gone): not a slow head
        if self.cycle is not None and not self.cycle.response_complete:
            return
        if self.conn.trailing_data[0]:  # part of a head arrived, never the end of it
            self._send_error(408, f"The request head was not complete within {self.header_timeout_s:g} s.",
                             "header_timeout")
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this for every h11.RemoteProtocolError; the oversized-head one is h11's 431
        if len(self.conn.trailing_data[0]) > self.max_header_bytes:
            self._send_error(431, f"The request line and headers are larger than {self.max_header_bytes} bytes.",
                             "headers_too_large")
            return
        self._send_error(400, f"Invalid HTTP request: {msg}", "invalid_http")

    def _send_error(self, status: int, message: str, code: str) -> None:
        """Write a complete response by hand (h11 refuses to answer a request it never fully received), then
        close the connection."""
        body = _error_body(message, code)
        reason = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}[status]
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()


def protocol_class(header_timeout_s: float, max_header_bytes: int) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol subclass with these limits (uvicorn instantiates the class it is given)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "max_header_bytes": int(max_header_bytes)})


def uvicorn_options(config: Any) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments that enforce a ServerConfig's connection limits."""
    return dict(http=protocol_class(config.header_timeout_s, config.max_header_bytes),
                h11_max_incomplete_event_size=int(config.max_header_bytes),
                timeout_keep_alive=config.keep_alive_timeout_s)
