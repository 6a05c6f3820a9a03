"""An OpenAI-compatible HTTP endpoint on a tuned plan: ``fractal-opt serve`` (FastAPI + uvicorn).

Every request goes through the plan's own request server (``engine.server()``), so the bounded
queue, deadlines, cancellation, batching mode and response cache are the ones the run measured.
The HTTP layer only translates:

- ``POST /v1/chat/completions`` and ``/v1/completions``, streamed (SSE) or not; per request
  ``max_tokens``, ``stop``, ``stream``, ``temperature`` / ``top_p`` / ``seed`` (omitted: the
  plan's; see :mod:`.openai_requests` and :mod:`.sampling`);
- ``GET /v1/models``, ``GET /health`` (no key needed: load balancers probe it), ``GET /metrics``
  (Prometheus text, :mod:`.http_metrics`).

A client that disconnects cancels its request, which frees its slot (and KV-cache blocks) at the
next step. A full queue answers 429 (Retry-After), a closed or shutting-down server 503, a timed-out
request 503, a bad field 400 naming it (``error.param``), a request over the context cap 400
(``context_length_exceeded``); every error is OpenAI's JSON error object, never a traceback.

Importing this module needs the ``serve`` extra (fastapi, uvicorn, prometheus_client); nothing
else in fractal_opt imports it. No thread waits per request: tickets notify the event loop (``Ticket.on_change``), so fifty
streaming clients cost fifty coroutines, not fifty blocked threads.

Example:
    >>> app = create_app(engine, model_name="chatbot")            # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)             # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import RecipeError, RequestRejected
from .http_metrics import ServeMetrics
from .openai_requests import BadRequest, Parsed, parse_chat, parse_completion
from .sampling import SamplingError

__all__ = ["create_app"]

log = logging.getLogger("fractal_opt.serve")

_DISCONNECT_POLL_S = 0.1  # how often a waiting request checks whether its client is still there


def create_app(engine: Any, *, model_name: str, api_key: str | None = None, seed: int = 0) -> Any:
    """A FastAPI app serving ``engine``'s plan; its request server starts now and closes on shutdown.

    Args:
        engine: a built Engine (``Engine.from_recipe(...)``).
        model_name: the id ``/v1/models`` lists and responses carry.
        api_key: when set, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <api_key>``.
        seed: the server's sampling seed, for requests that sample and send no ``seed``.
    """
    server = engine.server(seed=seed)
    metrics = ServeMetrics(server)
    plan = engine.plan
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(server.close)  # cancels what is still queued or running

    app = FastAPI(title="fractal-opt serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.state.metrics = metrics

    def error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None,
              headers: dict[str, str] | None = None) -> Any:
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind="not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Any:
        log.error("internal error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
        return error(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")

    def unauthorized(request: Request) -> Any | None:
        if api_key is None:
            return None
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if hmac.compare_digest(given.encode(), api_key.encode()):
            return None
        return error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (fractal-opt serve --api-key)", kind="authentication_error",
                     headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health() -> Any:
        body = {"status": "closed" if server.closed else "ok", "model": model_name, "runtime": plan.hardware.runtime,
                "batching": plan.scheduling.batching, "queued": server.queued(), "live": server.live(),
                "max_queue": server.max_queue, "in_flight_limit": server.in_flight}
        return JSONResponse(body, status_code=503 if server.closed else 200)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Any:
        if (denied := unauthorized(request)) is not None:
            return denied
        text, content_type = metrics.text()
        return Response(text, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if (denied := unauthorized(request)) is not None:
            return denied
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "fractal-opt", "root": plan.source}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await answer(request, "chat.completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await answer(request, "completions")

    async def answer(request: Request, endpoint: str) -> Any:
        if (denied := unauthorized(request)) is not None:
            metrics.refused(endpoint, "unauthorized")
            return denied
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            metrics.refused(endpoint, "bad_request")
            return error(400, f"the request body is not valid JSON: {e}", param="body")
        try:
            parsed = (parse_chat if endpoint == "chat.completions" else parse_completion)(body)
        except BadRequest as e:
            metrics.refused(endpoint, "bad_request")
            return error(400, str(e), param=e.param)
        try:
            ticket = await asyncio.to_thread(server.submit, parsed.messages, max_new_tokens=parsed.max_tokens, stop=parsed.stop,
                                             temperature=parsed.temperature, top_p=parsed.top_p, seed=parsed.seed)
        except SamplingError as e:  # sampling this scheduler cannot honour per request
            metrics.refused(endpoint, "bad_request")
            return error(400, str(e), param=e.param)
        except RecipeError as e:
            metrics.refused(endpoint, "bad_request")
            return error(400, str(e), param="messages")
        except RequestRejected as e:
            if server.closed:
                metrics.refused(endpoint, "closed")
                return error(503, f"the server is shutting down: {e}", kind="server_error", code="server_shutting_down")
            metrics.refused(endpoint, "overloaded")
            return error(429, str(e), kind="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        watch = _Watch(ticket)
        try:
            if not await watch.until(lambda: ticket.status != "queued", request):
                return Response(status_code=499)  # the client left while queued: its ticket is cancelled
            if ticket.finished and ticket.status != "done" and not ticket.token_ids:
                return ended_badly(ticket)
            if parsed.stream:
                owner, watch = watch, None  # the response owns the ticket's end from here
                return _TicketStream(sse(ticket, owner, parsed, endpoint), on_close=lambda: owner.close(lambda: metrics.ended(endpoint, ticket)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            if not await watch.until(lambda: ticket.finished, request):
                return Response(status_code=499)
            if ticket.status != "done":
                return ended_badly(ticket)
            return JSONResponse(whole(ticket, parsed, endpoint))
        finally:
            if watch is not None:
                watch.close(lambda: metrics.ended(endpoint, ticket))

    def ended_badly(ticket: Any) -> Any:
        """The error response for a ticket that ended without an answer."""
        if ticket.status == "rejected":
            if server.closed:
                return error(503, f"the server is shutting down: {ticket.error}", kind="server_error", code="server_shutting_down")
            return error(400, str(ticket.error), param="messages", code="context_length_exceeded")
        if ticket.status == "timeout":
            return error(503, f"the request timed out after the plan's deadline ({plan.scheduling.timeout_s} s, queueing included); retry later",
                         kind="server_error", code="timeout", headers={"Retry-After": "1"})
        if ticket.status == "cancelled":
            return error(503, "the request was cancelled: the server is shutting down", kind="server_error", code="server_shutting_down")
        return error(500, f"generation failed: {ticket.error}", kind="server_error")

    def ids() -> tuple[str, int]:
        return uuid.uuid4().hex[:24], int(time.time())

    def usage(ticket: Any) -> dict[str, int]:
        return {"prompt_tokens": ticket.prompt_tokens, "completion_tokens": len(ticket.token_ids), "total_tokens": ticket.prompt_tokens + len(ticket.token_ids)}

    def finish_reason(ticket: Any) -> str:
        return "length" if ticket.hit_cap else "stop"

    def whole(ticket: Any, parsed: Parsed, endpoint: str) -> dict[str, Any]:
        rid, now = ids()
        text = ticket.result().text
        if endpoint == "chat.completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(ticket), "logprobs": None}
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": now, "model": model_name, "choices": [choice], "usage": usage(ticket)}
        choice = {"index": 0, "text": text, "finish_reason": finish_reason(ticket), "logprobs": None}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": now, "model": model_name, "choices": [choice], "usage": usage(ticket)}

    async def sse(ticket: Any, watch: _Watch, parsed: Parsed, endpoint: str) -> AsyncIterator[str]:
        rid, now = ids()
        chat_ = endpoint == "chat.completions"
        head = {"id": f"chatcmpl-{rid}" if chat_ else f"cmpl-{rid}", "object": "chat.completion.chunk" if chat_ else "text_completion",
                "created": now, "model": model_name}

        def chunk(text: str | None, finish: str | None = None, *, role: bool = False) -> str:
            if chat_:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        try:
            if chat_:
                yield chunk("", role=True)
            sent = ""
            while True:
                text, ended = ticket.visible_text()
                if len(text) > len(sent) and text.startswith(sent):
                    yield chunk(text[len(sent) :])
                    sent = text
                if ended:
                    break
                await watch.wait()
            if ticket.status == "done":
                yield chunk(None if chat_ else "", finish_reason(ticket))
            else:
                response = ended_badly(ticket)
                yield f"data: {response.body.decode()}\n\n"
            if parsed.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(ticket)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects (the task is cancelled): the slot is freed
            watch.close(lambda: metrics.ended(endpoint, ticket))

    class _TicketStream(StreamingResponse):
        """A streamed answer that ends its ticket however the response ends: finished, the client
        gone before the first chunk (the generator's own ``finally`` would never run), or cancelled."""

        def __init__(self, content: Any, *, on_close: Any, **kwargs: Any):
            super().__init__(content, **kwargs)
            self.on_close = on_close

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()

    return app


class _Watch:
    """Wakes a coroutine whenever its ticket changes, without a thread per request."""

    def __init__(self, ticket: Any):
        self.ticket = ticket
        self.event = asyncio.Event()
        loop = asyncio.get_running_loop()

        def changed() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody waits
                loop.call_soon_threadsafe(self.event.set)

        ticket.on_change(changed)
        self.closed = False

    async def wait(self, timeout: float = _DISCONNECT_POLL_S) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)
        self.event.clear()

    async def until(self, condition: Any, request: Any) -> bool:
        """Wait until ``condition()``; False (and the ticket cancelled) when the client left first."""
        while not condition():
            if await request.is_disconnected():
                self.ticket.cancel()
                return False
            await self.wait()
        return True

    def close(self, record: Any) -> None:
        """The request's end: cancel the ticket if it still runs, then record it (once)."""
        if self.closed:
            return
        self.closed = True
        if not self.ticket.finished:
            self.ticket.cancel()
        record()
