"""The run's time budget (``workload.budget_s``, ``run --budget 6m``) and what a search is told of it.

A budget bounds the whole run, the baseline and the final confirmation included. A search is told
what it may spend (:func:`search_context`): the budget left, less what the run still needs after
it (the final confirmation, about as long as the baseline's measurement, and a judged step for
each pass behind the search), and the mean time its screened and judged candidates took so far,
so it orders its work to fit. Once the budget is spent, the passes still to run are skipped with
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
# A judged step's time before one has been measured in this run (seconds): the reserve for the
# passes behind a search reads it.
_FIRST_STEP_GUESS_S = 30.0


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
    """The mean seconds of the run's ``screened_out`` steps and of its fully judged ones (kept or
    rolled back), from their timings (build, warm-up, measurement, quality); a key only once one exists."""
    spent: dict[str, list[float]] = {"screened_out": [], "judged": []}
    for s in steps:
        kind = "screened_out" if s.status == "screened_out" else "judged" if s.status in ("kept", "rolled_back") else None
        if kind:
            spent[kind].append(sum(v for k, v in s.timings.items() if k.endswith("_s") and isinstance(v, int | float)))
    return {k: round(statistics.fmean(v), 1) for k, v in spent.items() if v}


def search_context(*, plan: Plan, machine: Machine, workload: Any, trace: Trace, budget: TimeBudget, passes_after: int,
                   skip: Callable[[Pass, Plan], str | None], runtimes: Any) -> SearchContext:
    """What a search may read now (:class:`~fractal_opt.tower.passes.SearchContext`): the budget
    left less the reserve for what the run still needs after it (``passes_after`` judged steps
    and the final confirmation, as long as the baseline's measurement)."""
    timings = step_seconds(trace.steps)
    left = budget.left()
    if left is not None:
        confirm_s = float((trace.baseline.timings.get("measure_s") if trace.baseline is not None else None) or 0.0)
        left -= confirm_s + passes_after * timings.get("judged", _FIRST_STEP_GUESS_S)
    return SearchContext(plan=plan, machine=machine, workload=workload, skip=skip, runtimes=runtimes, remaining_s=left, step_s=timings)


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
