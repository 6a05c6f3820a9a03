"""Serving: a small request server over an Engine, scheduled as the plan's scheduling section says.

``server = make_server(engine)`` starts one worker; ``ticket = server.submit(request)`` returns at
once; ``ticket.result()`` waits for the answer (an :class:`~fractal_opt.engine.Generation` with a
clock reading per token); iterating a ticket (``for token_id in ticket`` or ``async for``) streams
tokens as the caller receives them; ``ticket.cancel()`` stops it; ``server.close()`` ends the worker.

Modes (``plan.scheduling.batching``):

- ``sequential``: one request at a time, in arrival order.
- ``static``: the worker takes up to ``batch_size`` queued requests, waiting at most
  ``max_wait_ms`` for the batch to fill, and runs them as one left-padded ``generate`` call. A row
  that ends early (end-of-sequence, its own budget, cancel, timeout) is answered at once, but its
  slot in the batch is only freed when the whole batch ends.
- ``continuous``: transformers' continuous batching (``model.init_continuous_batching``) in
  :mod:`fractal_opt.serving_cb`: requests join and leave the running batch at every step, on a
  paged KV cache; a cancelled or timed-out request's cache blocks are freed at the next step.

Every mode has a bounded queue: a full queue raises :class:`~fractal_opt.errors.RequestRejected`
instead of growing. Ticket states: queued -> running -> done | timeout | cancelled | error, or
rejected at submission. Every ticket ends exactly once.

Example:
    >>> server = make_server(engine)                                  # doctest: +SKIP
    >>> ticket = server.submit("What is the capital of France?")      # doctest: +SKIP
    >>> print(ticket.result().text); server.close()                   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import EngineError, RequestRejected
from ..workload import Request

if TYPE_CHECKING:
    from ..engine.protocol import Engine, Generation

__all__ = ["STATUSES", "Server", "Ticket", "in_flight_limit", "serve_all"]

STATUSES = ("queued", "running", "done", "timeout", "cancelled", "rejected", "error")
TERMINAL = frozenset({"done", "timeout", "cancelled", "rejected", "error"})
_POLL_S = 0.02  # how often idle workers look for expired deadlines (s): 20 ms bounds a timeout's lateness
_CONTINUOUS_DEFAULT_IN_FLIGHT = 16  # requests in the running batch when the plan sets no limit


def in_flight_limit(scheduling: Any) -> int:
    """Requests a server runs at once for a plan's scheduling section."""
    if scheduling.batching == "sequential":
        return 1
    if scheduling.batching == "static":
        return min(scheduling.batch_size, scheduling.max_concurrency or scheduling.batch_size)
    return scheduling.max_concurrency or _CONTINUOUS_DEFAULT_IN_FLIGHT


class Ticket:
    """One submitted request: its state, its tokens as they arrive, and its final Generation.

    ``token_times`` are when the model produced each token; ``delivered_times`` are when the
    caller could see it (the same with streaming on; the end of the request with streaming off).
    Time to first token as a user sees it is ``delivered_times[0] - t_submit``.
    """

    _ids = itertools.count()

    def __init__(self, request: Request, *, max_new_tokens: int, timeout_s: float | None, streaming: bool):
        self.request = request
        self.key = f"t{next(Ticket._ids)}"  # unique per process: requests may share an id
        self.max_new_tokens = max_new_tokens
        self.streaming = streaming
        self.t_submit = time.perf_counter()
        self.deadline = self.t_submit + timeout_s if timeout_s is not None else None
        self.status = "queued"
        self.t_start: float | None = None  # admitted to the model (prefill starts)
        self.t_end: float | None = None
        self.prompt_tokens = 0
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.delivered_times: list[float] = []
        self.hit_cap = False
        self.cache_hit: str | None = None  # "exact" / "semantic" when the response cache answered
        self.prompt_tokens_saved = 0  # prompt tokens the plan's prompt budget removed
        self.error: BaseException | None = None
        self._visible = 0  # tokens the caller may read (all of them with streaming on)
        self._cond = threading.Condition()
        self._decode = None  # tokenizer.decode, set by the server
        self._on_cancel = None  # server hook that frees the request's resources

    # ------------------------------------------------------------------ caller side
    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def result(self, timeout: float | None = None) -> Generation:
        """Wait until the request ends and return its Generation (partial after timeout / cancel).

        Raises:
            TimeoutError: ``timeout`` seconds passed before the request ended.
            RequestRejected: the request was rejected (queue full or server closed).
            EngineError: generation failed; the cause is chained.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self.finished, timeout=timeout):
                raise TimeoutError(f"request {self.request.id!r} still {self.status} after waiting {timeout} s")
        if self.status == "rejected":
            raise RequestRejected(str(self.error)) from None
        if self.status == "error":
            raise EngineError(f"request {self.request.id!r} failed: {self.error}") from self.error
        return self.generation()

    def cancel(self) -> bool:
        """Stop the request; returns False when it had already ended. Its cache is freed."""
        if not self._finish("cancelled"):
            return False
        if self._on_cancel is not None:
            self._on_cancel(self)
        return True

    def __iter__(self) -> Iterator[int]:
        """Yield token ids as the caller receives them (all at the end when streaming is off)."""
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda i=i: self._visible > i or self.finished)
                if self._visible <= i:
                    return
                tok = self.token_ids[i]
            i += 1
            yield tok

    async def __aiter__(self) -> AsyncIterator[int]:
        """``async for token_id in ticket``: the same stream without blocking the event loop."""
        i = 0
        while True:
            got = await asyncio.to_thread(self._wait_visible, i)
            if not got:
                return
            yield self.token_ids[i]
            i += 1

    def text(self) -> str:
        """The answer so far, end-of-sequence tokens left out."""
        return self._decode(self.token_ids) if self._decode else ""

    def generation(self) -> Generation:
        """The request as a Generation (the engine's result type), whatever its state."""
        from ..engine.protocol import Generation

        return Generation(
            request_id=self.request.id,
            text=self.text(),
            token_ids=list(self.token_ids),
            prompt_tokens=self.prompt_tokens,
            t_submit=self.t_submit,
            t_prefill_start=self.t_start if self.t_start is not None else self.t_submit,
            token_times=list(self.token_times),
            hit_cap=self.hit_cap,
            cache_hit=self.cache_hit,
            prompt_tokens_saved=self.prompt_tokens_saved,
        )

    # ------------------------------------------------------------------ server side
    def _wait_visible(self, i: int) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._visible > i or self.finished)
            return self._visible > i

    def _start(self, prompt_tokens: int) -> bool:
        with self._cond:
            if self.finished:
                return False
            self.status, self.t_start, self.prompt_tokens = "running", time.perf_counter(), prompt_tokens
            return True

    def _from_cache(self, value: dict[str, Any], kind: str) -> None:
        """End the request at once with a cached answer: every token available now."""
        with self._cond:
            now = time.perf_counter()
            ids = list(value["token_ids"])[: self.max_new_tokens]
            self.status, self.t_start, self.prompt_tokens, self.cache_hit = "running", now, value["prompt_tokens"], kind
            self.token_ids, self.token_times, self.delivered_times = ids, [now] * len(ids), [now] * len(ids)
        self._finish("done")

    def _add(self, tokens: Sequence[int], times: Sequence[float]) -> None:
        """Record new tokens (and their clock readings); streaming makes them visible at once."""
        with self._cond:
            if self.finished:
                return
            now = time.perf_counter()
            room = self.max_new_tokens - len(self.token_ids)
            self.token_ids.extend(tokens[:room])
            self.token_times.extend(times[:room])
            if self.streaming:
                self.delivered_times.extend([now] * len(tokens[:room]))
                self._visible = len(self.token_ids)
            self._cond.notify_all()

    def _finish(self, status: str, error: BaseException | None = None) -> bool:
        """Move to a terminal state once; later calls are ignored (returns False)."""
        with self._cond:
            if self.finished:
                return False
            self.status, self.error, self.t_end = status, error, time.perf_counter()
            self.hit_cap = status == "done" and len(self.token_ids) >= self.max_new_tokens
            missing = len(self.token_ids) - len(self.delivered_times)
            self.delivered_times.extend([self.t_end] * missing)  # streaming off: all arrive at the end
            self._visible = len(self.token_ids)
            self._cond.notify_all()
            return True

    def _expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline and not self.finished


class Server:
    """Base of the three schedulers: a bounded queue of tickets and one worker thread.

    Args:
        engine: a built Engine; the server uses its model, tokenizer and plan.
        seed: torch seed set before each generate call (sampling plans).
        ignore_eos: generate every request's full budget (benchmarks with fixed output lengths):
            end-of-sequence is generated like any token but ends nothing, in every mode.
    """

    def __init__(self, engine: Engine, *, seed: int = 0, ignore_eos: bool = False):
        if engine.model is None:
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
        self._started = False
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------ public
    def submit(self, request: Request | str, *, max_new_tokens: int | None = None, timeout_s: float | None = None) -> Ticket:
        """Queue a request and return its ticket at once.

        ``timeout_s`` (default: the plan's ``timeout_s``) counts from now, queueing included.

        Raises:
            RequestRejected: the queue holds ``max_queue`` requests already, or the server is closed;
                the exception's ``ticket`` attribute is the rejected ticket.
        """
        if isinstance(request, str):
            request = Request(id="request", messages=(("user", request),))
        timeout_s = timeout_s if timeout_s is not None else self.plan.scheduling.timeout_s
        ticket = Ticket(request, max_new_tokens=self.engine.budget(max_new_tokens), timeout_s=timeout_s, streaming=self.plan.scheduling.streaming)
        ticket._decode = self._decode
        ticket._on_cancel = self._cancelled
        with self._start_lock:  # clients may submit their first requests at the same moment
            if not self._started:
                self._start()
        if self._closed.is_set():
            self._reject(ticket, f"request {request.id!r} rejected: the server is closed")
        hit = self.engine.app.lookup(request, ticket.max_new_tokens, ignore_eos=self.ignore_eos)
        if hit is not None:  # the plan's response cache answers: no queue, no model
            ticket._from_cache(hit.value, hit.kind)
            return ticket
        with self._live_lock:
            self._live[ticket.key] = ticket
        try:
            self._queue.put_nowait(ticket)
        except queue.Full:
            with self._live_lock:
                self._live.pop(ticket.key, None)
            msg = (f"request {request.id!r} rejected: the queue is full ({self.max_queue} requests waiting, "
                   f"{self.in_flight} in flight). Retry later, or raise the queue pass's max_queue.")
            self._reject(ticket, msg)
        return ticket

    def close(self, *, timeout: float = 30.0) -> None:
        """Cancel every queued and running request and stop the worker (waits up to ``timeout`` s)."""
        self._closed.set()
        with self._live_lock:
            live = list(self._live.values())
        for t in live:
            t.cancel()
        if self._started:
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

    # ------------------------------------------------------------------ for subclasses
    def _run(self) -> None:
        raise NotImplementedError

    def _cancelled(self, ticket: Ticket) -> None:
        """Called once when a ticket is cancelled (by the caller or by close)."""
        self._forget(ticket)

    def _start(self) -> None:
        self._started = True
        self._thread.start()

    def _guarded_run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 (the worker died: no ticket may wait forever)
            with self._live_lock:
                live = list(self._live.values())
            for t in live:
                t._finish("error", e)
            self._closed.set()

    def _forget(self, ticket: Ticket) -> None:
        with self._live_lock:
            self._live.pop(ticket.key, None)

    def _end(self, ticket: Ticket, status: str, error: BaseException | None = None) -> None:
        if ticket._finish(status, error) and status == "done":
            value = {"text": ticket.text(), "token_ids": list(ticket.token_ids), "prompt_tokens": ticket.prompt_tokens, "hit_cap": ticket.hit_cap}
            self.engine.app.store(ticket.request, ticket.max_new_tokens, value, ignore_eos=self.ignore_eos)  # no-op without a cache
        self._forget(ticket)

    def _encoded(self, tickets: Sequence[Ticket]) -> dict[str, Any]:
        """The tickets' prompts encoded (the plan's prompt budget applied), noting the tokens it saved."""
        inputs = self.engine._encode([t.request for t in tickets])
        for t in tickets:
            t.prompt_tokens_saved = self.engine.app.saved.get(t.request.id, 0)
        return inputs

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
        from ..runtimes.transformers.engine import eos_ids

        eos = eos_ids(self.engine.model, self.engine.tokenizer)
        return self.engine.tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)


def serve_all(engine: Engine, requests: Sequence[Request], *, max_new_tokens: int | None = None, seed: int = 0) -> list[Generation]:
    """Submit every request at once through a server and return the Generations in order.

    The synchronous path ``Engine.serve`` uses for plans that need a server (continuous batching).

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
