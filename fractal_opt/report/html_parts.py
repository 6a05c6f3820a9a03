"""What every report.html section shares: a step's layer, objective and label, a number tied to
trace.json (a table cell, a one-user figure), the words for a step's status.

The sections (:mod:`.html_sections`, :mod:`.html_charts`) read the trace through
:class:`~.reader.Reader` (the steps in page order, the policy, the final figures).
"""

from __future__ import annotations

from typing import Any

from ..language.policy import Policy
from ..tower.passes import Layer
from . import one_user
from .labels import pass_label
from .svg import data_attrs, esc, fmt_num, is_num
from .trace import Step, Trace

__all__ = ["Step", "Trace", "cell", "dig", "figure_html", "label", "layer_of", "objective_of", "pct", "status_text"]


def status_text(status: str) -> str:
    """A step's status in words ("rolled_back" -> "rolled back"); any status a trace records reads, a new one too."""
    return status.replace("_", " ")


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
