"""uvicorn's HTTP/1.1 protocol (h11) with the connection limits uvicorn lacks.

uvicorn closes a connection idle *between* requests (``timeout_keep_alive``) and answers 503 to
requests past ``limit_concurrency``, but a connection that never completes its request line and
headers (slowloris: a byte every few seconds; or nothing at all) is kept forever, and every
accepted connection holds a file descriptor however many there are. :func:`guarded_protocol`
adds a header timeout (the request line and headers must be complete within ``header_timeout_s``
of the connection opening or of the previous response), a cap on open connections (one
more gets a 503 JSON error and is closed at once), and a cap on the request line and headers
together (:data:`MAX_HEAD_BYTES`; past it 431 and the connection closed: h11's own
``max_incomplete_event_size`` bounds only a head still incomplete, so a 64 KiB head sent in one
piece passed it). The body's own limits are :mod:`.http_limits`'.

Only ``fractal-opt serve`` imports this (it needs the ``serve`` extra).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["MAX_HEAD_BYTES", "guarded_protocol", "uvicorn_options"]

MAX_HEAD_BYTES = 16 << 10  # request line + headers: h11's default incomplete-event size, as a limit on the whole head


def guarded_protocol(*, header_timeout_s: float, max_connections: int, max_head_bytes: int = MAX_HEAD_BYTES) -> type[asyncio.Protocol]:
    """An ``H11Protocol`` subclass with a header timeout, a cap on open connections and one on a
    request's head (uvicorn's ``http=``)."""

    class Guarded(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _head: bytes = b""  # the bytes of a request whose head is not complete yet (at most max_head_bytes + 4 kept)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                _refuse(transport, max_connections)
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and self._head_too_long(data):
                _refuse_head(self.transport, max_head_bytes)
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._head = b""
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # a request begun but its headers not complete yet: the clock runs
            else:
                self._disarm()  # headers complete (the body has its own deadline), or closing

        def _head_too_long(self, data: bytes) -> bool:
            """Whether the request head being received is over ``max_head_bytes`` (it ends at its
            first blank line, CRLF or bare LF, as h11 reads it)."""
            self._head += data[: max_head_bytes + 4 - len(self._head)]
            ends = [i for i in (self._head.find(b"\r\n\r\n"), self._head.find(b"\n\n")) if i >= 0]
            return (min(ends) if ends else len(self._head)) > max_head_bytes

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.logger.info("closing a connection whose request headers did not arrive within %g s", header_timeout_s)
                self.transport.close()

    return Guarded


def _refuse(transport: asyncio.Transport, limit: int) -> None:
    """Answer one connection too many with a 503 JSON error and close it."""
    _close_with(transport, "503 Service Unavailable", "server_error", "too_many_connections",
                f"too many open connections (this server holds at most {limit}; serve --max-connections); retry later", retry=True)


def _refuse_head(transport: asyncio.Transport, limit: int) -> None:
    """Answer a request whose line and headers pass ``limit`` bytes with a 431 JSON error and close."""
    _close_with(transport, "431 Request Header Fields Too Large", "invalid_request_error", "request_header_fields_too_large",
                f"the request line and headers are over {limit:,} bytes, the most this server reads")


def _close_with(transport: asyncio.Transport, status: str, kind: str, code: str, message: str, *, retry: bool = False) -> None:
    """Write one JSON error response and close the connection (written by hand: h11's state machine
    expects a whole request first, and these are answered before one is read)."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    retry_after = "retry-after: 1\r\n" if retry else ""
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{retry_after}connection: close\r\n\r\n"
    transport.write(head.encode() + body)
    transport.close()


def uvicorn_options(limits: Any) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for :class:`~.http_limits.HttpLimits`."""
    return {
        "http": guarded_protocol(header_timeout_s=limits.header_timeout_s, max_connections=limits.max_connections),
        "timeout_keep_alive": limits.keep_alive_s,
        "limit_concurrency": limits.max_connections + 1,  # uvicorn's 503 past it; the cap above refuses the connection first
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,  # a head still incomplete past it: h11's 400
    }
