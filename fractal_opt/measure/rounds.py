"""The two ways of producing a measured round: the suite served synchronously, or a load profile.

The one measurement runner (:class:`fractal_opt.measure.runner.Runner`) wraps a source's rounds in
its memory, GPU and CPU windows and computes the shared per-repeat readings
(:func:`~fractal_opt.measure.metrics.round_readings`); a source says what was served
(:class:`Round`): its samples, wall time, output tokens and the readings only it knows.

- :class:`SuiteRounds`: the workload's suite through ``Engine.serve``, as the plan schedules it;
  percentiles are pooled over the round's samples.
- :class:`LoadRounds`: the workload's ``load`` profile through a fresh server per round
  (:func:`fractal_opt.measure.load.run_load`); percentiles, request counts and goodput as callers
  saw them.
- :class:`~fractal_opt.measure.conversation_rounds.ConversationRounds`: the ``conversations`` load,
  users replaying the suite's conversations turn by turn, with the per-turn table.
- :class:`~fractal_opt.measure.capacity_rounds.CapacityRounds` (``load: {capacity: true}``): each
  round searches the plan's capacity under the profile's SLOs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..core.errors import EngineError
from .load import build_items, run_load
from .load_readings import as_generation, load_readings
from .metrics import PERCENTILE_METRICS, Measurement, Sample

if TYPE_CHECKING:
    from ..engine.protocol import Engine
    from ..tower.plan import Plan
    from ..workloads.workload import LoadProfile, Request, Workload

__all__ = ["LoadRounds", "Round", "Rounds", "SuiteRounds", "offered_clients"]

_WARMUP_TOKENS = 8  # budget of the untimed warm-up requests (every prompt shape through the kernels)


def offered_clients(workload: Workload, plan: Plan) -> int | None:
    """The clients a closed load profile offers ``plan`` when nothing overrides them.

    A concurrency ramp raises the offered load with the plan (``scheduling.max_concurrency``): a
    plan that admits 16 requests at once is offered 16 clients even when the profile says 8, so
    that the ramp's level is what the step measures. Two plans may therefore be offered different
    loads; :class:`LoadRounds` takes ``clients`` to offer both the same (the final confirmation).
    None when the offered load does not depend on the plan: no load profile (the suite), poisson
    arrivals (their ``rate``), the conversations load (its ``users``) and the capacity search (its
    own levels).
    """
    if not getattr(workload, "load", None):
        return None
    profile = workload.load_profile()
    if profile.capacity or profile.mode != "closed":
        return None
    return _plan_clients(profile, plan)


def _plan_clients(profile: LoadProfile, plan: Plan) -> int:
    """The profile's clients, raised to the plan's ``max_concurrency`` (a ramp's level sets the offered load)."""
    return max(profile.concurrency, plan.scheduling.max_concurrency or 0)


@dataclass
class Round:
    """What one timed round served: its samples, first-round outputs and the source's readings."""

    samples: list[Sample]
    wall_s: float  # the round's wall time as the source defines it (what throughput divides by)
    output_tokens: int  # every token generated in the round
    outputs: dict[str, list[int]] = field(default_factory=dict)  # request id -> generated token ids
    texts: dict[str, str] = field(default_factory=dict)
    readings: dict[str, Any] = field(default_factory=dict)  # per-repeat numbers only this source knows


class Rounds(Protocol):
    """A way of producing a round's work for the :class:`Runner`."""

    def warm_up(self) -> None:
        """One untimed pass with a short budget (the runner repeats it ``workload.warmup`` times)."""

    def serve(self, repeat: int) -> Round:
        """Serve one timed round (inside the runner's memory and CPU windows)."""

    def check_memory(self, peak_mb: float | None, capacity: float | None) -> None:
        """Raise when the round left too little memory free (a no-op where nothing is guarded)."""

    def extra(self) -> dict[str, Any]:
        """What the measurement's ``extra`` records about this source."""

    def forget_round(self) -> None:
        """Drop what the last :meth:`serve` recorded: the runner re-runs a round another process
        disturbed (:mod:`.isolation`), and the discarded try must not count."""


class SuiteRounds:
    """The workload's suite served synchronously, as the plan schedules it (``Engine.serve``)."""

    def __init__(self, engine: Engine, workload: Workload, requests: Sequence[Request]):
        self.engine = engine
        self.workload = workload
        self.requests = list(requests)
        self.sync = engine.clock_sync

    def warm_up(self) -> None:
        # The whole suite with a short budget, so every prompt shape has been through the kernels
        # (oneDNN primitive caches, allocator growth, torch.compile) before the clock runs.
        self.engine.reset_response_cache()
        self.engine.serve(self.requests, max_new_tokens=min(_WARMUP_TOKENS, self.workload.max_new_tokens), seed=self.workload.seed, sync=self.sync)

    def serve(self, repeat: int) -> Round:
        w0 = time.perf_counter()
        gens = self.engine.serve(self.requests, max_new_tokens=self.workload.max_new_tokens, seed=self.workload.seed, sync=self.sync)
        wall = time.perf_counter() - w0
        samples = [Sample.from_generation(g, repeat=repeat) for g in gens]
        round_m = Measurement(samples=samples, repeats=[], outputs={}, texts={})
        return Round(samples=samples, wall_s=wall, output_tokens=sum(g.new_tokens for g in gens),
                     outputs={g.request_id: g.token_ids for g in gens}, texts={g.request_id: g.text for g in gens},
                     readings={m: round_m.pooled(m) for m in PERCENTILE_METRICS})

    def check_memory(self, peak_mb: float | None, capacity: float | None) -> None:
        return None

    def forget_round(self) -> None:
        """Nothing to drop: a suite round keeps no state of its own."""

    def extra(self) -> dict[str, Any]:
        return {}


class LoadRounds:
    """The load profile's way of producing a round for :class:`~fractal_opt.measure.runner.Runner`.

    Each round runs the whole load through a fresh server; its readings are the TTFT / ITL / e2e
    percentiles as callers saw them, the request counts and goodput. Samples are the finished
    requests, with TTFT as the caller saw it (first token delivered).

    ``clients`` is the offered load, the closed loop's clients (poisson arrivals come at the
    profile's rate whatever it is; it caps their warm-up); default: the profile's, raised to the
    plan's ``max_concurrency`` (:func:`offered_clients`).

    Raises (from ``serve`` / ``check_memory``):
        EngineError: a request failed, or the round left less than ``memory_headroom`` free.
        ValueError: ``clients`` is not a positive whole number.
    """

    def __init__(self, engine: Engine, workload: Workload, requests: Sequence[Request], *, clients: int | None = None):
        if clients is not None and (isinstance(clients, bool) or not isinstance(clients, int) or clients < 1):
            msg = f"clients (the offered load) must be a whole number >= 1, or None for the plan's own; got {clients!r}"
            raise ValueError(msg)
        self.engine = engine
        self.workload = workload
        self.profile = workload.load_profile()
        self.items = build_items(list(requests), self.profile, default_tokens=workload.max_new_tokens)
        self.clients = clients if clients is not None else _plan_clients(self.profile, engine.plan)
        self.rounds: list[dict[str, Any]] = []  # per round: the request counts

    def warm_up(self) -> None:
        warm = [dataclasses.replace(it, max_new_tokens=min(_WARMUP_TOKENS, it.max_new_tokens)) for it in self.items[: self.clients]]
        with self.engine.server(seed=self.workload.seed, ignore_eos=self.profile.ignore_eos) as server:
            run_load(server, warm, dataclasses.replace(self.profile, mode="closed", cancel_fraction=0.0), concurrency=self.clients)

    def serve(self, repeat: int) -> Round:
        with self.engine.server(seed=self.workload.seed, ignore_eos=self.profile.ignore_eos) as server:
            result = run_load(server, self.items, self.profile, concurrency=self.clients)
        errors = [rec for rec in result.records if rec.status == "error"]
        if errors:
            raise EngineError(f"{len(errors)} of {len(result.records)} requests failed under load ({self.clients} clients): {errors[0].error}")
        readings, counts = load_readings(result)
        self.rounds.append(counts)
        done = [rec for rec in result.records if rec.status == "done"]
        samples = [dataclasses.replace(Sample.from_generation(as_generation(rec), repeat=repeat), ttft_ms=rec.ttft_ms) for rec in done]  # TTFT as the caller saw it
        return Round(samples=samples, wall_s=result.wall_s, output_tokens=result.output_tokens(),
                     outputs={rec.id: list(rec.token_ids) for rec in done}, texts={rec.id: rec.text for rec in done}, readings=readings)

    def check_memory(self, peak_mb: float | None, capacity: float | None) -> None:
        if capacity and peak_mb is not None and peak_mb > (1 - self.profile.memory_headroom) * capacity:
            msg = (f"memory headroom tripped under load: peak {peak_mb:.0f} MB of {capacity:.0f} MB leaves less than "
                   f"{self.profile.memory_headroom:.0%} free ({self.clients} clients)")
            raise EngineError(msg)

    def forget_round(self) -> None:
        """Drop the last round's request counts (a discarded try)."""
        if self.rounds:
            self.rounds.pop()

    def extra(self) -> dict[str, Any]:
        return {"load": {"mode": self.profile.mode, "clients": self.clients, "requests": len(self.items),
                         "rate": self.profile.rate, "rounds": list(self.rounds)}}
