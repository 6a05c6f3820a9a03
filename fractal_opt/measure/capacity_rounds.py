"""Capacity as rounds of the one measurement runner: each round runs the whole capacity search.

With ``load: {capacity: true}`` every timed round searches for the plan's capacity under the
profile's SLOs (:class:`~fractal_opt.measure.capacity.CapacitySearch`), each probe through a fresh
server; the round's per-repeat ``capacity`` is the answer (None when no load met the SLOs), so the
runner's paired rounds give it an interval like any other number, and the policy may take it as
objective, guard or target. The round's samples, outputs and throughput are those of the probe at
the capacity found (the load the plan serves within its SLOs); ``extra()["load"]["capacity"]`` holds
every round's search with its probes, which the trace keeps with the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.errors import EngineError
from .capacity import CapacitySearch
from .conversation_load import by_turn, run_conversations
from .load import build_items, run_load
from .load_readings import as_generation, load_readings
from .metrics import Sample

if TYPE_CHECKING:
    from ..engine.protocol import Engine
    from ..workloads.workload import LoadProfile, Request, Workload
    from .load import LoadResult

__all__ = ["CapacityRounds"]

_WARMUP_TOKENS = 8


class CapacityRounds:
    """Rounds that each search the plan's capacity under the load profile's SLOs."""

    def __init__(self, engine: Engine, workload: Workload, requests: Sequence[Request]):
        self.engine = engine
        self.workload = workload
        self.profile = workload.load_profile()
        self.requests = list(requests)
        self.conversations = workload.conversations() if self.profile.mode == "conversations" else []
        self.searches: list[dict[str, Any]] = []
        self._probe_index = 0

    def _serve(self, profile: LoadProfile, *, tokens: int, session: str) -> LoadResult:
        with self.engine.server(seed=self.workload.seed, ignore_eos=profile.ignore_eos) as server:
            if profile.mode == "conversations":
                return run_conversations(server, self.conversations, profile, max_new_tokens=tokens, session=session)
            return run_load(server, build_items(self.requests, profile, default_tokens=tokens), profile)

    def warm_up(self) -> None:
        warm = dataclasses.replace(self.profile, turns=1, think_s=0.0, warm_start=False, mode="closed" if self.profile.mode == "poisson" else self.profile.mode)
        self._serve(warm, tokens=min(_WARMUP_TOKENS, self.workload.max_new_tokens), session="warm-up")

    def serve(self, repeat: int) -> Any:
        from .rounds import Round

        def probe(profile: LoadProfile) -> LoadResult:
            self._probe_index += 1
            result = self._serve(profile, tokens=self.workload.max_new_tokens, session=f"{repeat + 1}.{self._probe_index}")
            errors = [rec for rec in result.records if rec.status == "error"]
            if errors and len(errors) == len(result.records):
                raise EngineError(f"every request failed in a capacity probe at {profile.offered():g}: {errors[0].error}")
            return result

        search = CapacitySearch(self.profile, run=probe)
        answer = search.run()
        self.searches.append(answer)
        at = answer["capacity"] if answer["capacity"] is not None else min(search.results)
        result = search.results[at]
        readings, counts = load_readings(result)
        readings["capacity"] = answer["capacity"]
        if self.profile.mode == "conversations":
            readings["turns"] = by_turn(result.records)
        done = [rec for rec in result.records if rec.status == "done"]
        samples = [dataclasses.replace(Sample.from_generation(as_generation(rec), repeat=repeat), ttft_ms=rec.ttft_ms) for rec in done]
        return Round(samples=samples, wall_s=result.wall_s, output_tokens=result.output_tokens(), outputs={rec.id: list(rec.token_ids) for rec in done},
                     texts={rec.id: rec.text for rec in done}, readings=readings)

    def check_memory(self, peak_mb: float | None, capacity: float | None) -> None:
        return None  # a probe over the memory is over capacity by its failed requests, not a failed round

    def forget_round(self) -> None:
        """Drop the last round's search (a discarded try)."""
        if self.searches:
            self.searches.pop()

    def extra(self) -> dict[str, Any]:
        return {"load": {"mode": self.profile.mode, "capacity": list(self.searches), "slos": self.profile.slos(),
                         "slo_percentile": self.profile.slo_percentile, "clients": self.profile.offered()}}

