"""Which steps a run tries, and why one is skipped: the same rules for every pass.

A pass tells the runner only through its protocol (:class:`fractal_opt.tower.passes.Pass`):
``next_step`` (a search runs as several steps, each proposed from the outcomes of the earlier
ones: :class:`PassSteps`), ``unavailable`` (the machine lacks a device or a
package), ``check`` (the pass's own rules), ``apply`` (a plan it does not change is a no-op,
derived here, never written in the pass), and the runtime's ``refuse`` of the new plan.

Example:
    >>> from fractal_opt.layers.hardware import Dtype
    >>> from fractal_opt.tower.plan import Plan
    >>> from fractal_opt.testing import cpu_machine
    >>> skip_reason(Dtype(dtype="float32"), Plan(source="x"), cpu_machine(), refuse=lambda plan: None)
    'check: the plan already runs in float32'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..core.errors import FractalOptError
from ..core.machine import Machine
from ..engine.registry import RUNTIMES
from ..tower.passes import Pass, SearchContext, StepResult
from ..tower.plan import Plan

__all__ = ["MAX_STEPS_PER_PASS", "UNCHANGED", "PassSteps", "skip_reason"]

# A search that has not ended after this many steps is a bug in its pass, not a long search: a
# doubling-then-bisecting search over levels up to 2^20 needs about 40.
MAX_STEPS_PER_PASS = 64
# How skip_reason words "the plan already has what the pass sets" (a search reads it as held).
UNCHANGED = "check: the plan already has this"


class PassSteps:
    """The steps one pass runs, proposed one at a time (:meth:`~fractal_opt.tower.passes.Pass.next_step`)
    from how the earlier ones ended, which the runner records here.

    A plain pass runs once, as itself; a pass whose first step is not itself searches (the
    concurrency search), and its steps are labelled "search step k" because their number is not
    known in advance.

    Example:
        >>> from fractal_opt.layers.scheduling import Concurrency
        >>> steps = PassSteps(Concurrency(mode="ramp", start=4, max_limit=8))
        >>> for step in steps:
        ...     print(steps.label(2, 3), step.describe())
        ...     steps.record(step, "kept")
        [2/3, search step 1] concurrency(mode=fixed, limit=4)
        [2/3, search step 2] concurrency(mode=fixed, limit=8)
        >>> steps.conclusion()["answer"]
        "max concurrency that holds (no absolute latency SLO set: the guards in force, throughput not worse): 8 or more (the search's max_limit; no level up to it failed)"
    """

    def __init__(self, source: Pass, *, context: Callable[[], SearchContext] | None = None):
        self.source = source
        self.history: list[StepResult] = []
        self._context = context or (lambda: None)  # the kept plan, machine, load and time left when each step is proposed
        first = source.next_step((), context=self._context())
        self.searches = first is None or first != source  # a search may find nothing to try: it still answers why
        self.screens = self.searches and source.screens()  # its steps are screened before the full rounds
        self._next = first

    def __iter__(self) -> Iterator[Pass]:
        while self._next is not None:
            if len(self.history) >= MAX_STEPS_PER_PASS:
                raise FractalOptError(f"pass {self.source.describe()} proposed more than {MAX_STEPS_PER_PASS} steps; its next_step() never ends the search.")
            step = self._next
            self._next = None
            yield step
            if not self.history or self.history[-1].step is not step:
                raise FractalOptError(f"pass {self.source.name}: record() each step before asking for the next.")
            self._next = self.source.next_step(tuple(self.history), context=self._context())

    def record(self, step: Pass, status: str, outcome: str = "", reason: str = "", *, metrics: dict[str, Any] | None = None,
               plan: dict[str, Any] | None = None) -> None:
        """How ``step`` ended (the trace's status, the verdict's outcome and the step's reason; its
        metrics, for the quality guards that stopped it, and the plan it measured)."""
        if status == "skipped" and reason.startswith(UNCHANGED):
            status = "unchanged"
        quality = tuple(((metrics or {}).get("tripped") or {}).get("quality", ()))
        self.history.append(StepResult(step=step, status=status, outcome=outcome, reason=reason, quality_tripped=quality, plan=plan or None))

    def label(self, index: int, total: int) -> str:
        """``[3/5]`` (pass 3 of 5), with ``search step k`` for the k-th step of a search."""
        return f"[{index}/{total}" + (f", search step {len(self.history) + 1}]" if self.searches else "]")

    def conclusion(self, guards: Sequence[Any] = ()) -> dict[str, Any] | None:
        """The pass's answer once its steps are done (a search's result), or None."""
        return self.source.conclusion(tuple(self.history), guards=guards, context=self._context()) if self.searches else None


def skip_reason(p: Pass, plan: Plan, machine: Machine, *, refuse: Callable[[Plan], str | None] | None = None) -> str | None:
    """Why the runner skips ``p`` on ``plan``, or None to build and measure it.

    In order: the machine cannot run the pass (``unavailable``), the pass refuses the plan
    (``check``), the plan already has what the pass sets (``p.apply(plan) == plan``: measuring a
    no-op only invites noise to decide), the runtime cannot honour the new plan (``refuse``; None =
    the runtime the plan names in the process's registry, :data:`fractal_opt.runtimes.RUNTIMES`).
    """
    if (why := p.unavailable(machine)) is not None:
        return f"check: {why}"
    if (why := p.check(plan, machine)) is not None:
        return f"check: {why}"
    candidate = p.apply(plan)
    if candidate == plan:
        return f"{UNCHANGED} ({p.describe()} changes nothing)"
    if (why := (refuse or RUNTIMES.refuse)(candidate)) is not None:
        return f"runtime {candidate.hardware.runtime}: {why}"
    return None
