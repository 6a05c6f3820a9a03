"""What ``fractal-opt serve`` bounds on each connection and request, and the bounded body reader.

A request body is read under three limits before any JSON is parsed: its size (a Content-Length
over ``max_body_bytes`` is refused before a byte is read, a chunked body as soon as it passes
it: 413), its arrival time (a body slower than ``body_timeout_s``, or shorter than its
Content-Length, is answered 408 instead of holding the connection forever), and, once parsed, its
nesting (deeper than :data:`MAX_JSON_DEPTH`: 400). Starlette reads a body whole, with none of
these, hence this module. A request framed two ways at once (a Content-Length next to a
Transfer-Encoding: the shape of request smuggling through a proxy that reads the other one) is
refused with a 400 and its connection closed (:class:`OneFraming`), as RFC 9112 (section 6.1)
allows a server to. The connection-level limits (header timeout, keep-alive, open connections,
head size) are uvicorn's and :mod:`.http_protocol`'s.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "BodyError", "HttpLimits", "OneFraming", "read_json"]

# An OpenAI request nests 5 levels (body -> messages -> message -> content parts -> part); 32 is
# far above any client and far below what json's C decoder refuses with a RecursionError.
MAX_JSON_DEPTH = 32
_THREAD_ABOVE = 64 << 10  # bodies larger than this are parsed off the event loop (bytes)


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    """The bounds of one server; every value is finite and positive (``serve``'s flags set them).

    Attributes:
        max_body_bytes: the largest request body (4 MiB: a 128k-token prompt is ~0.5 MB of text).
        header_timeout_s: a connection must have sent its request line and headers within this
            (slowloris; also a connection that sends nothing).
        body_timeout_s: the whole body must arrive within this, from the end of the headers.
        keep_alive_s: an idle connection between requests is closed after this (uvicorn's).
        max_connections: open connections at once; one more gets 503 and is closed.
    """

    max_body_bytes: int = 4 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "header_timeout_s", "body_timeout_s", "keep_alive_s", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"HttpLimits.{name}: got {value!r}, expected a finite number > 0.")


class BodyError(Exception):
    """A body refused before it reached the request parser: ``status`` (400, 408, 413) and ``param``."""

    def __init__(self, status: int, message: str, *, param: str = "body", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class OneFraming:
    """ASGI middleware: a request with both a Content-Length and a Transfer-Encoding gets a 400 JSON
    error and ``Connection: close`` (h11 would read the body by its Transfer-Encoding, and a proxy
    in front may have read it by its Content-Length: the bytes between are another request)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                body = json.dumps({"error": {"message": "the request has both a Content-Length and a Transfer-Encoding; send one (RFC 9112 section 6.1)",
                                             "type": "invalid_request_error", "param": None, "code": "ambiguous_framing"}}).encode()
                await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


async def read_json(request: Any, limits: HttpLimits) -> Any:
    """The request's JSON body, read within ``limits``.

    Raises:
        BodyError: too large (413), too slow or cut short (408), not JSON, not UTF-8 or nested too deep (400).
        starlette.requests.ClientDisconnect: the client left while sending it.
    """
    body = await _read(request, limits)
    if len(body) > _THREAD_ABOVE:
        return await asyncio.to_thread(_parse, body)
    return _parse(body)


async def _read(request: Any, limits: HttpLimits) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > limits.max_body_bytes:
        raise BodyError(413, f"the request body is {int(length):,} bytes; this server takes at most {limits.max_body_bytes:,} (serve --max-body-mb).",
                        code="request_too_large")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout_s
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise BodyError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s (it was {size:,} bytes by then"
                                 f"{f' of {length}' if length else ''}; serve --body-timeout-s).", code="request_timeout") from None
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise BodyError(413, f"the request body is over {limits.max_body_bytes:,} bytes, the most this server takes (serve --max-body-mb).",
                            code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(body: bytes) -> Any:
    try:
        value = json.loads(body)
    except RecursionError:  # the C decoder's guard: nesting that would overflow the stack
        raise BodyError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(400, f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits: 4300)
        raise BodyError(400, f"the request body holds a number Python will not read: {e}") from None
    stack = [(value, 1)]  # a stack of our own: no nesting reaches Python's recursion limit
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BodyError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels.")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return value
