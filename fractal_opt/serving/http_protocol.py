"""uvicorn's HTTP/1.1 protocol (h11) with the two connection limits uvicorn lacks.

uvicorn closes a connection idle *between* requests (``timeout_keep_alive``) and answers 503 to
requests past ``limit_concurrency``, but a connection that never completes its request line and
headers (slowloris: a byte every few seconds; or nothing at all) is kept forever, and every
accepted connection holds a file descriptor however many there are. :func:`guarded_protocol`
adds a header timeout (the request line and headers must be complete within ``header_timeout_s``
of the connection opening or of the previous response) and a cap on open connections (one
more gets a 503 JSON error and is closed at once). The body's own limits are :mod:`.http_limits`'.

Only ``fractal-opt serve`` imports this (it needs the ``serve`` extra).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["guarded_protocol", "uvicorn_options"]


def guarded_protocol(*, header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """An ``H11Protocol`` subclass with a header timeout and a cap on open connections (uvicorn's ``http=``)."""

    class Guarded(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

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
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # a request begun but its headers not complete yet: the clock runs
            else:
                self._disarm()  # headers complete (the body has its own deadline), or closing

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
    """Answer one connection too many with a 503 JSON error and close it (written by hand: h11's
    state machine expects a request first, and this one is answered before it sends one)."""
    body = json.dumps({"error": {"message": f"too many open connections (this server holds at most {limit}; serve --max-connections); retry later",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "retry-after: 1\r\nconnection: close\r\n\r\n").encode()
    transport.write(head + body)
    transport.close()


def uvicorn_options(limits: Any) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for :class:`~.http_limits.HttpLimits`."""
    return {
        "http": guarded_protocol(header_timeout_s=limits.header_timeout_s, max_connections=limits.max_connections),
        "timeout_keep_alive": limits.keep_alive_s,
        "limit_concurrency": limits.max_connections + 1,  # uvicorn's 503 past it; the cap above refuses the connection first
        "h11_max_incomplete_event_size": 16 << 10,  # request line + headers: 16 KiB, h11's default, stated (431 past it)
    }
