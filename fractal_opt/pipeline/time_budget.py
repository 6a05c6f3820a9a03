"""The run's time budget (``workload.budget_s``, ``run --budget 6m``) and what a search is told of it.

A budget bounds the whole run, the baseline and the final confirmation included. A search is told
what it may spend (:func:`search_context`): the budget left, less what the run still needs after
it (the final confirmation, which measures the baseline once a round where its A/A calibration
measured it twice, so about half that time; and a judged step for each pass and each search behind
it), and what its screened and judged candidates took so far, so it orders its work to fit. Once the budget is spent, the passes still to run are skipped with
that reason, and the run confirms the best plan found.

Example:
    >>> parse_duration("6m"), parse_duration("90s"), parse_duration("1h"), parse_duration(360)
    (360.0, 90.0, 3600.0, 360.0)
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..core.errors import RecipeError
from ..core.machine import Machine
from ..report.trace import Step, Trace
from ..tower.passes import Pass, SearchContext
from ..tower.plan import Plan

__all__ = ["TimeBudget", "parse_duration", "search_context", "step_seconds"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|min)?\s*$")
_UNIT_S = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
# What each pass behind a search is reserved (seconds): on the tuned embedded model
# (recipes/quickstart.yaml, `make demo`, 2-core Intel Xeon, 2026-12-05) continuous batching took
# 26 s, the slots search 14 s (two screens), the q8_0 KV cache 32 s (a screen, then the quality
# gate that stopped it) and the token cap 17 s, where a step against the float32 baseline took 55 s.
_STEP_RESERVE_S = 25.0


def parse_duration(value: str | float | int) -> float:
    """Seconds from ``"6m"``, ``"90s"``, ``"1h"`` or a number of seconds.

    Raises:
        RecipeError: anything else, or a duration that is not above zero.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if m is None:
            raise RecipeError(f"time budget: got {value!r}, expected a duration such as 6m, 90s or 1h (or a number of seconds).")
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds <= 0:
        raise RecipeError(f"time budget: got {value!r}, expected a duration above zero such as 6m.")
    return seconds


class TimeBudget:
    """The run's clock against its budget (``budget_s`` None: no budget, nothing is ever spent)."""

    def __init__(self, budget_s: float | None, *, clock: Callable[[], float] = time.monotonic):
        self.budget_s, self.clock = budget_s, clock
        self.started = clock()

    def left(self) -> float | None:
        """Seconds left (None without a budget)."""
        return None if self.budget_s is None else self.budget_s - (self.clock() - self.started)

    def spent(self) -> str | None:
        """Why the remaining passes are skipped (the budget is spent), or None."""
        left = self.left()
        if left is None or left > 0:
            return None
        return f"the time budget ({_clock(self.budget_s or 0)}) is spent: the run confirms the best plan found so far"


def step_seconds(steps: Sequence[Step]) -> dict[str, float]:
    """The seconds a ``screened_out`` step and a fully judged one (kept or rolled back) take now,
    from their timings (build, warm-up, measurement, quality): the mean of the screened ones, and
    the latest judged one (each is measured against the kept plan of its time, and the first ones
    of a run against the slow baseline: the latest predicts the next best); a key once one exists."""
    spent: dict[str, list[float]] = {"screened_out": [], "judged": []}
    for s in steps:
        kind = "screened_out" if s.status == "screened_out" else "judged" if s.status in ("kept", "rolled_back") else None
        if kind:
            spent[kind].append(sum(v for k, v in s.timings.items() if k.endswith("_s") and isinstance(v, int | float)))
    out = {"screened_out": round(statistics.fmean(spent["screened_out"]), 1)} if spent["screened_out"] else {}
    return out | ({"judged": round(spent["judged"][-1], 1)} if spent["judged"] else {})


def search_context(*, plan: Plan, machine: Machine, workload: Any, trace: Trace, budget: TimeBudget, passes_after: int,
                   skip: Callable[[Pass, Plan], str | None], runtimes: Any) -> SearchContext:
    """What a search may read now (:class:`~fractal_opt.tower.passes.SearchContext`): the budget
    left less the reserve for what the run still needs after it (a judged step on the tuned plan
    for each of the ``passes_after`` passes, and the final confirmation), the times of its steps so
    far, and the plans whose answers a quality guard refused."""
    left = budget.left()
    if left is not None:
        confirm_s = float((trace.baseline.timings.get("measure_s") if trace.baseline is not None else None) or 0.0) / 2
        left -= confirm_s + passes_after * _STEP_RESERVE_S
    refused = tuple((s.label(), s.plan, tuple(s.metrics["tripped"]["quality"])) for s in trace.steps
                    if s.plan and ((s.metrics or {}).get("tripped") or {}).get("quality"))
    return SearchContext(plan=plan, machine=machine, workload=workload, skip=skip, runtimes=runtimes, remaining_s=left,
                         step_s=step_seconds(trace.steps), refused=refused)


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
