"""What every report.html section shares: the steps in page order, the policy, a step's layer,
objective and label, a number tied to trace.json (a table cell, a one-user figure), the verdict words.

The sections (:mod:`.report_sections`, :mod:`.report_charts`) read a trace by attribute only
(``Trace`` / ``Step`` below are ``Any``): trace.py renders through :mod:`.report_html`, so importing
it back would close a circle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.errors import RecipeError
from ..language.policy import Policy
from ..tower.passes import Layer
from . import one_user
from .labels import pass_label
from .report_svg import data_attrs, esc, fmt_num, is_num

Trace = Any
Step = Any

__all__ = ["STATUS_TEXT", "Step", "Trace", "all_steps", "cell", "dig", "figure_html", "label", "layer_of", "objective_of", "pct", "policy_of"]

STATUS_TEXT = {"baseline": "baseline", "kept": "kept", "rolled_back": "rolled back", "failed": "failed", "skipped": "skipped"}


def all_steps(trace: Trace) -> list[tuple[str, Step]]:
    """``(data-step index, step)``: "0" is the baseline, "1".. the steps in trace.json order."""
    out: list[tuple[str, Step]] = [("0", trace.baseline)] if trace.baseline else []
    return out + [(str(i), s) for i, s in enumerate(trace.steps, start=1)]


def policy_of(recipe: dict[str, Any]) -> Policy:
    data = recipe.get("policy") or {}
    names = {f.name for f in dataclasses.fields(Policy)}
    try:
        return Policy(**{k: v for k, v in data.items() if k in names})
    except (RecipeError, TypeError):  # an old or hand-edited trace: the report still renders, with default rules
        return Policy()


def layer_of(step: Step) -> Layer | None:
    return Layer.__members__.get(str(step.layer).upper())  # None for the baseline ("-")


def objective_of(policy: Policy, step: Step) -> str | None:
    layer = layer_of(step)
    return policy.objective_for(layer) if layer else None


def label(step: Step) -> str:
    return pass_label(step.pass_name, step.params, step.status)


def dig(metrics: dict[str, Any], path: str) -> Any:
    value: Any = metrics
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def cell(step: str, metrics: dict[str, Any], path: str, fmt: str = "") -> str:
    """A table cell holding a number from trace.json, tied to it by data attributes."""
    v = dig(metrics, path)
    text = (fmt.format(v) if fmt else fmt_num(v)) if is_num(v) else "–"
    return f'<td class="num"{data_attrs(step, "metrics." + path, v)}>{esc(text)}</td>'


def pct(v: Any) -> str:
    return f"{v:+.1%}" if is_num(v) else "–"


def figure_html(f: one_user.Figure, before: tuple[str, str], after: tuple[str, str]) -> str:
    """``TTFT 455 → 612 ms (+35%)``, each number tied to trace.json by its (step, path)."""
    a = f"<span{data_attrs(*after, f.after, f.scale)}>{esc(f.after_text)}</span>"
    if f.before is None:
        return f"{esc(f.name)} {a} {esc(f.unit)}"
    b = f"<span{data_attrs(*before, f.before, f.scale)}>{esc(f.before_text)}</span>"
    change = f.change
    return f"{esc(f.name)} {b} → {a} {esc(f.unit)}" + (f" ({change:+.0%})" if change is not None else "")
