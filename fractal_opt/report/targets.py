"""What report.md and the terminal say about a run's targets: the gap at the baseline, what is
left after each measured step, which were met at the end and the limit that binds the others.

The gaps are computed while the run goes on (:func:`fractal_opt.pipeline.targets.note_targets`)
and stored in the trace; this module only writes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.text import fmt
from ..language.policy import ALL_METRICS

__all__ = ["target_lines", "target_summary"]


def target_lines(recipe: Mapping[str, Any], baseline: Any, steps: list[Any], final: Mapping[str, Any]) -> list[str]:
    """Markdown lines of a run's targets: the gap at the baseline, what is left after each measured
    step, and which were met at the end (with the binding limit of those that were not).
    Empty when the recipe has no targets."""
    targets = recipe.get("targets") or {}
    if not targets:
        return []
    names = list(targets)
    out = ["Targets (" + ", ".join(f"{m} {'>=' if ALL_METRICS.get(m, True) else '<='} {fmt(v, whole=True)}" for m, v in targets.items()) + "); "
           "what is left for the plan kept after each step:", "",
           "| step | status | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for s in ([baseline] if baseline else []) + list(steps):
        left = (s.metrics or {}).get("targets")
        if not left:
            continue
        label = "baseline" if s.status == "baseline" else f"{s.layer}/{s.pass_name}"
        cells = [left.get(m, {}).get("text", "–") for m in names]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in [label, s.status, *cells]) + " |")
    out.append("")
    summary = target_summary(final)
    return [*out, *summary, ""] if summary else out


def target_summary(final: Mapping[str, Any]) -> list[str]:
    """Which targets the plan kept at the end meets, and for each one it misses, the binding limit."""
    result = final.get("targets") or {}
    if not result:
        return []
    met = [m for m, g in result.items() if g.get("met")]
    missed = [m for m, g in result.items() if not g.get("met")]
    out = [f"Targets met: {', '.join(met) if met else 'none'}" + (f"; not met: {', '.join(missed)}." if missed else ". Every target is met.")]
    for m in missed:
        why = result[m].get("binding")
        out.append(f"- {m} ({result[m].get('text')}): {why}" if why else f"- {m}: {result[m].get('text')}")
    return out
