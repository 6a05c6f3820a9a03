"""Serving: a small request server over an Engine, scheduled as the plan's scheduling section says.

``server = engine.server()`` starts one worker; ``ticket = server.submit(request)`` (a user
message, a list of chat messages or a Request) returns at once; ``ticket.result()`` waits for the
answer (an :class:`~fractal_opt.engine.protocol.Generation` with a clock reading per token);
iterating a ticket (``for token_id in ticket`` or ``async for``) streams token ids as the caller
receives them, and ``ticket.text_deltas()`` (or ``atext_deltas()``) the text they add;
``ticket.cancel()`` stops it; ``server.close()`` ends the worker.

This module knows no runtime: it asks the engine only what :class:`~fractal_opt.engine.protocol.Engine`
declares (``closed``, ``budget``, ``decode``, ``lookup_response`` / ``store_response``). Each
runtime subclasses :class:`Server` with its scheduler (``_run``) and feeds tickets through their
server-side methods (``_start``, ``_add``, ``_end``).

Modes (``plan.scheduling.batching``):

- ``sequential``: one request at a time, in arrival order.
- ``static``: the worker takes up to ``batch_size`` queued requests, waiting at most
  ``max_wait_ms`` for the batch to fill, and runs them as one left-padded ``generate`` call. A row
  that ends early (end-of-sequence, its own budget, cancel, timeout) is answered at once, but its
  slot in the batch is only freed when the whole batch ends.
- ``continuous``: requests join and leave the running batch at every step (in the transformers
  runtime, its own continuous batching on a paged KV cache, whose blocks a cancelled or timed-out
  request frees at the next step; llama.cpp and vLLM batch continuously themselves).

Every mode has a bounded queue: a full queue raises :class:`~fractal_opt.core.errors.RequestRejected`
instead of growing. Ticket states: queued -> running -> done | timeout | cancelled | error, or
rejected at submission. Every ticket ends exactly once.

Example:
    >>> server = engine.server()                                      # doctest: +SKIP
    >>> ticket = server.submit([{"role": "user", "content": "What is the capital of France?"}])  # doctest: +SKIP
    >>> print("".join(ticket.text_deltas())); server.close()          # doctest: +SKIP
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.errors import BadRequest, EngineError, RequestRejected
from ..engine.protocol import Generation, as_request
from ..workloads.workload import Request
from .sampling import Decoding, Sampling, check, decoding, differs
from .ticket import TERMINAL, Ticket

if TYPE_CHECKING:
    from ..engine.protocol import Engine

__all__ = ["TERMINAL", "Server", "Ticket", "in_flight_limit", "serve_all"]

_POLL_S = 0.02  # how often idle workers look for expired deadlines (s): 20 ms bounds a timeout's lateness
_CONTINUOUS_DEFAULT_IN_FLIGHT = 16  # requests in the running batch when the plan sets no limit


def in_flight_limit(scheduling: Any) -> int:
    """Requests a server runs at once for a plan's scheduling section."""
    if scheduling.batching == "sequential":
        return 1
    if scheduling.batching == "static":
        return min(scheduling.batch_size, scheduling.max_concurrency or scheduling.batch_size)
    return scheduling.max_concurrency or _CONTINUOUS_DEFAULT_IN_FLIGHT


class Server:
    """Base of the three schedulers: a bounded queue of tickets and one worker thread.

    Args:
        engine: a built Engine; the server asks it only what the Engine protocol declares.
        seed: the sampling seed of every generate call (sampling plans).
        ignore_eos: generate every request's full budget (benchmarks with fixed output lengths):
            end-of-sequence is generated like any token but ends nothing, in every mode.
    """

    def __init__(self, engine: Engine, *, seed: int = 0, ignore_eos: bool = False):
        if engine.closed:
            raise EngineError("the engine is closed: build a new one with Engine.build(plan)")
        self.engine = engine
        self.plan = engine.plan
        self.seed = seed
        self.ignore_eos = ignore_eos
        sched = self.plan.scheduling
        self.max_queue = sched.max_queue
        self.in_flight = in_flight_limit(sched)
        self._queue: queue.Queue[Ticket] = queue.Queue(maxsize=sched.max_queue)
        self._live: dict[str, Ticket] = {}  # every ticket not yet finished, by key
        self._live_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._guarded_run, name=f"fractal-opt-{sched.batching}", daemon=True)
        self._started = False  # set, under _admission, once the worker thread has started
        # One lock around "closed?", starting the worker and registering + queueing a ticket, which
        # close() takes to mark the server closed and collect the live tickets: a ticket is either
        # live before close() looks (and close cancels it) or sees the server closed (rejected).
        self._admission = threading.Lock()

    # ------------------------------------------------------------------ public
    def submit(self, request: Request | str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None, timeout_s: float | None = None,
               stop: Sequence[str] = (), temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
               over_cap: bool = False) -> Ticket:
        """Queue a request (a user message, a list of ``{"role", "content"}`` chat messages or a
        Request) and return its ticket at once.

        ``timeout_s`` (default: the plan's ``timeout_s``) counts from now, queueing included.
        ``stop``: this request's own stop sequences, on top of the plan's: the answer ends before
        the first one that appears (the ticket cuts it and frees the request's slot).
        ``temperature`` / ``top_p`` / ``seed``: this request's own sampling (None: the plan's, and
        the server's seed); temperature 0 is greedy, above 0 samples even on a greedy plan
        (:func:`~fractal_opt.serving.sampling.decoding`). A request whose sampling differs from the
        plan's bypasses the response cache. ``over_cap``: ``max_new_tokens`` is honoured above the
        plan's own cap (``application.max_new_tokens``), which otherwise lowers it.

        Safe to call from any thread, also while another thread closes the server: the ticket is
        then rejected or cancelled, never left queued.

        Raises:
            RequestRejected: the queue holds ``max_queue`` requests already, or the server is closed;
                the exception's ``ticket`` attribute is the rejected ticket.
            RecipeError: the chat messages are not ``{"role", "content"}`` mappings.
            BadRequest: a sampling value out of range, or one this scheduler cannot honour per
                request (``param`` names the field).
        """
        request = as_request(request, where="submit()")
        sampling = check(temperature, top_p, seed)
        if (why := self.sampling_refused(sampling)) is not None:
            raise BadRequest(*why)
        timeout_s = timeout_s if timeout_s is not None else self.plan.scheduling.timeout_s
        ticket = self._ticket(request, max_new_tokens=max_new_tokens, timeout_s=timeout_s, over_cap=over_cap)
        ticket.sampling = sampling
        if stop:
            ticket.request_stops = tuple(s for s in stop if s)
            ticket.stops = (*ticket.stops, *ticket.request_stops)
        if self._closed.is_set():
            self._reject(ticket, f"request {request.id!r} rejected: the server is closed")
        if self._answer_from_cache(ticket):  # the plan's response cache answers: no queue, no model
            return ticket
        with self._admission:
            if self._closed.is_set():  # close() ran while the cache was consulted
                self._reject(ticket, f"request {request.id!r} rejected: the server is closed")
            if not self._started:
                self._thread.start()
                self._started = True
            with self._live_lock:  # live before queued: the worker may end it at once
                self._live[ticket.key] = ticket
            if not self._put(ticket):
                self._forget(ticket)
                msg = (f"request {request.id!r} rejected: the queue is full ({self.max_queue} requests waiting, "
                       f"{self.in_flight} in flight). Retry later, or raise the queue pass's max_queue.")
                self._reject(ticket, msg)
        return ticket

    def close(self, *, timeout: float = 30.0) -> None:
        """Cancel every queued and running request and stop the worker (waits up to ``timeout`` s).

        Safe at any moment and more than once: before the first submit, during one, while requests run.
        """
        with self._admission:
            self._closed.set()
            started = self._started
        with self._live_lock:
            live = list(self._live.values())
        for t in live:
            t.cancel()
        if started and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise EngineError(f"the {self.plan.scheduling.batching} server did not stop within {timeout} s")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def live(self) -> int:
        """Requests queued or running now."""
        with self._live_lock:
            return len(self._live)

    def queued(self) -> int:
        """Requests waiting for a slot now (the queue depth a load balancer watches)."""
        with self._live_lock:
            return sum(1 for t in self._live.values() if t.status == "queued")

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the worker died): submit rejects every request."""
        return self._closed.is_set()

    def decoding(self, ticket: Ticket) -> Decoding:
        """What ``ticket`` is decoded with: its own sampling fields over the plan's and this server's seed."""
        return decoding(self.plan.application, ticket.sampling, seed=self.seed)

    def sampling_refused(self, sampling: Sampling) -> tuple[str, str] | None:
        """``(field, why)`` when this scheduler cannot decode a request with ``sampling``, else None
        (every scheduler but transformers' continuous batching honours all three)."""
        return None

    # ------------------------------------------------------------------ for subclasses
    def _run(self) -> None:
        raise NotImplementedError

    def _ticket(self, request: Request, *, max_new_tokens: int | None, timeout_s: float | None, over_cap: bool = False) -> Ticket:
        """A new ticket for ``request``, wired to this server (not queued)."""
        budget = max_new_tokens if over_cap and max_new_tokens else self.engine.budget(max_new_tokens)
        ticket = Ticket(request, max_new_tokens=budget, timeout_s=timeout_s, streaming=self.plan.scheduling.streaming)
        ticket._decode = self._decode
        ticket._on_cancel = self._cancelled
        ticket.stops = self.plan.application.stop
        return ticket

    def _put(self, ticket: Ticket) -> bool:
        """Queue ``ticket``; False when ``max_queue`` tickets wait already. A ticket cancelled or
        timed out while queued keeps its place until the worker reaches it, so a full queue is
        first rid of those (measured: with 200 clients of which a third hung up, a queue of 256
        answered 1,071 requests 429 while fewer than 200 waited)."""
        try:
            self._queue.put_nowait(ticket)
            return True
        except queue.Full:
            pass
        with self._queue.mutex:  # queue.Queue's own lock and deque: the stdlib offers no removal
            waiting = [t for t in self._queue.queue if not t.finished]
            self._queue.queue.clear()
            self._queue.queue.extend(waiting)
        try:
            self._queue.put_nowait(ticket)
            return True
        except queue.Full:
            return False

    def _answer_from_cache(self, ticket: Ticket) -> bool:
        """End ``ticket`` with the plan's response cache answer, if it has one (True then)."""
        if self._own_sampling(ticket):
            return False
        hit = self.engine.lookup_response(ticket.request, ticket.max_new_tokens, ignore_eos=self.ignore_eos)
        if hit is None:
            return False
        ticket._from_cache(hit.value, hit.kind)
        return True

    def _own_sampling(self, ticket: Ticket) -> bool:
        """True when the ticket's sampling changes the plan's decoding: the response cache holds
        answers of the plan's decoding only, so such a request is neither answered nor stored."""
        return not ticket.sampling.empty and differs(self.plan.application, ticket.sampling, seed=self.seed) is not None

    def _cancelled(self, ticket: Ticket) -> None:
        """Called once when a ticket is cancelled (by the caller or by close)."""
        self._forget(ticket)

    def _guarded_run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 (the worker died: no ticket may wait forever)
            with self._admission:  # closed first, so no ticket is queued after the live ones are failed
                self._closed.set()
            with self._live_lock:
                live = list(self._live.values())
            for t in live:
                t._finish("error", e)

    def _forget(self, ticket: Ticket) -> None:
        with self._live_lock:
            self._live.pop(ticket.key, None)

    def _end(self, ticket: Ticket, status: str, error: BaseException | None = None) -> None:
        if ticket._finish(status, error) and status == "done" and not self._own_sampling(ticket):
            value = {"text": ticket.text(), "token_ids": list(ticket.token_ids), "prompt_tokens": ticket.prompt_tokens, "hit_cap": ticket.hit_cap}
            self.engine.store_response(ticket.request, ticket.max_new_tokens, value, ignore_eos=self.ignore_eos)  # no-op without a cache
        self._forget(ticket)

    def _reject(self, ticket: Ticket, msg: str) -> None:
        error = RequestRejected(msg)
        error.ticket = ticket  # type: ignore[attr-defined]
        ticket._finish("rejected", error)
        raise error

    def _expire(self) -> None:
        """Time out every live ticket past its deadline."""
        now = time.perf_counter()
        with self._live_lock:
            expired = [t for t in self._live.values() if t._expired(now)]
        for t in expired:
            if t._finish("timeout"):
                self._cancelled(t)

    def _next(self, timeout: float) -> Ticket | None:
        """The next queued ticket still waiting, or None after ``timeout`` s / on close."""
        end = time.perf_counter() + timeout
        while not self._closed.is_set():
            self._expire()
            try:
                ticket = self._queue.get(timeout=max(0.0, min(_POLL_S, end - time.perf_counter())))
            except queue.Empty:
                if time.perf_counter() >= end:
                    return None
                continue
            if not ticket.finished:
                return ticket
        return None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.engine.decode(ids)


def serve_all(engine: Engine, requests: Sequence[Request], *, max_new_tokens: int | None = None, seed: int = 0) -> list[Generation]:
    """Submit every request at once through a server and return the Generations in order.

    The synchronous path ``Engine.serve`` uses for plans that batch continuously: every request
    queues at once, as a client that sends the whole suite would.

    Raises:
        EngineError: a request failed, timed out or was cancelled.
    """
    server = engine.server(seed=seed)
    try:
        tickets = [server.submit(r, max_new_tokens=max_new_tokens) for r in requests]
        out = [t.result() for t in tickets]
        bad = [t for t in tickets if t.status != "done"]
        if bad:
            raise EngineError(f"{len(bad)} of {len(tickets)} requests did not finish: {bad[0].request.id!r} ended {bad[0].status}")
        return out
    finally:
        server.close()
