"""An OpenAI-compatible HTTP endpoint on a tuned plan: ``fractal-opt serve`` (FastAPI + uvicorn).

Every request goes through the plan's own request server (``engine.server()``), so the bounded
queue, deadlines, cancellation, batching mode and response cache are the ones the run measured.
The HTTP layer only translates:

- ``POST /v1/chat/completions`` and ``/v1/completions``, streamed (SSE) or not; per request
  ``max_tokens``, ``stop``, ``stream``, ``temperature`` / ``top_p`` / ``seed`` (omitted: the
  plan's); every other field is honoured or refused by name (:mod:`.openai_requests`);
- ``GET /v1/models``, ``GET /health`` (no key needed: load balancers probe it; 503 whenever the
  engine cannot serve, :meth:`~fractal_opt.engine.protocol.Engine.health`), ``GET /metrics``
  (Prometheus text, :mod:`.http_metrics`).

A client that disconnects cancels its request, which frees its slot (and KV-cache blocks) at the
next step. Every request is bounded before it is queued (:mod:`.bounds`): a prompt over the
model's context (or the plan's context cap) is a 400 naming both numbers
(``context_length_exceeded``), ``max_tokens`` over the context left or the plan's cap a 400 naming
them (unless the app honours or lowers it: ``over_cap``). A full queue answers 429 (Retry-After), a
closed or shutting-down server 503, a request past its deadline (the plan's ``timeout_s``) 503 when
it has no token yet, else its tokens so far with ``finish_reason`` ``"length"`` and
``incomplete_details`` saying why; an engine that cannot serve (a child server restarting) 503, a
bad field 400 naming it (``error.param``), a body too large 413, too slow 408, nested too deep 400
(:mod:`.http_limits`); every error is OpenAI's JSON error object, never a traceback, and never the
engine's internals (those go to the log).

Importing this module needs the ``serve`` extra (fastapi, uvicorn, prometheus_client); nothing
else in fractal_opt imports it. No thread waits per request: tickets notify the event loop
(``Ticket.on_change``), so fifty streaming clients cost fifty coroutines, not fifty blocked threads.

Example:
    >>> app = create_app(engine, model_name="chatbot")            # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)             # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..core.errors import BadRequest, EngineError, RecipeError, RequestRejected
from ..engine.protocol import as_request
from .bounds import OVER_CAP, OverCap, bound
from .http_limits import BodyError, HttpLimits, OneFraming, read_json
from .http_metrics import ServeMetrics
from .http_stream import TicketStream, Watch, sse, whole
from .openai_requests import Parsed, parse_chat, parse_completion
from .ticket import Ticket

__all__ = ["create_app"]

log = logging.getLogger("fractal_opt.serve")

_HEALTH_POLL_S = 1.0  # how often the app asks the engine whether it can still serve


@dataclass
class _Service:
    """What the routes share: the engine, its request server and metrics, and the app's settings."""

    engine: Any
    server: Any
    metrics: ServeMetrics
    model_name: str
    api_key: str | None
    limits: HttpLimits
    over_cap: OverCap
    ignore_eos: bool
    timeout_s: float | None
    created: int
    unavailable: str | None = None  # the engine's last health reading (every second): why it cannot serve now

    @property
    def plan(self) -> Any:
        return self.engine.plan

    def unauthorized(self, request: Request) -> Any | None:
        if self.api_key is None:
            return None
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if hmac.compare_digest(given.encode(), self.api_key.encode()):
            return None
        return error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (fractal-opt serve --api-key)", kind="authentication_error",
                     headers={"WWW-Authenticate": "Bearer"})


def error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error object."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status, headers=headers)


def create_app(engine: Any, *, model_name: str, api_key: str | None = None, seed: int = 0, limits: HttpLimits | None = None,
               over_cap: OverCap = "refuse", ignore_eos: bool = False, timeout_s: float | None = None,
               on_fatal: Callable[[str], None] | None = None) -> Any:
    """A FastAPI app serving ``engine``'s plan; its request server starts now and closes on shutdown.

    Args:
        engine: a built Engine (``Engine.from_recipe(...)``).
        model_name: the id ``/v1/models`` lists, responses carry and requests must name (or omit).
        api_key: when set, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <api_key>``.
        seed: the server's sampling seed, for requests that sample and send no ``seed``.
        limits: body size and arrival time (:class:`~.http_limits.HttpLimits`; its connection
            limits are for uvicorn: :func:`.http_protocol.uvicorn_options`).
        over_cap: a ``max_tokens`` above the plan's ``application.max_new_tokens``: refused with
            a 400 naming the cap, honoured, or lowered to it (``"cap"``, which also lowers one over
            the context left instead of refusing it) (:func:`.bounds.bound`).
        ignore_eos: every answer runs to its ``max_tokens`` (benchmarks with fixed output lengths).
        timeout_s: each request's deadline from its arrival, queueing and generation included (None:
            the plan's ``scheduling.timeout_s``); past it an answer ends with its tokens so far.
        on_fatal: called once with the reason when the engine says it will never serve again
            (its health check raises); the server should then exit non-zero.
    """
    if over_cap not in OVER_CAP:
        raise ValueError(f"create_app: over_cap {over_cap!r}, expected one of {list(OVER_CAP)}")
    if timeout_s is not None and not (timeout_s > 0 and timeout_s != float("inf")):
        raise ValueError(f"create_app: timeout_s {timeout_s!r}, expected a finite number of seconds > 0, or None")
    server = engine.server(seed=seed, ignore_eos=ignore_eos)
    svc = _Service(engine=engine, server=server, metrics=ServeMetrics(server), model_name=model_name, api_key=api_key, limits=limits or HttpLimits(),
                   over_cap=over_cap, ignore_eos=ignore_eos, timeout_s=timeout_s, created=int(time.time()))
    app = FastAPI(title="fractal-opt serve", lifespan=_lifespan(svc, on_fatal), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server, app.state.metrics, app.state.service = server, svc.metrics, svc
    app.add_middleware(OneFraming)
    _error_handlers(app)
    _info_routes(app, svc)
    _completion_routes(app, svc)
    return app


def _lifespan(svc: _Service, on_fatal: Callable[[str], None] | None) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await asyncio.to_thread(_warm_up, svc.engine)  # before the first client: a tokenizer may take seconds to load
        watcher = asyncio.create_task(_watch_health(svc, on_fatal))
        try:
            yield
        finally:
            watcher.cancel()
            await asyncio.to_thread(svc.server.close)  # cancels what is still queued or running

    return lifespan


def _context_tokens(engine: Any) -> int | None:
    """The tokens one request may hold (prompt and answer), or None when the engine does not say (or cannot now)."""
    try:
        limit = engine.context_limit()
    except EngineError:
        return None
    return limit.tokens if limit is not None else None


def _warm_up(engine: Any) -> None:
    """Ask the engine once what bounding a request asks of it (its context limit, a prompt's count),
    so what that loads (the model's tokenizer) is loaded at start-up; a failure is logged, and
    requests meet it again (each answered with the error)."""
    try:
        if engine.context_limit() is not None:
            engine.count_prompt(as_request("hello"))
    except EngineError as e:
        log.error("bounding requests will fail: %s", e)


async def _watch_health(svc: _Service, on_fatal: Callable[[str], None] | None) -> None:
    """Ask the engine every second whether it can serve (``svc.unavailable``, which failed requests
    are answered by); the first "never again" is passed to ``on_fatal``."""
    while True:
        await asyncio.sleep(_HEALTH_POLL_S)
        try:
            svc.unavailable = await asyncio.to_thread(svc.engine.health)
        except EngineError as e:
            svc.unavailable = str(e)
            log.error("the engine cannot serve any more: %s", e)
            if on_fatal is not None:
                on_fatal(str(e))
            return


def _error_handlers(app: Any) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind="not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Any:
        log.error("internal error on %s", request.url.path, exc_info=exc)  # the whole story goes to the log, not to the client
        return error(500, f"internal error ({type(exc).__name__}); the server's log has the details", kind="server_error")


def _info_routes(app: Any, svc: _Service) -> None:
    @app.get("/health")
    async def health() -> Any:
        status, reason = "ok", None
        try:
            reason = await asyncio.to_thread(svc.engine.health)
        except EngineError as e:
            status, reason = "failed", str(e)
        if svc.server.closed:
            status, reason = "closed", reason or "the request server is closed"
        elif reason is not None and status == "ok":
            status = "unavailable"
        plan = svc.plan
        limit = await asyncio.to_thread(_context_tokens, svc.engine) if status == "ok" else None
        body = {"status": status, "reason": reason, "model": svc.model_name, "runtime": plan.hardware.runtime, "batching": plan.scheduling.batching,
                "queued": svc.server.queued(), "live": svc.server.live(), "max_queue": svc.server.max_queue, "in_flight_limit": svc.server.in_flight,
                "context_tokens": limit}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Any:
        if (denied := svc.unauthorized(request)) is not None:
            return denied
        text, content_type = svc.metrics.text()
        return Response(text, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if (denied := svc.unauthorized(request)) is not None:
            return denied
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": svc.created, "owned_by": "fractal-opt"}]}


def _completion_routes(app: Any, svc: _Service) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await _answer(svc, request, "chat.completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _answer(svc, request, "completions")


async def _answer(svc: _Service, request: Request, endpoint: str) -> Any:
    """One completion request: checked, submitted, then answered whole or streamed."""
    if (denied := svc.unauthorized(request)) is not None:
        svc.metrics.refused(endpoint, "unauthorized")
        return denied
    parsed = await _parsed(svc, request, endpoint)
    if not isinstance(parsed, Parsed):
        svc.metrics.refused(endpoint, "bad_request")
        return parsed
    ticket = await _submit(svc, parsed, endpoint)
    if not isinstance(ticket, Ticket):
        return ticket  # the refusal (400 / 429 / 503)
    return await _respond(svc, request, ticket, parsed, endpoint)


async def _parsed(svc: _Service, request: Request, endpoint: str) -> Parsed | Any:
    """The checked request, or the error response refusing it."""
    try:
        body = await read_json(request, svc.limits)
    except BodyError as e:
        close = {"Connection": "close"} if e.status in (408, 413) else None  # the rest of the body is never read
        return error(e.status, str(e), param=e.param, code=e.code, headers=close)
    except ClientDisconnect:
        return Response(status_code=499)
    try:
        return (parse_chat if endpoint == "chat.completions" else parse_completion)(body, served=svc.model_name, ignore_eos=svc.ignore_eos)
    except BadRequest as e:
        return error(400, str(e), param=e.param, code=e.code)


async def _submit(svc: _Service, parsed: Parsed, endpoint: str) -> Any:
    """The ticket of a submitted request, or the error response refusing it."""
    try:
        return await asyncio.to_thread(_bounded_submit, svc, parsed)
    except BadRequest as e:  # over the context or the cap, or sampling this scheduler cannot honour per request
        svc.metrics.refused(endpoint, "bad_request")
        return error(400, str(e), param=e.param, code=e.code)
    except RecipeError as e:
        svc.metrics.refused(endpoint, "bad_request")
        return error(400, str(e), param="messages")
    except RequestRejected as e:
        if svc.server.closed:
            svc.metrics.refused(endpoint, "closed")
            return error(503, f"the server is shutting down: {e}", kind="server_error", code="server_shutting_down")
        svc.metrics.refused(endpoint, "overloaded")
        return error(429, str(e), kind="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    except EngineError as e:  # bounding it failed: the model's tokenizer, a model server that cannot answer
        svc.metrics.refused(endpoint, "error")
        return _failed(svc, "request", e)


def _bounded_submit(svc: _Service, parsed: Parsed) -> Ticket:
    """Bound the request (:func:`.bounds.bound`: its prompt counted once, before any compute), then
    submit it with the budget that gives; raises what either raises."""
    request = as_request(parsed.messages, where="messages")
    bounded = bound(svc.engine, request, max_tokens=parsed.max_tokens, field=parsed.max_tokens_field, over_cap=svc.over_cap)
    return svc.server.submit(request, max_new_tokens=bounded.max_new_tokens, timeout_s=svc.timeout_s, stop=parsed.stop, temperature=parsed.temperature,
                             top_p=parsed.top_p, seed=parsed.seed, over_cap=True)  # the budget is final: bound applied the plan's cap


async def _respond(svc: _Service, request: Request, ticket: Any, parsed: Parsed, endpoint: str) -> Any:
    """Wait for ``ticket`` and answer: JSON once it ends, or SSE from its first token."""
    watch: Watch | None = Watch(ticket)
    record = lambda: svc.metrics.ended(endpoint, ticket)  # noqa: E731
    try:
        if not await watch.until(lambda: ticket.status != "queued", request):
            return Response(status_code=499)  # the client left while queued: its ticket is cancelled
        if ticket.finished and not _answered(ticket):
            return _ended_badly(svc, ticket)
        if parsed.stream:
            owner, watch = watch, None  # the response owns the ticket's end from here
            events = sse(ticket, owner, parsed, endpoint, svc.model_name, failed=lambda t: _ended_badly(svc, t), record=record)
            return TicketStream(events, on_close=lambda: owner.close(record), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if not await watch.until(lambda: ticket.finished, request):
            return Response(status_code=499)
        if not _answered(ticket):
            return _ended_badly(svc, ticket)
        return JSONResponse(whole(ticket, endpoint, svc.model_name))
    finally:
        if watch is not None:
            watch.close(record)


def _answered(ticket: Any) -> bool:
    """Whether a finished ticket is answered with its tokens: done, or past its deadline with some
    (the answer then ends with finish_reason "length" and says why: :func:`.http_stream.incomplete`)."""
    return ticket.status == "done" or (ticket.status == "timeout" and bool(ticket.token_ids))


def _ended_badly(svc: _Service, ticket: Any) -> Any:
    """The error response for a ticket that ended without an answer."""
    if ticket.status == "rejected":
        if svc.server.closed:
            return error(503, f"the server is shutting down: {ticket.error}", kind="server_error", code="server_shutting_down")
        return error(400, str(ticket.error), param="messages", code="context_length_exceeded")
    if ticket.status == "timeout":
        return error(503, f"the request timed out before its first token, after its deadline ({_deadline(svc)}, queueing included); retry later",
                     kind="server_error", code="timeout", headers={"Retry-After": "1"})
    if ticket.status == "cancelled":
        return error(503, "the request was cancelled: the server is shutting down", kind="server_error", code="server_shutting_down")
    return _failed(svc, f"request {ticket.request.id}", ticket.error)


def _failed(svc: _Service, what: str, cause: BaseException | None) -> Any:
    """The error response for a request the engine failed: 503 while it cannot serve, else a short 500."""
    log.error("%s failed: %s", what, cause)  # the whole error (a child's log tail) for the operator only
    if svc.unavailable is not None:
        return error(503, f"the model server cannot answer now ({svc.unavailable}); retry later", kind="server_error", code="engine_unavailable",
                     headers={"Retry-After": "2"})
    first = str(cause).split("\n", 1)[0]
    return error(500, f"generation failed: {first[:200]}{'...' if len(first) > 200 else ''}", kind="server_error")


def _deadline(svc: _Service) -> str:
    """The deadline requests get, and where it is set."""
    if svc.timeout_s is not None:
        return f"{svc.timeout_s:g} s, serve --timeout-s"
    return f"{svc.plan.scheduling.timeout_s or 0:g} s, the plan's scheduling.timeout_s"
