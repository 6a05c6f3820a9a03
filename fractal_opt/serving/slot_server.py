"""SlotServer: the shared request server for runtimes that schedule requests themselves.

llama.cpp's server and vLLM batch continuously on their own: what fractal_opt adds is its contract
around them (bounded queue, deadlines, cancellation, streaming into tickets, the response cache).
The worker admits queued tickets while fewer than ``in_flight`` run, and each admitted ticket runs
on a slot thread of its own (:meth:`SlotServer._work`, written by the runtime) that blocks inside
the runtime's streaming call and pushes tokens into the ticket as they arrive. ``in_flight`` is
capped by the subclass at the runtime's own slot count, so no request waits inside the runtime,
where this server could neither time it out nor see it queued.
"""

from __future__ import annotations

import functools
import queue
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from .server import _POLL_S, Server
from .ticket import Ticket

__all__ = ["SlotServer"]


class SlotServer(Server):
    """Up to ``in_flight`` requests at once, one slot thread each; subclasses write ``_work``."""

    slot_name = "fractal-opt-slot"  # thread-name prefix of the slot threads

    def _run(self) -> None:
        running: set[Future[None]] = set()
        with ThreadPoolExecutor(max_workers=self.in_flight, thread_name_prefix=self.slot_name) as pool:
            while True:
                if self._closed.is_set() and not running:
                    return  # close() cancelled every live ticket; their slot threads stop them
                while len(running) < self.in_flight and not self._closed.is_set():
                    ticket = self._take()
                    if ticket is None:
                        break
                    running.add(pool.submit(self._work, ticket))
                if running:
                    done, _ = wait(running, timeout=_POLL_S, return_when=FIRST_COMPLETED)
                    running -= done
                    for f in done:
                        f.result()  # _work catches per-request errors; anything else is a server bug
                    self._expire()
                else:
                    ticket = self._next(_POLL_S)  # blocks up to 20 ms, expiring deadlines meanwhile
                    if ticket is not None:
                        running.add(pool.submit(self._work, ticket))

    def _take(self) -> Ticket | None:
        """A queued ticket still waiting, without blocking (None when the queue is empty)."""
        while True:
            try:
                ticket = self._queue.get_nowait()
            except queue.Empty:
                return None
            if not ticket.finished:
                return ticket

    def _work(self, ticket: Ticket) -> None:
        """Run one ticket on this slot thread, from admission to its terminal state."""
        raise NotImplementedError

    @staticmethod
    def streamed_text(ticket: Ticket) -> list[str]:
        """A list the slot appends the runtime's text pieces to; the ticket's text is their join
        (the runtime already cut stop strings and special tokens)."""
        pieces: list[str] = []
        ticket._decode = functools.partial(_joined, pieces)
        return pieces


def _joined(pieces: list[str], ids: Sequence[int]) -> str:
    return "".join(pieces)
