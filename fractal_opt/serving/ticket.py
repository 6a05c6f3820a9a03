"""Ticket: one submitted request's state, its tokens as they arrive, and its final Generation.

Callers wait on it (``result``), stream from it (token ids by iterating, text with
``text_deltas``) and cancel it. Schedulers (the runtimes' :class:`~fractal_opt.serving.server.Server`
subclasses) feed it through the underscored server-side methods: ``_start`` when prefill starts,
``_add`` as tokens arrive, and ``Server._end`` once, when it ends.

States: queued -> running -> done | timeout | cancelled | error, or rejected at submission.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from ..core.errors import EngineError, RequestRejected
from ..engine.protocol import Generation
from ..workloads.workload import Request
from .sampling import Sampling

__all__ = ["TERMINAL", "Ticket"]

TERMINAL = frozenset({"done", "timeout", "cancelled", "rejected", "error"})


class Ticket:
    """One submitted request: its state, its tokens as they arrive, and its final Generation.

    ``token_times`` are when the model produced each token; ``delivered_times`` are when the
    caller could see it (the same with streaming on; the end of the request with streaming off).
    Time to first token as a user sees it is ``delivered_times[0] - t_submit``.

    The scheduler (a runtime's Server) sets ``streamed`` to False when it cannot clock tokens one
    by one (beam search: they arrive at the end), ``ended_on_eos`` when the last token is an
    end-of-sequence (so an answer that ends exactly at its budget is not ``hit_cap``), and
    ``stops`` to the plan's stop sequences (held back from :meth:`text_deltas` while they may
    still be completed). ``request_stops`` are the caller's own stop sequences
    (``Server.submit(stop=...)``): the runtime knows only the plan's, so the ticket cuts the text
    at these itself and ends the request (``ended_on_stop``) as soon as one appears.
    ``sampling`` holds the request's own temperature / top_p / seed; the scheduler decodes with
    ``Server.decoding(ticket)``.
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
        self.cached_tokens: int | None = None  # prompt tokens the runtime served from its prefix cache, where it says
        self.streamed = True  # False: no per-token clock (token_times all read at the end)
        self.ended_on_eos = False
        self.stops: tuple[str, ...] = ()
        self.request_stops: tuple[str, ...] = ()
        self.ended_on_stop = False
        self.sampling = Sampling()  # the request's own temperature / top_p / seed (Server.submit)
        self.error: BaseException | None = None
        self._visible = 0  # tokens the caller may read (all of them with streaming on)
        self._cond = threading.Condition()
        self._decode = None  # token ids -> answer text, set by the server
        self._on_cancel = None  # server hook that frees the request's resources
        self._listeners: list[Any] = []  # called (no arguments, any thread) after each change

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

    def text_deltas(self) -> Iterator[str]:
        """Yield the text each batch of newly visible tokens adds; the pieces join to ``result().text``.

        A piece is held back while it ends inside a multi-byte character or could still grow into
        one of the plan's stop sequences (which the answer leaves out).

        Raises:
            RequestRejected, EngineError: as :meth:`result`, once the request ended that way.
        """
        sent, seen = "", 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda seen=seen: self._visible > seen or self.finished)
                if self._visible <= seen:
                    break
                seen = self._visible
                ids = list(self.token_ids[:seen])
            text = self._settled(self._cut(self._decode(ids) if self._decode else ""))
            if len(text) > len(sent) and text.startswith(sent):
                yield text[len(sent) :]
                sent = text
        final = self.result().text
        if len(final) > len(sent) and final.startswith(sent):
            yield final[len(sent) :]

    async def atext_deltas(self) -> AsyncIterator[str]:
        """``async for piece in ticket.atext_deltas()``: :meth:`text_deltas` without blocking the event loop."""
        pieces = self.text_deltas()
        end = object()
        while (piece := await asyncio.to_thread(next, pieces, end)) is not end:
            yield piece  # type: ignore[misc]

    def on_change(self, callback: Any) -> None:
        """Call ``callback()`` after every change (new tokens, the end), from the scheduler's thread.

        For event loops: ``ticket.on_change(lambda: loop.call_soon_threadsafe(event.set))``, then
        :meth:`visible_text` after each wake-up, so no thread waits per request. A listener added
        after the ticket ended is not called: read :attr:`finished` after adding it.
        """
        with self._cond:
            self._listeners.append(callback)

    def visible_text(self) -> tuple[str, bool]:
        """``(text, ended)`` without waiting: the text the caller may see now (as
        :meth:`text_deltas` would have yielded it so far), and whether the request ended; once it
        ended the text is the whole answer (``result().text``)."""
        with self._cond:
            ended = self.finished
            ids = list(self.token_ids[: self._visible])
        text = self._cut(self._decode(ids) if self._decode else "")
        return (text, True) if ended else (self._settled(text), False)

    def text(self) -> str:
        """The answer so far, end-of-sequence tokens left out, cut before the first request stop."""
        return self._cut(self._decode(list(self.token_ids)) if self._decode else "")

    def generation(self) -> Generation:
        """The request as a Generation (the engine's result type), whatever its state."""
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
            streamed=self.streamed,
            t_done=self.t_end,
        )

    # ------------------------------------------------------------------ server side
    def _settled(self, text: str) -> str:
        """``text`` without a tail that may still change: an unfinished multi-byte character
        (decoded as U+FFFD) or the start of a stop sequence."""
        text = text.rstrip("\ufffd")
        held = max((k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        return text[: len(text) - held]

    def _cut(self, text: str) -> str:
        """``text`` up to the first of the caller's own stop sequences (the plan's the runtime cut)."""
        ends = [i for stop in self.request_stops if (i := text.find(stop)) >= 0]
        return text[: min(ends)] if ends else text

    def _wait_visible(self, i: int) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._visible > i or self.finished)
            return self._visible > i

    def _start(self, prompt_tokens: int, *, at: float | None = None) -> bool:
        """Mark the request running from ``at`` (default: now), when its prefill starts; False if it already ended."""
        with self._cond:
            if self.finished:
                return False
            self.status, self.t_start, self.prompt_tokens = "running", time.perf_counter() if at is None else at, prompt_tokens
        self._notify()
        return True

    def _from_cache(self, value: dict[str, Any], kind: str) -> None:
        """End the request at once with a cached answer: every token available now."""
        with self._cond:
            now = time.perf_counter()
            ids = list(value["token_ids"])[: self.max_new_tokens]
            self.status, self.t_start, self.prompt_tokens, self.cache_hit = "running", now, value["prompt_tokens"], kind
            self.token_ids, self.token_times, self.delivered_times = ids, [now] * len(ids), [now] * len(ids)
            self.ended_on_eos = not value["hit_cap"]  # hit_cap stays what the generating request said
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
            ids = list(self.token_ids) if self.request_stops and self._decode else None
        self._notify()
        if ids is not None:
            text = self._decode(ids)
            if any(stop in text for stop in self.request_stops):
                self.ended_on_stop = True  # the request's own stop: done, and its slot freed
                if self._finish("done") and self._on_cancel is not None:
                    self._on_cancel(self)

    def _finish(self, status: str, error: BaseException | None = None) -> bool:
        """Move to a terminal state once; later calls are ignored (returns False)."""
        with self._cond:
            if self.finished:
                return False
            self.status, self.error, self.t_end = status, error, time.perf_counter()
            self.hit_cap = status == "done" and len(self.token_ids) >= self.max_new_tokens and not (self.ended_on_eos or self.ended_on_stop)
            missing = len(self.token_ids) - len(self.delivered_times)
            self.delivered_times.extend([self.t_end] * missing)  # streaming off: all arrive at the end
            self._visible = len(self.token_ids)
            self._cond.notify_all()
        self._notify()
        return True

    def _notify(self) -> None:
        for callback in list(self._listeners):
            callback()

    def _expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline and not self.finished
