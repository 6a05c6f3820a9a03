"""What a run produces: :class:`Result` in Python, and the run folder's files after every step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..language.recipe import Recipe, dump_recipe
from ..report.html import render_fragment, render_html
from ..report.markdown import report_md
from ..report.terminal import summary
from ..report.trace import Trace
from ..tower.plan import Plan
from .outputs import write_outputs

__all__ = ["Result", "write_run"]


@dataclass
class Result:
    """What a run produced: the final plan, the trace, and the tuned recipe."""

    plan: Plan
    trace: Trace
    recipe: Recipe
    out_dir: Path | None = None

    def _repr_html_(self) -> str:
        """In a notebook: the same content as report.html."""
        return render_fragment(self.trace)

    def to_text(self, width: int = 120) -> str:
        """What the terminal shows when the run ends: the answer first, then every step (:func:`fractal_opt.report.terminal.summary`)."""
        return summary(self.trace, width)

    def to_markdown(self) -> str:
        """report.md's text (:func:`fractal_opt.report.markdown.report_md`)."""
        return report_md(self.trace)

    def __repr__(self) -> str:
        where = f"\n  results in {self.out_dir} (report.html, report.md, trace.json, recipe.yaml)" if self.out_dir else ""
        plan, trace = (repr(x).replace("\n", "\n    ") for x in (self.plan, self.trace))  # their own lines, indented under them
        return f"Result(\n  plan: {plan}\n  trace: {trace}{where}\n)"


def write_run(out_dir: Path, recipe: Recipe, trace: Trace) -> None:
    """trace.json, report.md, report.html and the tuned recipe.yaml of the run so far, each whole
    after a kill at any moment: staged, fsynced, renamed (:mod:`.outputs`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Tuned by fractal_opt from {recipe.name or recipe.model}: the kept passes only.\n"
        "# Load it in an app with fractal_opt.Engine.from_recipe(\"recipe.yaml\").\n"
    )
    write_outputs(out_dir, {
        "trace.json": trace.to_json(),
        "report.md": report_md(trace),
        "report.html": render_html(trace),  # the same run as pictures
        "recipe.yaml": dump_recipe(trace.to_recipe(), header=header),
    })
