"""Server.submit racing close(): every ticket ends, close() is safe at any moment.

The server here is the runtime-agnostic base with a scheduler that answers instantly, on an engine
without a model, so hundreds of trials take about a second: the races are in Server's admission
(closed-check, worker start, queueing) and close(), not in any runtime.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from fractal_opt.core.errors import RequestRejected
from fractal_opt.serving.server import TERMINAL, Server
from fractal_opt.testing import FakeEngine
from fractal_opt.tower.plan import Plan

TRIALS = 300


class EchoServer(Server):
    """Answers each queued ticket with three tokens, one per poll of the queue."""

    def _run(self) -> None:
        while True:
            ticket = self._next(0.005)
            if ticket is None:
                if self._closed.is_set():
                    return
                continue
            if ticket._start(1):
                ticket._add([1, 2, 3], [time.perf_counter()] * 3)
                self._end(ticket, "done")


class EchoEngine(FakeEngine):
    """A FakeEngine whose server() is the EchoServer; ``lookup_s`` slows the response-cache lookup
    (a semantic cache embeds the prompt first), which widens the submit/close window."""

    lookup_s = 0.0

    def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Server:
        return EchoServer(self, seed=seed, ignore_eos=ignore_eos)

    def decode(self, token_ids):
        return " ".join(map(str, token_ids))

    def lookup_response(self, request, budget, *, ignore_eos=False):
        time.sleep(self.lookup_s)  # a miss, after the lookup's time


def _engine(**kw) -> EchoEngine:
    build = FakeEngine.factory()
    engine = build(Plan(source="fake"))
    engine.__class__ = EchoEngine
    for k, v in kw.items():
        setattr(engine, k, v)
    return engine


def _submit(server: Server, out: list, errors: list) -> None:
    try:
        out.append(server.submit([{"role": "user", "content": "hi"}], max_new_tokens=3))
    except RequestRejected as e:
        out.append(e.ticket)  # type: ignore[attr-defined]
    except BaseException as e:  # noqa: BLE001 (the test reports any other exception)
        errors.append(e)


def test_close_during_the_first_submit_never_raises_and_every_ticket_ends():
    """close() while the first submits start the worker: no 'cannot join thread before it is
    started', and every ticket ends (done, cancelled or rejected) within a second."""
    engine = _engine()
    rng = random.Random(0)
    statuses: dict[str, int] = {}
    for _ in range(TRIALS):
        server = engine.server()
        tickets: list = []
        errors: list = []
        clients = [threading.Thread(target=_submit, args=(server, tickets, errors)) for _ in range(3)]
        for c in clients:
            c.start()
        time.sleep(rng.random() * 0.0005)
        server.close(timeout=5)
        for c in clients:
            c.join(5)
        assert not errors, errors[0]
        for t in tickets:
            t.result(timeout=1) if t.status != "rejected" else None
            assert t.status in TERMINAL
            statuses[t.status] = statuses.get(t.status, 0) + 1
        assert server.live() == 0
    assert sum(statuses.values()) == 3 * TRIALS
    assert statuses.get("rejected", 0) + statuses.get("cancelled", 0) > 0, statuses  # close() did land among the submits


def test_a_ticket_submitted_while_the_server_closes_never_stays_queued():
    """With a slow response-cache lookup, submits that started before close() finish after it: each
    such ticket is rejected (server closed) or cancelled, never left queued."""
    engine = _engine(lookup_s=0.002)
    for _ in range(50):
        server = engine.server()
        server.submit("warm up", max_new_tokens=3).result(timeout=1)  # the worker runs
        tickets: list = []
        errors: list = []
        clients = [threading.Thread(target=_submit, args=(server, tickets, errors)) for _ in range(4)]
        for c in clients:
            c.start()
        time.sleep(0.001)  # inside the lookup
        server.close(timeout=5)
        for c in clients:
            c.join(5)
        assert not errors, errors[0]
        assert len(tickets) == 4
        for t in tickets:
            deadline = time.perf_counter() + 1
            while not t.finished and time.perf_counter() < deadline:
                time.sleep(0.001)
            assert t.finished, f"ticket left {t.status} after close()"


def test_close_is_safe_before_any_submit_twice_and_from_many_threads():
    engine = _engine()
    server = engine.server()
    server.close()
    server.close()
    with pytest.raises(RequestRejected, match="closed"):
        server.submit("late")
    server = engine.server()
    server.submit("one", max_new_tokens=3).result(timeout=1)
    closers = [threading.Thread(target=server.close) for _ in range(8)]
    for c in closers:
        c.start()
    for c in closers:
        c.join(5)
    assert server.live() == 0


def _client(server: Server, tickets: list, errors: list, stop: threading.Event) -> None:
    """Submit until told to stop or until the server says it is closed."""
    mine: list = []
    while not stop.is_set():
        _submit(server, mine, errors)
        if mine and mine[-1].status == "rejected" and "closed" in str(mine[-1].error):
            break
    tickets.extend(mine)


def test_hammering_submit_and_close_ends_every_ticket_exactly_once():
    """8 threads submit in a loop while close() lands at a random moment; each ticket reaches one
    terminal state, and the states add up to the tickets handed out."""
    engine = _engine()
    rng = random.Random(1)
    for _ in range(40):
        server = engine.server()
        tickets: list = []
        errors: list = []
        stop = threading.Event()

        threads = [threading.Thread(target=_client, args=(server, tickets, errors, stop)) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(rng.random() * 0.01)
        server.close(timeout=5)
        stop.set()
        for t in threads:
            t.join(5)
        assert not errors, errors[0]
        ends = []
        for t in tickets:
            deadline = time.perf_counter() + 1
            while not t.finished and time.perf_counter() < deadline:
                time.sleep(0.001)
            assert t.finished, f"ticket left {t.status}"
            ends.append(t.status)
        assert len(ends) == len(tickets) and set(ends) <= TERMINAL
        assert server.live() == 0


def test_submit_takes_chat_messages_and_tickets_give_text_deltas():
    """A list of {role, content} messages is a request (generate takes one too); the ticket streams
    token ids and the text they add, and the pieces join to the answer."""
    engine = _engine()
    with engine.server() as server:
        ticket = server.submit([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], max_new_tokens=3)
        assert "".join(ticket.text_deltas()) == ticket.result(timeout=1).text == "1 2 3"
        assert list(ticket) == [1, 2, 3]


def test_a_request_stop_cuts_the_answer_and_ends_the_ticket():
    engine = _engine()
    with engine.server() as server:
        ticket = server.submit("hi", max_new_tokens=3, stop=[" 2"])
        gen = ticket.result(timeout=1)
        assert gen.text == "1" and ticket.ended_on_stop and not gen.hit_cap
        assert "".join(server.submit("hi", max_new_tokens=3, stop=["3"]).text_deltas()) == "1 2 "
