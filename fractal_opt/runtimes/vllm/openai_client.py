"""A minimal client of an OpenAI-compatible server (vLLM's), on the standard library only.

Why not the ``openai`` package or httpx: the runtime needs exactly three calls (list models,
stream a completion of a token-id prompt, one completion with prompt log-probabilities), a clock reading taken
the moment each streamed chunk arrives, and a way for another thread to cut a stream short
(cancel); ``http.client`` gives all three with no dependency in the project's environment.

Example:
    >>> client = OpenAIClient("http://127.0.0.1:8000")               # doctest: +SKIP
    >>> for chunk in client.stream_completion([1, 9690, 198], {"max_tokens": 8}):  # doctest: +SKIP
    ...     print(chunk.text, chunk.t)
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...core.errors import EngineError, RequestRejected

__all__ = ["Chunk", "OpenAIClient", "Stream"]


@dataclass
class Chunk:
    """One streamed event: new text and token ids, with the perf_counter reading at its arrival."""

    t: float
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # vLLM sends them on the first chunk (return_token_ids)
    finish_reason: str | None = None  # "stop" (end-of-sequence / stop string) | "length" (the budget)
    usage: dict[str, int] | None = None  # the last chunk (stream_options.include_usage)


class Stream:
    """An open streaming response; iterate it for :class:`Chunk` s, :meth:`cancel` from any thread.

    Closing the connection is how an OpenAI client cancels: vLLM aborts a request whose client
    disconnected and frees its KV-cache blocks.
    """

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse):
        self._conn = conn
        self._response = response
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Cut the stream: the reading thread's iteration ends at once."""
        self._cancelled.set()
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks a thread waiting in readline()
            except OSError:
                pass

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while not self._cancelled.is_set():
                try:
                    line = self._response.readline()
                except (OSError, http.client.HTTPException, ValueError):
                    if self._cancelled.is_set():
                        return
                    raise
                now = time.perf_counter()  # the arrival of this chunk: the token's clock reading
                if not line:
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators and SSE comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                chunk = _parse(json.loads(data), now)
                if chunk is not None:
                    yield chunk
        finally:
            self._conn.close()


def _parse(event: dict[str, Any], now: float) -> Chunk | None:
    if "error" in event:
        raise EngineError(f"the OpenAI server sent an error in the stream: {event['error']}")
    chunk = Chunk(t=now, usage=event.get("usage"), prompt_token_ids=event.get("prompt_token_ids"))
    for choice in event.get("choices") or ():
        if choice.get("prompt_token_ids") is not None:  # a completions stream names them in its first choice
            chunk.prompt_token_ids = choice["prompt_token_ids"]
        delta = choice.get("delta") or {}
        chunk.text += delta.get("content") or choice.get("text") or ""
        chunk.token_ids.extend(choice.get("token_ids") or delta.get("token_ids") or ())
        chunk.finish_reason = choice.get("finish_reason") or chunk.finish_reason
    return chunk


class OpenAIClient:
    """Talks to one server at ``base_url`` (``http://host:port``, with or without ``/v1``).

    Args:
        base_url: where the server listens.
        model: the served model's id (None: the first one ``/v1/models`` lists).
        timeout_s: socket timeout per read, so a hung server surfaces as an error (s).
    """

    def __init__(self, base_url: str, *, model: str | None = None, timeout_s: float = 600.0):
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise EngineError(f"runtime_url={base_url!r}: expected http://host:port of an OpenAI-compatible server")
        self.base_url = base_url.rstrip("/")
        self._scheme, self._host, self._port = parsed.scheme, parsed.hostname, parsed.port
        self._prefix = parsed.path.rstrip("/").removesuffix("/v1")
        self.model = model
        self.timeout_s = timeout_s

    def _conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=timeout or self.timeout_s)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout: float | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._conn(timeout)
        payload = json.dumps(body) if body is not None else None
        try:
            conn.request(method, self._prefix + path, payload, {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"})
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise EngineError(f"{method} {self.base_url}{path} failed: {e}") from e
        if response.status != 200:
            detail = response.read().decode(errors="replace")[:500]
            conn.close()
            if response.status == 400 and "maximum context length" in detail:  # vLLM's words for a request over max_model_len
                raise RequestRejected(f"{method} {self.base_url}{path}: the request does not fit the model's context: {detail}")
            raise EngineError(f"{method} {self.base_url}{path} answered HTTP {response.status}: {detail}")
        return conn, response

    def get_json(self, path: str, *, timeout: float | None = None) -> dict[str, Any]:
        conn, response = self._request("GET", path, timeout=timeout)
        try:
            return json.loads(response.read())
        finally:
            conn.close()

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn, response = self._request("POST", path, body)
        try:
            return json.loads(response.read())
        finally:
            conn.close()

    def models(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """``/v1/models``: what the server serves (vLLM adds ``max_model_len``)."""
        return list(self.get_json("/v1/models", timeout=timeout).get("data") or [])

    def resolve_model(self) -> str:
        """The model id requests name: the one given, else the server's first."""
        if self.model is None:
            served = self.models()
            if not served:
                raise EngineError(f"{self.base_url}/v1/models lists no model")
            self.model = str(served[0]["id"])
        return self.model

    def stream_completion(self, prompt: list[int], params: dict[str, Any]) -> Stream:
        """Open a streaming ``/v1/completions`` of a token-id ``prompt`` (rendered by fractal_opt:
        the server applies no chat template of its own); returns once the server accepted it."""
        body = {"model": self.resolve_model(), "prompt": prompt, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True, **params}
        return Stream(*self._request("POST", "/v1/completions", body))

    def wait_ready(self, *, timeout_s: float, alive: Any = None, poll_s: float = 0.5) -> float:
        """Poll ``/v1/models`` until it answers; returns the seconds waited.

        Args:
            timeout_s: give up after this many seconds.
            alive: a callable returning False once the server process has died (stop at once).

        Raises:
            EngineError: the server died or did not answer within ``timeout_s``.
        """
        start = time.perf_counter()
        last: Exception | None = None
        while time.perf_counter() - start < timeout_s:
            if alive is not None and not alive():
                raise EngineError(f"the server at {self.base_url} exited before it was ready")
            try:
                self.models(timeout=2.0)
                return time.perf_counter() - start
            except EngineError as e:
                last = e
            time.sleep(poll_s)
        raise EngineError(f"the server at {self.base_url} was not ready after {timeout_s:.0f} s (last error: {last})")
