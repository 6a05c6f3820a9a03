"""LlamaServer: the shared request server (queue bound, timeouts, cancel, streaming) on top of
llama.cpp's own continuous batching.

llama.cpp already schedules: each of its ``n_parallel`` slots holds one request, and every step of
its loop decodes one token for every busy slot and prefills newly arrived prompts. What this
module adds is the fractal_opt contract around it: the worker admits queued tickets while fewer
than ``slots`` run, each admitted ticket runs on a thread of its own that blocks inside
``handle_completions`` (xllamacpp is thread-safe), and its tokens reach the ticket through
``_add`` as they stream. A cancelled or timed-out ticket makes its callback return True at the next
token, which stops the request and frees its slot in llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...core.errors import RequestRejected
from ...serving.slot_server import SlotServer
from ...serving.ticket import Ticket

__all__ = ["LlamaServer"]


class LlamaServer(SlotServer):
    """Continuous batching by llama.cpp: up to ``slots`` requests decode together."""

    slot_name = "fractal-opt-llama-slot"

    def __init__(self, engine: Any, **kwargs: Any):
        super().__init__(engine, **kwargs)
        # Never admit more requests than llama.cpp has slots: a request beyond them would wait
        # inside llama.cpp, where this server can neither time it out nor see it queued.
        # Replicas behind a router: each has the plan's slots.
        self.in_flight = min(self.in_flight, engine.settings.slots) * engine.settings.replicas

    def _work(self, ticket: Ticket) -> None:
        """Run one ticket on this slot thread, from admission to its terminal state."""
        pieces = self.streamed_text(ticket)  # the text as llama.cpp streamed it (stop strings already cut)
        if not ticket._start(0):  # cancelled or timed out while queued
            return

        def on_tokens(ids: list[int], times: list[float], text: str) -> bool:
            pieces.append(text)
            ticket._add(ids, times)
            return ticket.finished  # True stops the request in llama.cpp (cancel, timeout)

        try:
            own = self.decoding(ticket) if not ticket.sampling.empty else None  # the request's own temperature / top_p / seed
            answer = self.engine.complete(ticket.request, budget=ticket.max_new_tokens, seed=self.seed, ignore_eos=self.ignore_eos, on_tokens=on_tokens,
                                          decoding=own, stop=ticket.request_stops)  # llama.cpp stops there itself: usage still arrives
        except RequestRejected as e:
            self._end(ticket, "rejected", e)
            return
        except Exception as e:  # noqa: BLE001 (one request failed; the server goes on)
            self._end(ticket, "error", e)
            return
        ticket.prompt_tokens = answer.prompt_tokens
        if "cache_n" in answer.timings:  # llama.cpp's own count of prompt tokens its slot cache served
            ticket.cached_tokens = int(answer.timings["cache_n"])
        ticket.ended_on_stop = bool(ticket.request_stops) and answer.finish_reason == "stop"  # not hit_cap, however many tokens that took
        self._end(ticket, "done")

    def _cancelled(self, ticket: Ticket) -> None:
        self._forget(ticket)  # its callback sees ticket.finished at the next token and stops it

    def _decode(self, ids: Sequence[int]) -> str:
        """Text of a ticket that never reached a slot (no tokens: nothing to decode)."""
        return ""
