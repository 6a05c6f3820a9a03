"""What report.md, report.html and the terminal say about the final plan in full: the final
confirmation's numbers (:mod:`fractal_opt.pipeline.confirm`) as tables and sentences; only a
confirmation's numbers are printed as final vs baseline, and an interval only where it bounds its
change (:func:`fractal_opt.core.text.interval_text`). The first screen (:mod:`.first_screen`)
answers the recipe's question from the same numbers; this is the detail under it."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from ..core.text import fmt, interval_text

__all__ = ["HEADLINE", "drift_line", "final_lines", "traded_lines"]

# The numbers "final vs baseline" spells out (trace.json keeps every metric's interval). Peak
# memory is left out: interleaving keeps both models resident, so it cannot show either plan's own.
HEADLINE = ("decode_tokens_per_s", "ttft_ms", "e2e_ms", "throughput_tokens_per_s", "ttft_ms_p90", "itl_ms_p90")

_num = partial(fmt, missing="–")  # the one number formatter, with the tables' dash for a missing value


def traded_lines(conf: Mapping[str, Any]) -> list[str]:
    """One line per kept objective a later kept step paid with (``confirmation.traded``, :mod:`.objectives`),
    with the objective one request at a time where it was measured so (``traded[metric]["alone"]``)."""
    out = []
    for metric, t in (conf.get("traded") or {}).items():
        line = (f"Traded: {metric} by {t['by']} for {t['for']} ({t['change']:+.1%} in that step, beyond its threshold ±{t['band']:.1%}, "
                "a cost no guard forbids): not required to beat the baseline")
        if (a := t.get("alone")) is not None:
            line += (f" at this load; one request at a time, medians {_num(a['baseline_median'])} -> {_num(a['final_median'])}, "
                     f"paired estimate {a['change']:+.1%} {interval_text(a['change'], *a['interval'])}: {a['verdict']}")
            if (d := a.get("drift")) is not None:
                line += (f"; {d['change']:+.1%} against its own step ({d['step']}: {_num(d['in_step'])}), "
                         f"{'within' if d['agrees'] else 'beyond'} the calibrated noise ±{d['noise']:.1%}")
        out.append(line + ".")
    return out


def drift_line(conf: Mapping[str, Any]) -> str | None:
    """``drift: the final's decode_tokens_per_s is 34.0 here, 78.0 in its own step (...)``; None when it agrees."""
    d = conf.get("drift") or {}
    if not d or d.get("agrees", True):
        return None
    return (f"drift: the final plan's {d['metric']} is {_num(d['confirmed'])} here, {_num(d['in_step'])} in its own step ({d['step']}): "
            f"{d['change']:+.1%}, beyond the calibrated noise ±{d['noise']:.1%} (A/A); the final was not measured under its step's conditions.")


# ---------------------------------------------------------------------------- rendering

def final_lines(final: Mapping[str, Any], *, markdown: bool = True) -> list[str]:
    """What report.md (``markdown``) or the terminal says about the final plan.

    Only a confirmation's numbers are printed as final vs baseline; a provisional plan (a run in
    progress or killed) is named as the best so far, without deltas.
    """
    if not final:
        return []
    kept = list(final.get("kept") or [])
    status = final.get("status", "provisional")
    names = ", ".join(kept)
    if status == "unchanged" or (not kept and status != "provisional"):
        if kept:  # kept passes whose settings add up to the baseline's
            return [f"Final plan: the baseline's settings (kept: {names}, which together change nothing); nothing changed."]
        return ["Final plan: the baseline: no pass was kept; nothing changed."]
    if status == "provisional":
        if not kept:
            return ["Best plan so far: the baseline (no pass kept yet)."]
        return [f"Best plan so far: {names} (not yet measured against the baseline: that runs after the last step)."]
    out = [f"Final plan: {names}."]
    conf = final.get("confirmation") or {}
    if status == "failed":
        return [*out, f"Final vs baseline: not measured (the confirmation failed: {conf.get('error', 'unknown error')}); no change is claimed."]
    head = (f"Final vs baseline ({conf.get('note', 'measured again')}, {conf.get('rounds')} rounds; paired estimate [95% interval], "
            "medians baseline -> final):")
    out += _table(head, conf.get("metrics") or {}, markdown=markdown)
    for other in (e for e in conf.get("at_loads") or [] if not e.get("headline")):  # the same two plans at the baseline's load, beside the headline
        verdict = "confirmed" if other.get("status") == "confirmed" else f"not confirmed ({other.get('not_confirmed', 'no objective improved beyond noise')})"
        out += _table(f"Beside it, {other['label']} ({other['whose']}; the same two plans, {other.get('rounds')} rounds): {verdict}:",
                      other.get("metrics") or {}, markdown=markdown)
    if (line := drift_line(conf)) is not None:
        out.append(line)
    out += traded_lines(conf)
    if status == "confirmed":
        out.append(f"Confirmed: {', '.join(conf.get('objectives') or [])} better than the baseline beyond noise.")
    else:
        out.append(f"Not confirmed: {conf.get('not_confirmed', 'the kept objectives did not improve beyond noise')}; "
                   "the steps' gains did not hold up when the final plan met the baseline again.")
    return out


def _table(head: str, metrics: Mapping[str, Any], *, markdown: bool) -> list[str]:
    """One comparison's headline metrics under ``head``: a markdown table, or indented terminal lines."""
    rows = [m for m in (*HEADLINE, "weight_mb") if m in metrics]
    if not markdown:
        return [head, *(f"  {m}: {_cell(metrics[m])}" for m in rows)]
    return ["", head, "", "| metric | paired change [95%] | threshold (interval half-width, at least min_effect) | medians baseline -> final | verdict |",
            "|---|---|---|---|---|", *(_row(m, metrics[m]) for m in rows), ""]


def _cell(entry: Mapping[str, Any]) -> str:
    """One metric for the terminal: the change, where it comes from, and the verdict."""
    if entry.get("source") == "census":
        return f"{entry['change']:+.1%} ({_num(entry['baseline'])} -> {_num(entry['final'])} MB, census) {entry['verdict']}"
    return (f"paired estimate {entry['change']:+.1%} {interval_text(entry['change'], *entry['interval'])}, threshold ±{entry['band']:.1%}, "
            f"medians {_num(entry.get('baseline_median'))} -> {_num(entry.get('final_median'))}: {entry['verdict']}")


def _row(metric: str, entry: Mapping[str, Any]) -> str:
    if entry.get("source") == "census":
        cells = [metric, f"{entry['change']:+.1%} (census, exact)", "–", f"{_num(entry['baseline'])} -> {_num(entry['final'])}", entry["verdict"]]
    else:
        cells = [metric, f"{entry['change']:+.1%} {interval_text(entry['change'], *entry['interval'])}", f"±{entry['band']:.1%}",
                 f"{_num(entry.get('baseline_median'))} -> {_num(entry.get('final_median'))}", entry["verdict"]]
    return "| " + " | ".join(cells) + " |"
