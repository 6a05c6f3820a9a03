"""report.md: the whole run as Markdown, the answer to the recipe's question first.

Top to bottom: the answer (:mod:`.first_screen`), the busy-machine warning when there is one, the
machine and where the time went, the noise calibration, the tower table and the per-step tables,
what one user got per step, latency and the roofline, the guards, the final plan against the
baseline in full (:func:`.confirmation.final_lines`), the answers side by side, a search's
answer and the targets. It reads only what trace.json stores.
"""

from __future__ import annotations

from .answers import answers_lines
from .confirmation import final_lines
from .first_screen import first_screen, markdown_lines
from .measurement import busy_warning, calibration_lines, measurement_lines, one_user_lines
from .reader import wall_time
from .tables import guard_lines, load_table, time_lines, tower_headers, tower_rows, work_table
from .targets import target_lines
from .trace import Trace

__all__ = ["report_md"]


def report_md(trace: Trace) -> str:
    """report.md's text."""
    lines = [f"# fractal_opt report: {trace.recipe.get('name') or trace.recipe.get('model')}", ""]
    lines += markdown_lines(first_screen(trace))  # what the recipe asked, answered
    if warning := busy_warning(trace.calibration):
        lines += [f"**{warning}**", ""]
    lines += ["## How it was measured", "", *_setting(trace)]
    lines += calibration_lines(trace.calibration, threads=trace.ran_threads(), warn=False)
    lines += ["## Every step", "", "| " + " | ".join(tower_headers()) + " |", "|" + "---|" * len(tower_headers())]
    baseline = [trace.baseline] if trace.baseline else []
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in tower_rows(baseline + trace.steps)]
    lines.append("")
    lines += work_table(baseline, trace.steps)
    lines += load_table(baseline, trace.steps)
    lines += one_user_lines(trace.baseline, trace.steps)  # what one user gets per step (one_user.py)
    lines += measurement_lines(baseline + trace.steps)
    lines += guard_lines(trace.steps)  # the guards in force per step
    lines += ["## The final plan against the baseline, in full", "", *final_lines(trace.final)]  # only the final confirmation's numbers
    lines += answers_lines(trace)  # the baseline's and the final plan's answers side by side (answers.py)
    lines += [f"Search: {s['answer']} ({s['summary']})." for s in trace.searches]  # a search pass's answer
    lines += [""] + target_lines(trace.recipe, trace.baseline, trace.steps, trace.final) if trace.recipe.get("targets") else []
    if not trace.finished:
        lines += ["", "**This run did not finish**: the tables show the steps completed so far."]
    return "\n".join(lines) + "\n"


def _setting(trace: Trace) -> list[str]:
    """The machine, the run's wall time, where the time went and the workload."""
    out = []
    if m := trace.machine:
        out += [f"Machine: {m.get('cpu')}, {m.get('logical_cores')} logical / {m.get('physical_cores')} physical cores, "
                f"{(m.get('memory_bytes') or 0) / 2**30:.1f} GiB RAM, GPUs: {', '.join(m.get('cuda_devices') or []) or 'none'}; "
                f"torch {m.get('packages', {}).get('torch')}, transformers {m.get('packages', {}).get('transformers')}.", ""]
    if trace.finished and (took := wall_time(trace.run or {})):
        out += [f"Wall time: {took} (this run on this machine, {trace.run['started_at']} -> {trace.run['ended_at']}).", ""]
    out += time_lines(trace.baseline, trace.steps, calibration=trace.calibration, final=trace.final)  # where the time went (tables.py)
    wl = trace.recipe.get("workload", {})
    return out + [f"Workload: suite `{wl.get('suite')}`, {wl.get('max_new_tokens')} new tokens max, {wl.get('repeats')} repeats after {wl.get('warmup')} warm-up. "
                  "Numbers are medians; (±%) is the change against the previous kept plan; KL and agreement are against the baseline.", ""]
