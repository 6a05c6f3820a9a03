"""``bisect``: which kept pass (or pair of passes) makes a tuned plan worse on a workload.

The field guide's rule when an optimized deployment is slower: roll back one change at a time, in
halves, until the change that hurts is found. A run folder's kept passes (``trace.json``) are
re-applied to the baseline plan in subsets; each subset is measured against the baseline,
interleaved, and called *bad* when ``metric`` is worse beyond the noise band (the same rule as a
run's verdict, :mod:`.pairs`). Starting from the full tuned plan (bad), the candidates are split
in two and each half rolled back:

- only rolling back the first half fixes it: the culprit is in the first half;
- only rolling back the second half fixes it: it is in the second half;
- rolling back either half fixes it: a pair, one pass in each half, hurts only together
  (the field guide's "a compression plugin with a quantized KV cache");
- neither fixes it: each half holds a culprit of its own.

That is about two measurements per halving: ``2 log2(n)`` for one culprit among ``n`` kept passes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.errors import RecipeError
from ..core.machine import Machine
from ..language.recipe import Recipe
from ..tower.passes import Pass
from ..tower.plan import Plan
from .pairs import Build, Engines, PairResult, measure_plans

__all__ = ["BisectResult", "bisect", "bisect_run", "load_run"]


@dataclass
class Probe:
    """One measured subset: which kept passes were applied, and how it did against the baseline."""

    applied: tuple[str, ...]
    rolled_back: tuple[str, ...]
    result: PairResult

    @property
    def bad(self) -> bool:
        return self.result.worse


@dataclass
class BisectResult:
    metric: str
    kept: list[str]
    full: Probe | None
    culprits: list[str] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "kept": self.kept, "culprits": self.culprits, "note": self.note,
                "probes": [{"applied": list(p.applied), "rolled_back": list(p.rolled_back), "bad": p.bad, **p.result.to_dict()} for p in self.probes]}

    def to_text(self) -> str:
        lines = [f"Bisecting {len(self.kept)} kept pass(es) on {self.metric} against the baseline: {', '.join(self.kept) or 'none'}", ""]
        for p in self.probes:
            what = "the tuned plan (all kept)" if not p.rolled_back else "rolled back: " + ", ".join(p.rolled_back)
            lines.append(f"  {'BAD' if p.bad else 'ok ':<3}  {what:<60} {p.result.text()}")
        lines.append("")
        if self.culprits:
            kind = "pair (worse only together)" if len(self.culprits) == 2 and "pair" in self.note else ("culprit" if len(self.culprits) == 1 else "culprits")
            lines.append(f"The {kind}: {', '.join(self.culprits)}. {self.note}".rstrip())
        else:
            lines.append(self.note or "No culprit found.")
        return "\n".join(lines)


def _label(p: Pass) -> str:
    return f"{p.layer.section}/{p.describe()}"


def _plan(base: Plan, passes: Sequence[Pass]) -> Plan:
    plan = base
    for p in passes:
        plan = p.apply(plan).with_applied(p.name)
    return plan


def bisect(recipe: Recipe, *, metric: str | None = None, build: Build | None = None, machine: Machine | None = None,
           progress: Callable[[str], None] | None = None) -> BisectResult:
    """Find the kept pass(es) of ``recipe`` (a tuned recipe: its passes are the kept ones) that make
    ``metric`` worse than the baseline on the recipe's workload."""
    say = progress or (lambda m: None)
    metric = _metric(recipe, metric)
    kept = list(recipe.passes)
    labels = {p: _label(p) for p in kept}
    result = BisectResult(metric=metric, kept=[labels[p] for p in kept], full=None)
    if not kept:
        result.note = "The run kept no pass: its plan is the baseline, there is nothing to roll back."
        return result
    engines = Engines(build=build, machine=machine or Machine.probe(), workload=recipe.workload, progress=say)
    search = _Search(recipe, kept=kept, labels=labels, engines=engines, result=result, say=say)
    try:
        _conclude(search)
    finally:
        engines.close()
    return result


def _metric(recipe: Recipe, metric: str | None) -> str:
    """The metric to bisect on: the one asked for, else the recipe's objective (decode speed for "auto")."""
    from ..measure.metrics import METRICS

    metric = metric or (recipe.policy.objective if recipe.policy.objective != "auto" else "decode_tokens_per_s")
    if metric not in METRICS:
        from ..core.errors import closest

        raise RecipeError(f"bisect: unknown metric {metric!r}. Valid metrics are: {list(METRICS)}.{closest(metric, METRICS)}")
    return metric


class _Search:
    """The halving search over one tuned recipe's kept passes; each subset is measured against the
    baseline at most once (the probes land in ``result.probes`` in the order they were measured)."""

    def __init__(self, recipe: Recipe, *, kept: list[Pass], labels: dict[Pass, str], engines: Engines, result: BisectResult,
                 say: Callable[[str], None]):
        self.recipe, self.kept, self.labels, self.engines, self.result, self.say = recipe, kept, labels, engines, result, say
        self.base = recipe.base_plan()
        self.cache: dict[tuple[str, ...], Probe] = {}

    def bad(self, subset: Sequence[Pass]) -> bool:
        """True when the baseline plus ``subset`` (in tower order) is worse than the baseline beyond noise."""
        ordered = [p for p in self.kept if p in subset]  # tower order, as the run applied them
        key = tuple(self.labels[p] for p in ordered)
        if key not in self.cache:
            plan = _plan(self.base, ordered)
            back = tuple(self.labels[p] for p in self.kept if p not in subset)
            self.say(f"bisect: measuring {'the tuned plan' if not back else 'with ' + ', '.join(back) + ' rolled back'} against the baseline")
            pair = measure_plans(self.engines.get(self.base), self.engines.get(plan), self.recipe.workload, metric=self.result.metric,
                                 min_effect=self.recipe.policy.min_effect, progress=lambda m: self.say(f"bisect:   {m}"))
            if plan != self.base:
                self.engines.release(plan)
            probe = Probe(applied=key, rolled_back=back, result=replace(pair, before_measurement=None, after_measurement=None))
            self.cache[key] = probe
            self.result.probes.append(probe)
        return self.cache[key].bad

    def find(self, candidates: list[Pass], fixed: list[Pass]) -> tuple[list[Pass], bool]:
        """Culprits among ``candidates`` given bad(fixed + candidates); True when a pair was found."""
        if len(candidates) == 1:
            return candidates, False
        half = len(candidates) // 2
        first, second = candidates[:half], candidates[half:]
        without_first = self.bad(fixed + second)
        without_second = self.bad(fixed + first)
        if not without_first and without_second:
            return self.find(first, fixed)[0], False
        if without_first and not without_second:
            return self.find(second, fixed)[0], False
        if not without_first and not without_second:  # either half rolled back fixes it: one pass in each hurts with the other
            a, _ = self.find(first, fixed + second)
            b, _ = self.find(second, fixed + first)
            return a + b, True
        a, _ = self.find(first, fixed)
        b, _ = self.find(second, fixed)
        return a + b, False


def _conclude(search: _Search) -> None:
    """Measure the tuned plan; when it is worse, bisect and write the culprits and the note into the result."""
    result, metric = search.result, search.result.metric
    bad = search.bad(search.kept)
    result.full = result.probes[-1]
    if not bad:
        result.note = (f"The tuned plan is not worse than the baseline on {metric} here ({result.full.result.text()}): "
                       "nothing to bisect. Try another --metric or --workload.")
        return
    culprits, pair = search.find(search.kept, [])
    result.culprits = [search.labels[p] for p in culprits]
    if pair:
        result.note = "pair: either rolled back fixes it; each alone was kept because it helped on the run's workload."
    elif len(culprits) == 1:
        result.note = f"Rolling it back is the fix: run the tuned recipe without {result.culprits[0]}, or re-run fractal-opt on this workload."


def load_run(run_dir: str | Path) -> Recipe:
    """The tuned recipe of a run folder: the kept passes of its ``trace.json``."""
    from ..report.trace import Trace

    path = Path(run_dir)
    trace_path = path / "trace.json" if path.is_dir() else path
    if not trace_path.is_file():
        raise RecipeError(f"{str(path)!r} is not a run folder: it has no trace.json (the output folder of fractal-opt run).")
    try:
        data = json.loads(trace_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise RecipeError(f"{str(trace_path)!r}: not a readable trace ({e}).") from None
    return Trace.from_dict(data).to_recipe()


def bisect_run(run_dir: str | Path, *, workload: str | None = None, metric: str | None = None, build: Build | None = None,
               machine: Machine | None = None, progress: Callable[[str], None] | None = None) -> BisectResult:
    """:func:`bisect` on a run folder's kept passes, on ``workload`` (a suite) or the run's own."""
    recipe = load_run(run_dir)
    if workload is not None:
        recipe = replace(recipe, workload=replace(recipe.workload, suite=workload, limit=None))
        recipe.workload.requests()  # validates the suite before any model loads
    return bisect(recipe, metric=metric, build=build, machine=machine, progress=progress)
