"""The doctor's checklist items, and the checks of what a recipe asks of this machine: its passes
(``unavailable``) and the runtimes its plans run on (each runtime's capabilities table)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..core.machine import Machine

__all__ = ["FAIL", "NA", "OK", "WARN", "Check", "passes_check", "runtimes_check"]

OK, WARN, FAIL, NA = "ok", "warn", "fail", "n/a"


@dataclass(frozen=True)
class Check:
    """One item of the checklist: what was looked at, the verdict, what was found and what to do."""

    name: str
    verdict: str  # ok | warn | fail | n/a
    found: str
    action: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def passes_check(recipe: Any, machine: Machine) -> Check:
    """The recipe's own passes (with its parameters) this machine cannot run (``unavailable``): the
    run skips them. What a runtime refuses after another pass was kept is a run's business, not
    the machine's: such a pass still runs if that other pass is rolled back."""
    cannot = [f"{p.layer.section}/{p.name}: {why}" for p in recipe.passes if (why := p.unavailable(machine)) is not None]
    if not cannot:
        return Check("recipe passes", OK, f"this machine can run all {len(recipe.passes)} passes of the recipe")
    return Check("recipe passes", WARN, f"{len(cannot)} of {len(recipe.passes)} passes cannot run here (the run skips them): " + "; ".join(cannot),
                 "run the recipe on a machine that has what they need, or drop them")


def runtimes_check(recipe: Any, machine: Machine) -> Check:
    """The runtimes the recipe's plans run on (the base plan's, and each a pass switches to): can
    each run here (its capabilities, :meth:`fractal_opt.runtimes.Runtimes.availability`)?"""
    from ..runtimes import RUNTIMES

    plan, names = recipe.base_plan(), {recipe.base_plan().hardware.runtime: None}
    for p in recipe.passes:
        names[(plan := p.apply(plan)).hardware.runtime] = None
    here = RUNTIMES.availability(machine)
    cannot = [f"{n}: {here[n] if n in here else 'not a registered runtime'}" for n in names if here.get(n, "") is not None]
    if cannot:
        return Check("runtimes", WARN, f"{len(cannot)} of the recipe's {len(names)} runtimes cannot run here (the run skips their steps): " + "; ".join(cannot),
                     "install what each one names, or drop the passes that switch to it")
    idle = "; ".join(f"{n} keeps {RUNTIMES.get(n).idle.memory}" for n in names)
    return Check("runtimes", OK, f"all {len(names)} runtimes of the recipe run here ({', '.join(names)}); while idle, {idle}")
