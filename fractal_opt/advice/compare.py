"""``compare``: two run folders or recipes side by side.

What differs between the two plans (field by field), the numbers each run recorded for its kept
plan with their within-run spread, and which targets each meets. A recipe has no numbers of its
own; ``measure=True`` builds both plans and measures them interleaved on this machine (the same
paired rule as a run's verdict), which is also the only fair comparison of two runs made on
different machines or days.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.errors import RecipeError
from ..core.machine import Machine
from ..language.recipe import Recipe, load_recipe
from ..language.targets import parse_targets
from ..measure.metrics import METRICS
from ..measure.noise import band
from ..measure.runner import measure_pair, paired_changes
from ..pipeline.targets import gaps
from ..report.reader import Reader
from ..tower.plan import Plan
from .pairs import Build, Engines, PairResult

__all__ = ["Comparison", "Side", "compare", "load_side", "plan_diff"]

# The numbers shown side by side (the tower table's speed and memory columns).
SHOWN = ("decode_tokens_per_s", "ttft_ms", "ttft_ms_p90", "e2e_ms", "throughput_tokens_per_s", "peak_memory_mb", "weight_mb")


@dataclass
class Side:
    """One side: where it came from, its plan, its recipe, and the numbers its run recorded (if a run)."""

    source: str
    kind: str  # run | recipe
    recipe: Recipe
    plan: Plan
    metrics: dict[str, Any] = field(default_factory=dict)
    machine: str = ""
    measured: list[tuple[str, Any]] = field(default_factory=list)  # a run's steps (data-step id, Step), for the frontier across runs


@dataclass
class Comparison:
    a: Side
    b: Side
    diff: list[tuple[str, Any, Any]]
    targets: dict[str, dict[str, dict[str, Any]]]  # side -> metric -> gap
    measured: list[PairResult] = field(default_factory=list)

    def pareto(self) -> dict[str, list[tuple[str, str]]]:
        """The Pareto set of every plan the two runs measured, per frontier (ids ``A3``: run A's step 3)."""
        from ..report.frontier import frontier_sets

        return frontier_sets([(f"{name}{i}", s) for side, name in ((self.a, "A"), (self.b, "B")) for i, s in side.measured])

    def to_text(self) -> str:
        a, b = self.a, self.b
        lines = [f"A: {a.source} ({a.kind}{', ' + a.machine if a.machine else ''})", f"B: {b.source} ({b.kind}{', ' + b.machine if b.machine else ''})", ""]
        if self.diff:
            lines.append("Plan differences (A -> B):")
            width = max(len(k) for k, _, _ in self.diff)
            lines += [f"  {k:<{width}}  {va!r} -> {vb!r}" for k, va, vb in self.diff]
        else:
            lines.append("The plans are the same.")
        lines.append("")
        if a.metrics or b.metrics:
            lines.append("Recorded numbers of each run's kept plan (median ± within-run spread; runs on other machines or days are not comparable: use --measure):")
            for m in SHOWN:
                va, vb = _cell(a.metrics, m), _cell(b.metrics, m)
                if va != "–" or vb != "–":
                    lines.append(f"  {m:<26} A {va:<18} B {vb}")
            lines.append("")
        pareto = self.pareto()
        if pareto:
            lines.append("Pareto set across both runs (every measured plan; A3 = run A's step 3, 0 = its baseline):")
            lines += [f"  {title}: " + ", ".join(f"{i} {label}" for i, label in plans) for title, plans in pareto.items()]
            lines.append("")
        if self.measured:
            lines.append("Measured here, interleaved (B against A; interval and noise band as a run's verdict uses them):")
            lines += [f"  {r.text()}" for r in self.measured]
            lines.append("")
        for side, name in ((a, "A"), (b, "B")):
            g = self.targets.get(name) or {}
            if g:
                met = [m for m, x in g.items() if x["met"]]
                lines.append(f"Targets, {name}: " + "; ".join(f"{m} {x['text']}" for m, x in g.items()) + f" ({len(met)} of {len(g)} met)")
        return "\n".join(lines).rstrip() + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {"a": {"source": self.a.source, "kind": self.a.kind, "plan": self.a.plan.to_dict(), "metrics": self.a.metrics},
                "b": {"source": self.b.source, "kind": self.b.kind, "plan": self.b.plan.to_dict(), "metrics": self.b.metrics},
                "diff": [[k, va, vb] for k, va, vb in self.diff], "targets": self.targets, "measured": [r.to_dict() for r in self.measured],
                "pareto": {title: [list(p) for p in plans] for title, plans in self.pareto().items()}}


def load_side(source: str | Path) -> Side:
    """A run folder (its ``trace.json``: the kept plan and its numbers) or a recipe file (its plan)."""
    from ..report.trace import Trace

    path = Path(source)
    trace_path = path / "trace.json" if path.is_dir() else path if path.name == "trace.json" else None
    if trace_path is not None:
        if not trace_path.is_file():
            raise RecipeError(f"{str(path)!r}: neither a recipe nor a run folder (no trace.json in it).")
        try:
            trace = Trace.from_dict(json.loads(trace_path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError) as e:
            raise RecipeError(f"{str(trace_path)!r}: not a readable trace ({type(e).__name__}: {e}).") from None
        recipe = trace.to_recipe()
        final = trace.final or {}
        plan = Plan.from_dict(final["plan"]) if final.get("plan") else recipe.plan()
        m = trace.machine or {}
        machine = f"{m.get('cpu', '?')}, GPUs: {', '.join(m.get('cuda_devices') or []) or 'none'}" if m else ""
        reader = Reader(trace)  # the final plan's one figure per metric: its confirmation's where it measured one
        return Side(source=str(source), kind="run", recipe=recipe, plan=plan, metrics=reader.final_metrics(), machine=machine, measured=reader.steps())
    recipe = load_recipe(path, check_model=False)  # comparing plans needs no model files
    return Side(source=str(source), kind="recipe", recipe=recipe, plan=recipe.plan())


def plan_diff(a: Plan, b: Plan) -> list[tuple[str, Any, Any]]:
    """``(section.field, a's value, b's value)`` for every field that differs (``applied`` left out)."""
    da, db = a.to_dict(), b.to_dict()
    out = []
    for section in ("source", "hardware", "model", "scheduling", "application"):
        va, vb = da.get(section), db.get(section)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += [(f"{section}.{k}", va.get(k), vb.get(k)) for k in va if va.get(k) != vb.get(k)]
        elif va != vb:
            out.append((section, va, vb))
    return out


def compare(a: str | Path, b: str | Path, *, measure: bool = False, workload: str | None = None, build: Build | None = None,
            machine: Machine | None = None, progress: Callable[[str], None] | None = None) -> Comparison:
    """Compare two run folders or recipes; ``measure`` re-measures both plans interleaved here."""
    sa, sb = load_side(a), load_side(b)
    targets_spec = sa.recipe.targets.to_dict() or sb.recipe.targets.to_dict()
    targets = parse_targets(targets_spec) if targets_spec else None
    result = Comparison(a=sa, b=sb, diff=plan_diff(sa.plan, sb.plan), targets={})
    if targets:
        for side, name in ((sa, "A"), (sb, "B")):
            if side.metrics:
                result.targets[name] = gaps(targets, side.metrics)
    if measure:
        result.measured = _measure(sa, sb, workload=workload, build=build, machine=machine, progress=progress or (lambda m: None))
        if targets and result.measured:
            for name, which in (("A", "before"), ("B", "after")):
                result.targets[name] = gaps(targets, {r.metric: getattr(r, which) for r in result.measured})
    return result


def _measure(a: Side, b: Side, *, workload: str | None, build: Build | None, machine: Machine | None, progress: Callable[[str], None]) -> list[PairResult]:
    wl = a.recipe.workload if workload is None else replace(a.recipe.workload, suite=workload, limit=None)
    requests = wl.requests()
    machine = machine or Machine.probe()
    engines = Engines(build=build, machine=machine, workload=wl, progress=progress)
    min_effect = a.recipe.policy.min_effect
    try:
        progress("compare: building A and B")
        before, after = measure_pair(engines.get(a.plan), engines.get(b.plan), wl, requests=requests, min_effect=min_effect,
                                     progress=lambda m: progress(f"compare: measuring, {m}"))
    finally:
        engines.close()
    intervals = paired_changes(before, after)
    sa, sb = before.summary(), after.summary()
    out = []
    for m in SHOWN:
        if m not in METRICS:
            continue
        iv = intervals.get(m)
        if iv is None and sa.get(m) is None:
            continue
        out.append(PairResult(metric=m, before=sa.get(m), after=sb.get(m), change=iv.change if iv else None,
                              interval=(iv.low, iv.high) if iv else None, band=band(iv, min_effect=min_effect)))
    return out


def _cell(metrics: dict[str, Any], m: str) -> str:
    v = metrics.get(m)
    if not isinstance(v, int | float):
        return "–"
    spread = (metrics.get("spread") or {}).get(m)
    text = f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
    return text + (f" ±{spread:.0%}" if isinstance(spread, int | float) and spread else "")
