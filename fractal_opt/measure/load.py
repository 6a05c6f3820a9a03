"""Load profiles that drive a Server: closed-loop concurrency and open-loop Poisson arrivals.

``run_load(server, items, profile)`` sends ``items`` (requests with their own token budgets) as
the profile says and returns one :class:`LoadRecord` per item — done, timeout, cancelled,
rejected or error: every request is counted, none dropped — plus aggregate output tokens/s.

- ``closed``: ``concurrency`` clients, each sending its next request when the last one ended, so
  that many requests are always in flight (a saturation test).
- ``poisson``: requests arrive at ``rate`` per second with exponential gaps (seeded), whether
  or not earlier ones finished (what real traffic does; queues grow when the rate is too high).

:class:`LoadRunner` measures a plan under a workload's ``load`` profile with the same protocol as
the measurement module's runner (``warm_up`` / ``round`` / ``result`` -> ``Measurement``), so the
pipeline judges scheduling passes on aggregate tokens/s with TTFT / ITL percentiles as guards.

Example:
    >>> profile = LoadProfile(mode="closed", concurrency=8, requests=32, output_tokens=(16, 64))
    >>> items = build_items(Workload().requests(), profile, default_tokens=64)   # doctest: +SKIP
    >>> result = run_load(engine.server(), items, profile)                       # doctest: +SKIP
    >>> result.summary()["throughput_tokens_per_s"]                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import EngineError, RecipeError, RequestRejected

if TYPE_CHECKING:
    from ..engine.protocol import Engine
    from ..serving.server import Server, Ticket
    from ..workload import LoadProfile, Request, Workload
    from .runner import Measurement

__all__ = ["LoadItem", "LoadRecord", "LoadResult", "LoadRunner", "build_items", "run_load"]

_WARMUP_TOKENS = 8  # budget of the untimed warm-up requests (every prompt shape through the kernels)


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
            cache_hit=ticket.cache_hit, prompt_tokens_saved=ticket.prompt_tokens_saved,
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
        from .runner import percentile

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
        items.append(LoadItem(id=f"{req.id}#{k}", request=req, max_new_tokens=budget))
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
            with lock:
                i = next(counter, None)
            if i is None:
                return
            _wait(send(i))

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


# --------------------------------------------------------------------------- measurement


class LoadRunner:
    """Measures one engine under a workload's load profile, one timed round at a time.

    Same protocol as ``fractal_opt.measure``'s runner: ``warm_up()``, ``round()``, ``result()``.
    Each round runs the whole load through a fresh server; per-repeat rows carry aggregate
    tokens/s, memory, CPU utilization and the TTFT / ITL / e2e percentiles of that round.

    Raises (from ``round``):
        EngineError: a request failed, or the round left less than ``memory_headroom`` free.
    """

    def __init__(self, engine: Engine, workload: Workload, requests: Sequence[Request]):
        self.engine = engine
        self.workload = workload
        self.profile = workload.load_profile()
        self.items = build_items(list(requests), self.profile, default_tokens=workload.max_new_tokens)
        limit = engine.plan.scheduling.max_concurrency
        self.clients = max(self.profile.concurrency, limit or 0)  # a ramp's level sets the offered load
        machine = engine.machine
        device = str(engine.model.device)
        self.capacity_mb = machine.device_memory_bytes(device) / 2**20 if machine is not None and machine.device_memory_bytes(device) else None
        self.device = device
        self.samples: list = []
        self.repeats: list[dict[str, Any]] = []
        self.outputs: dict[str, list[int]] = {}
        self.texts: dict[str, str] = {}
        self.warmup_s = 0.0
        self.memory_source = "rss"
        self.last: LoadResult | None = None

    def warm_up(self) -> None:
        t0 = time.perf_counter()
        for _ in range(self.workload.warmup):
            warm = [dataclasses.replace(it, max_new_tokens=min(_WARMUP_TOKENS, it.max_new_tokens)) for it in self.items[: self.clients]]
            with self.engine.server(seed=self.workload.seed, ignore_eos=self.profile.ignore_eos) as server:
                run_load(server, warm, dataclasses.replace(self.profile, mode="closed", cancel_fraction=0.0), concurrency=self.clients)
        self.warmup_s += time.perf_counter() - t0

    def round(self) -> None:
        import os

        from .memory import MemoryWindow
        from .runner import Sample, _plan_threads

        r = len(self.repeats)
        self.engine.reset_response_cache()  # every round starts cold, as measure() does for each pass over the suite
        cpu0 = os.times()
        with MemoryWindow(self.device) as mem, self.engine.server(seed=self.workload.seed, ignore_eos=self.profile.ignore_eos) as server:
            result = run_load(server, self.items, self.profile, concurrency=self.clients)
        cpu1 = os.times()
        self.last = result
        summary = result.summary()
        errors = [rec for rec in result.records if rec.status == "error"]
        if errors:
            raise EngineError(f"{len(errors)} of {len(result.records)} requests failed under load ({self.clients} clients): {errors[0].error}")
        if self.capacity_mb and mem.peak_mb is not None and mem.peak_mb > (1 - self.profile.memory_headroom) * self.capacity_mb:
            msg = (f"memory headroom tripped under load: peak {mem.peak_mb:.0f} MB of {self.capacity_mb:.0f} MB leaves less than "
                   f"{self.profile.memory_headroom:.0%} free ({self.clients} clients)")
            raise EngineError(msg)
        cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        row: dict[str, Any] = {
            "throughput_tokens_per_s": summary["throughput_tokens_per_s"],
            "peak_memory_mb": mem.peak_mb,
            "cpu_utilization": cpu_s / result.wall_s / _plan_threads(self.engine) if result.wall_s else None,
            "memory_headroom_mb": self.capacity_mb - mem.peak_mb if self.capacity_mb and mem.peak_mb is not None else None,
            "wall_s": result.wall_s,
            **{k: summary[k] for k in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99")},
            "load": {k: summary[k] for k in ("requests", "done", "timeout", "cancelled", "rejected", "error", "output_tokens", "slo_met") if k in summary},
            "goodput_tokens_per_s": summary.get("goodput_tokens_per_s"),  # None unless the profile sets an SLO
        }
        self.repeats.append(row)
        self.memory_source = mem.source
        for rec in result.records:
            if rec.status != "done":
                continue
            gen = _as_generation(rec, self.engine.tokenizer.decode(rec.token_ids, skip_special_tokens=True))
            sample = Sample.from_generation(gen, repeat=r)
            self.samples.append(dataclasses.replace(sample, ttft_ms=rec.ttft_ms))  # TTFT as the caller saw it
            if r == 0:
                self.outputs[rec.id] = list(rec.token_ids)
                self.texts[rec.id] = gen.text

    def result(self) -> Measurement:
        from .runner import Measurement

        extra = {"load": {"mode": self.profile.mode, "clients": self.clients, "requests": len(self.items),
                          "rate": self.profile.rate, "rounds": [row["load"] for row in self.repeats]}}
        if self.capacity_mb:
            extra["capacity_mb"] = round(self.capacity_mb, 1)
        return Measurement(samples=self.samples, repeats=self.repeats, outputs=self.outputs, texts=self.texts,
                           warmup_s=self.warmup_s, memory_source=self.memory_source, extra=extra)


def _as_generation(rec: LoadRecord, text: str) -> Any:
    from ..engine.protocol import Generation

    return Generation(request_id=rec.id, text=text, token_ids=rec.token_ids, prompt_tokens=rec.prompt_tokens, t_submit=rec.t_submit,
                      t_prefill_start=rec.t_start if rec.t_start is not None else rec.t_submit, token_times=rec.token_times, hit_cap=len(rec.token_ids) >= rec.max_new_tokens,
                      cache_hit=rec.cache_hit, prompt_tokens_saved=rec.prompt_tokens_saved)
