"""The ``conversations`` load as rounds of the one measurement runner.

Each round replays every user's conversation through a fresh server
(:func:`~fractal_opt.measure.conversation_load.run_conversations`) as new users (round ``r``'s
first messages carry session ``r``, so no round reuses another's conversation from a prefix cache;
the warm-up's users are session 0). Its readings are what :class:`~fractal_opt.measure.rounds.LoadRounds`
gives (TTFT / ITL / e2e percentiles as callers saw them, request counts, goodput), plus the per-turn
table (:func:`~fractal_opt.measure.conversation_load.by_turn`); ``extra()["load"]["by_turn"]`` is
that table over every round, which the trace keeps with the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.errors import EngineError
from .conversation_load import by_turn, run_conversations
from .load_readings import as_generation, load_readings
from .metrics import Sample

if TYPE_CHECKING:
    from ..engine.protocol import Engine
    from ..workloads.workload import Request, Workload
    from .load import LoadRecord

__all__ = ["ConversationRounds"]

_WARMUP_TOKENS = 8  # the warm-up's budget per turn (every prompt shape through the kernels, briefly)


class ConversationRounds:
    """Rounds that replay the suite's conversations, ``users`` at once, turn by turn.

    Raises (from ``serve`` / ``check_memory``):
        EngineError: a turn failed, or the round left less than ``memory_headroom`` free.
    """

    def __init__(self, engine: Engine, workload: Workload, requests: Sequence[Request]):
        self.engine = engine
        self.workload = workload
        self.profile = workload.load_profile()
        self.conversations = workload.conversations()
        self.users = self.profile.users
        self.records: list[LoadRecord] = []  # every round's, for the per-turn table over all rounds
        self.rounds: list[dict[str, Any]] = []
        self._last_records = 0  # how many of ``records`` the last round added (forget_round drops them)

    def warm_up(self) -> None:
        warm = dataclasses.replace(self.profile, turns=1, think_s=0.0, warm_start=False)
        with self.engine.server(seed=self.workload.seed, ignore_eos=self.profile.ignore_eos) as server:
            run_conversations(server, self.conversations, warm, max_new_tokens=min(_WARMUP_TOKENS, self.workload.max_new_tokens), session=0)

    def serve(self, repeat: int) -> Any:
        from .rounds import Round

        with self.engine.server(seed=self.workload.seed, ignore_eos=self.profile.ignore_eos) as server:
            result = run_conversations(server, self.conversations, self.profile, max_new_tokens=self.workload.max_new_tokens, session=repeat + 1)
        errors = [rec for rec in result.records if rec.status == "error"]
        if errors:
            raise EngineError(f"{len(errors)} of {len(result.records)} turns failed under the conversations load ({self.users} users): {errors[0].error}")
        readings, counts = load_readings(result)
        readings["turns"] = by_turn(result.records)
        self.rounds.append(counts)
        self.records.extend(result.records)
        self._last_records = len(result.records)
        done = [rec for rec in result.records if rec.status == "done"]
        samples = [dataclasses.replace(Sample.from_generation(as_generation(rec), repeat=repeat), ttft_ms=rec.ttft_ms) for rec in done]
        return Round(samples=samples, wall_s=result.wall_s, output_tokens=result.output_tokens(),
                     outputs={rec.id: list(rec.token_ids) for rec in done}, texts={rec.id: rec.text for rec in done}, readings=readings)

    def check_memory(self, peak_mb: float | None, capacity: float | None) -> None:
        if capacity and peak_mb is not None and peak_mb > (1 - self.profile.memory_headroom) * capacity:
            msg = (f"memory headroom tripped under the conversations load: peak {peak_mb:.0f} MB of {capacity:.0f} MB leaves less than "
                   f"{self.profile.memory_headroom:.0%} free ({self.users} users)")
            raise EngineError(msg)

    def forget_round(self) -> None:
        """Drop the last round's counts and records (a discarded try): the per-turn table counts kept rounds only."""
        if self.rounds:
            self.rounds.pop()
            del self.records[len(self.records) - self._last_records:]
            self._last_records = 0

    def extra(self) -> dict[str, Any]:
        p = self.profile
        turns = sum(len(self.conversations[u % len(self.conversations)].turns[: p.turns or None]) for u in range(self.users))
        return {"load": {"mode": "conversations", "clients": self.users, "requests": turns, "users": self.users, "turns": p.turns, "think_s": p.think_s, "history": p.history,
                         "conversations": len(self.conversations), "rounds": list(self.rounds), "by_turn": by_turn(self.records)}}
