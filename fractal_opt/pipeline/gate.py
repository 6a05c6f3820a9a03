"""Which steps a run tries, and why one is skipped: the same rules for every pass.

A pass tells the runner only through its protocol (:class:`fractal_opt.passes.Pass`):
``expand`` (a ramp runs as several steps), ``unavailable`` (the machine lacks a device or a
package), ``check`` (the pass's own rules), ``apply`` (a plan it does not change is a no-op,
derived here, never written in the pass), and the runtime's ``refuse`` of the new plan.

Example:
    >>> from fractal_opt.layers.hardware import Dtype
    >>> from fractal_opt.plan import Plan
    >>> from fractal_opt.testing import cpu_machine
    >>> skip_reason(Dtype(dtype="float32"), Plan(source="x"), cpu_machine(), refuse=lambda plan: None)
    'check: the plan already runs in float32'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .. import runtimes
from ..machine import Machine
from ..passes import Pass
from ..plan import Plan

__all__ = ["expand_ramps", "skip_reason"]


def expand_ramps(passes: Sequence[Pass]) -> list[tuple[Pass, Pass | None]]:
    """Each step with the ramp it belongs to: the pass it was expanded from, or None.

    A pass whose :meth:`~fractal_opt.passes.Pass.expand` is just itself runs alone; any other
    expansion (a concurrency ramp, one fixed level per step) is a ramp, which the runner stops
    where the ramp's own ``stop`` rule says.
    """
    out: list[tuple[Pass, Pass | None]] = []
    for p in passes:
        steps = p.expand()
        ramp = None if steps == [p] else p
        out.extend((step, ramp) for step in steps)
    return out


def skip_reason(p: Pass, plan: Plan, machine: Machine, *, refuse: Callable[[Plan], str | None] | None = None) -> str | None:
    """Why the runner skips ``p`` on ``plan``, or None to build and measure it.

    In order: the machine cannot run the pass (``unavailable``), the pass refuses the plan
    (``check``), the plan already has what the pass sets (``p.apply(plan) == plan``: measuring a
    no-op only invites noise to decide), the runtime cannot honour the new plan (``refuse``; None =
    the runtime the plan names, :func:`fractal_opt.runtimes.refuse`).
    """
    if (why := p.unavailable(machine)) is not None:
        return f"check: {why}"
    if (why := p.check(plan, machine)) is not None:
        return f"check: {why}"
    candidate = p.apply(plan)
    if candidate == plan:
        return f"check: the plan already has this ({p.describe()} changes nothing)"
    if (why := (refuse or runtimes.refuse)(candidate)) is not None:
        return f"runtime {candidate.hardware.runtime}: {why}"
    return None
