"""What the terminal shows when a run ends: the answer first, then the tower table, then the detail.

:func:`summary` is what ``fractal-opt run`` prints: the first screen (:mod:`.first_screen`: one
user, the offered load, the cost, the answers kept), the busy-machine warning when there is one,
the table of every step (:func:`tower_table`, fitted to the terminal's width), the final plan
against the baseline in full (:func:`.confirmation.final_lines`) and the answers side by side.
"""

from __future__ import annotations

import textwrap

from .answers import answers_text
from .confirmation import final_lines
from .first_screen import first_screen, text_lines
from .measurement import busy_warning
from .tables import tower_headers, tower_rows
from .targets import target_summary
from .trace import Trace

__all__ = ["TEXT_DROP_ORDER", "summary", "tower_table"]

# Terminal columns left out first when the table is too wide (report.md keeps them all).
TEXT_DROP_ORDER = ("e2e ms", "TTFT ms", "throughput tok/s", "KL", "agree", "weights MB", "peak MB", "prefill ms")


def summary(trace: Trace, width: int = 120) -> str:
    """The terminal's summary of a finished (or stopped) run; the answer in its first lines."""
    out = [*text_lines(first_screen(trace)), ""]
    if warning := busy_warning(trace.calibration):  # the A/A band could not resolve min_effect
        out += [warning, ""]
    out += [tower_table(trace, width), ""]
    detail = final_lines(trace.final, markdown=False)  # final vs baseline in full: only the final confirmation's numbers
    out += ["In full:", *detail[1:]] if len(detail) > 1 else []
    out += answers_text(trace)  # what the final plan answers, beside the baseline
    return "\n".join(out)


def tower_table(trace: Trace, width: int = 120) -> str:
    """A table for a terminal ``width`` columns wide; each reason is wrapped under its row.

    What does not fit is left out, least telling first: long pass labels are cut, then
    columns dropped (named under the table), and a reason over two lines is cut; report.md
    holds everything in full.
    """
    headers = tower_headers()[:-1]
    rows = tower_rows(([trace.baseline] if trace.baseline else []) + trace.steps)
    keep, cap, dropped = _fit_columns(headers, rows, width)
    ws = _widths(headers, rows, keep, cap)
    out = ["  ".join(headers[i].ljust(w) for i, w in zip(keep, ws)).rstrip(), "  ".join("-" * w for w in ws)]
    for r in rows:
        out.append("  ".join(_fit(r[i], w).ljust(w) for i, w in zip(keep, ws)).rstrip())
        lines = textwrap.wrap(r[-1], width=max(width - 7, 20), break_long_words=True) or [""]
        if len(lines) > 2:
            lines = [lines[0], _fit(lines[1] + " " + " ".join(lines[2:]), max(width - 7, 20) - len(" [...report.md]")) + " [...report.md]"]
        out += ["    -> " + lines[0], *("       " + line for line in lines[1:])]
    if dropped:
        out += textwrap.wrap(f"(left out to fit {width} columns: {', '.join(reversed(dropped))}; report.md and report.html have every column)", width=width)
    out += ["", *target_summary(trace.final)] if trace.final.get("targets") else []  # targets: which were met
    return "\n".join(out)


def _widths(headers: list[str], rows: list[list[str]], keep: list[int], cap: int) -> list[int]:
    """Each kept column's width: its widest cell, the pass label's at most ``cap``."""
    if not rows:
        return [len(headers[i]) for i in keep]
    return [min(cap, max(len(headers[i]), *(len(r[i]) for r in rows))) if i == 1 else max(len(headers[i]), *(len(r[i]) for r in rows)) for i in keep]


def _fit_columns(headers: list[str], rows: list[list[str]], width: int) -> tuple[list[int], int, list[str]]:
    """(columns kept, the pass label's width, columns dropped) so that the table fits ``width``."""
    keep = list(range(len(headers)))
    cap = 40
    dropped: list[str] = []
    while sum(_widths(headers, rows, keep, cap)) + 2 * (len(keep) - 1) > width:
        droppable = [i for i in keep if i >= 3 and headers[i] in TEXT_DROP_ORDER]
        if cap > 36:
            cap -= 2
        elif droppable:
            worst = max(droppable, key=lambda i: TEXT_DROP_ORDER.index(headers[i]))
            keep.remove(worst)
            dropped.append(headers[worst])
        elif cap > 12:
            cap -= 4
        else:
            break
    return keep, cap, dropped


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"
