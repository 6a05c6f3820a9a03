"""Load profiles that drive a Server: closed-loop concurrency and open-loop Poisson arrivals.

``run_load(server, items, profile)`` sends ``items`` (requests with their own token budgets) as
the profile says and returns one :class:`LoadRecord` per item — done, timeout, cancelled,
rejected or error: every request is counted, none dropped — plus aggregate output tokens/s.

- ``closed``: ``concurrency`` clients, each sending its next request when the last one ended, so
  that many requests are always in flight (a saturation test).
- ``poisson``: requests arrive at ``rate`` per second with exponential gaps (seeded), whether
  or not earlier ones finished (what real traffic does; queues grow when the rate is too high).

This module only generates load; :class:`fractal_opt.measure.rounds.LoadRounds` turns a load into
the rounds of the one measurement runner, so the pipeline judges scheduling passes on aggregate
tokens/s with TTFT / ITL percentiles as guards.

Example:
    >>> profile = LoadProfile(mode="closed", concurrency=8, requests=32, output_tokens=(16, 64))
    >>> items = build_items(Workload().requests(), profile, default_tokens=64)   # doctest: +SKIP
    >>> result = run_load(engine.server(), items, profile)                       # doctest: +SKIP
    >>> result.summary()["throughput_tokens_per_s"]                              # doctest: +SKIP
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.errors import EngineError, RecipeError, RequestRejected
from .metrics import percentile

if TYPE_CHECKING:
    from ..serving.server import Server, Ticket
    from ..workloads.workload import LoadProfile, Request

__all__ = ["LoadItem", "LoadRecord", "LoadResult", "build_items", "item_id", "request_id", "run_load"]

@dataclass(frozen=True)
class LoadItem:
    """One request to send: its id is unique within the load (suite id plus ``#k``)."""

    id: str
    request: Request
    max_new_tokens: int


@dataclass
class LoadRecord:
    """How one request of a load ended, with its clock readings (perf_counter seconds)."""

    id: str
    status: str  # done | timeout | cancelled | rejected | error
    max_new_tokens: int
    prompt_tokens: int
    t_submit: float
    t_end: float
    t_start: float | None = None  # admitted to the model (after queueing)
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # when the model made each token
    delivered_times: list[float] = field(default_factory=list)  # when the caller could read it
    error: str | None = None
    cache_hit: str | None = None  # "exact" / "semantic" when the plan's response cache answered
    prompt_tokens_saved: int = 0  # prompt tokens the plan's prompt budget removed
    text: str = ""  # the answer as the server decoded it (end-of-sequence tokens left out)
    turn: int | None = None  # conversations: the turn's index (1 = the first message)
    user: int | None = None  # conversations: the user who sent it
    cached_tokens: int | None = None  # prompt tokens the runtime reported served from its cache (None: it reports none)

    @property
    def ttft_ms(self) -> float | None:
        """Submit to the first token the caller could read (what a streaming user sees)."""
        return (self.delivered_times[0] - self.t_submit) * 1000 if self.delivered_times else None

    @property
    def e2e_ms(self) -> float:
        return (self.t_end - self.t_submit) * 1000

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (ms); None with fewer than 2 tokens."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) * 1000 / (len(self.token_times) - 1)

    def meets(self, slos: dict[str, float]) -> bool:
        """Finished, and every objective in ``slos`` (record attribute -> limit in ms) met."""
        if self.status != "done":
            return False
        for name, limit in slos.items():
            value = getattr(self, name)
            if value is not None and value > limit:
                return False
        return True

    @property
    def itl_ms(self) -> list[float]:
        """Gaps between consecutive generated tokens (ms), first token excluded."""
        return [(b - a) * 1000 for a, b in zip(self.token_times, self.token_times[1:])]

    @classmethod
    def from_ticket(cls, item: LoadItem, ticket: Ticket) -> LoadRecord:
        return cls(
            id=item.id, status=ticket.status, max_new_tokens=item.max_new_tokens, prompt_tokens=ticket.prompt_tokens,
            t_submit=ticket.t_submit, t_start=ticket.t_start, t_end=ticket.t_end if ticket.t_end is not None else time.perf_counter(),
            token_ids=list(ticket.token_ids), token_times=list(ticket.token_times), delivered_times=list(ticket.delivered_times),
            error=None if ticket.error is None else f"{type(ticket.error).__name__}: {ticket.error}",
            cache_hit=ticket.cache_hit, prompt_tokens_saved=ticket.prompt_tokens_saved, text=ticket.text(),
            cached_tokens=getattr(ticket, "cached_tokens", None),
        )


@dataclass
class LoadResult:
    """Every request's record and the wall time from the first submission to the last end."""

    records: list[LoadRecord]
    wall_s: float
    slos: dict[str, float] = field(default_factory=dict)  # record attribute -> limit (ms)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("done", "timeout", "cancelled", "rejected", "error")}
        for r in self.records:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def output_tokens(self) -> int:
        """Tokens generated for every request (partial answers of timed-out / cancelled ones too)."""
        return sum(len(r.token_ids) for r in self.records)

    def summary(self) -> dict[str, Any]:
        """Aggregate output tokens/s and TTFT / ITL / e2e p50, p90, p99 over finished requests."""
        done = [r for r in self.records if r.status == "done"]
        out: dict[str, Any] = {"requests": len(self.records), **self.counts(), "output_tokens": self.output_tokens(),
                               "wall_s": round(self.wall_s, 3),
                               "throughput_tokens_per_s": round(self.output_tokens() / self.wall_s, 3) if self.wall_s > 0 else None}
        series = {
            "ttft_ms": [r.ttft_ms for r in done if r.ttft_ms is not None],
            "itl_ms": [gap for r in done for gap in r.itl_ms],
            "e2e_ms": [r.e2e_ms for r in done],
        }
        for name, values in series.items():
            for q in (50, 90, 99):
                v = percentile(values, q)
                out[f"{name}_p{q}"] = None if v is None else round(v, 3)
        if self.slos and self.wall_s > 0:
            good = [r for r in self.records if r.meets(self.slos)]
            out["slo_met"] = round(len(good) / max(1, len(self.records)), 4)
            out["goodput_requests_per_s"] = round(len(good) / self.wall_s, 4)
            out["goodput_tokens_per_s"] = round(sum(len(r.token_ids) for r in good) / self.wall_s, 3)
        return out


def item_id(request_id: str, k: int) -> str:
    """The id of a load's ``k``-th item, the suite request ``request_id`` sent again (unique within the load)."""
    return f"{request_id}#{k}"


def request_id(item: str) -> str:
    """The suite request an item id (:func:`item_id`) names; an id without ``#k`` names itself."""
    head, sep, _ = item.rpartition("#")
    return head if sep else item


def build_items(requests: Sequence[Request], profile: LoadProfile, *, default_tokens: int) -> list[LoadItem]:
    """The requests of one load: the suite cycled to ``profile.requests`` items, each with a
    token budget drawn (seeded) from ``profile.output_tokens``."""
    if not requests:
        raise RecipeError("a load needs at least one request in the workload suite")
    n = profile.requests or max(2 * profile.concurrency, len(requests))
    rng = random.Random(profile.seed)
    items = []
    for k in range(n):
        budget = rng.choice(profile.output_tokens) if profile.output_tokens else default_tokens
        req = requests[k % len(requests)]
        items.append(LoadItem(id=item_id(req.id, k), request=req, max_new_tokens=budget))
    return items


def run_load(server: Server, items: Sequence[LoadItem], profile: LoadProfile, *, concurrency: int | None = None) -> LoadResult:
    """Send ``items`` through ``server`` as ``profile`` says; wait for all; one record per item.

    ``concurrency`` overrides the profile's closed-loop client count (a concurrency ramp).
    """
    rng = random.Random(profile.seed + 1)  # its own stream: budgets stay the same when cancels change
    cancels = {i: rng.uniform(0, profile.cancel_after_s) for i in range(len(items)) if rng.random() < profile.cancel_fraction}
    tickets: list[Ticket | None] = [None] * len(items)
    timers: list[threading.Timer] = []

    def send(i: int) -> Ticket:
        item = items[i]
        try:
            ticket = server.submit(item.request, max_new_tokens=item.max_new_tokens, timeout_s=profile.timeout_s)
        except RequestRejected as e:
            ticket = e.ticket  # type: ignore[attr-defined]
        tickets[i] = ticket
        if i in cancels and not ticket.finished:
            timer = threading.Timer(cancels[i], ticket.cancel)
            timer.daemon = True
            timers.append(timer)
            timer.start()
        return ticket

    t0 = time.perf_counter()
    if profile.mode == "closed":
        _closed_loop(send, len(items), concurrency or profile.concurrency)
    else:
        _poisson(send, len(items), profile.rate or 1.0, random.Random(profile.seed + 2))
    for t in tickets:
        _wait(t)
    for timer in timers:
        timer.cancel()
    records = [LoadRecord.from_ticket(item, t) for item, t in zip(items, tickets) if t is not None]
    if len(records) != len(items):
        raise EngineError(f"load lost requests: {len(items) - len(records)} of {len(items)} were never submitted")
    end = max((r.t_end for r in records), default=t0)
    return LoadResult(records=records, wall_s=end - t0, slos=profile.slos())


def _wait(ticket: Ticket | None) -> None:
    if ticket is None:
        return
    try:
        ticket.result()
    except EngineError:  # rejected / failed: the ticket's status says so, and the record counts it
        pass


def _closed_loop(send: Callable[[int], Ticket], n: int, clients: int) -> None:
    counter = iter(range(n))
    lock = threading.Lock()

    def client() -> None:
        while True:
            # Take the next item and submit it in one step (submit only queues): the server gets a
            # burst in the suite's order whichever client thread runs first, so a request's wait
            # behind the others (in its TTFT and e2e) is the same in every round and pairs.
            with lock:
                i = next(counter, None)
                if i is None:
                    return
                ticket = send(i)
            _wait(ticket)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(clients, n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _poisson(send: Callable[[int], Ticket], n: int, rate: float, rng: random.Random) -> None:
    start = time.perf_counter()
    at = 0.0
    for i in range(n):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        send(i)
        at += rng.expovariate(rate)  # exponential gaps = Poisson arrivals at `rate` per second
