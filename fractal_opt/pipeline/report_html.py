"""report.html: the run as pictures, one self-contained file (inline SVG and CSS, no network).

What it shows, top to bottom: the final plan against the baseline; the tower (each step coloured
by its verdict); per layer a waterfall of its objective from the baseline to the final plan with
each step's noise band; decode tokens/s against the bandwidth ceiling (the roofline); TTFT / ITL /
e2e percentiles; quality against its guards; every step with its full reason and what one user got
from it (:mod:`.one_user`); the noise calibration and the machine. It reads only what trace.json
stores, so an old trace renders too.

:func:`render_html` is the whole page; :func:`render_fragment` the same content for a notebook
(``Trace._repr_html_``), its styles scoped to the fragment.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import RecipeError
from ..passes import Layer
from ..policy import QUALITY_METRICS, Guard, Policy
from ..text import clip as _clip
from . import one_user
from .confirm import final_lines
from .report_answers import answers_html
from .labels import pass_label
from .run_info import wall_time
from .report_svg import COLOURS, LABEL_W, Bar, Svg, data_attrs, esc, fmt_num, hbar_chart, is_num, nice_max, range_chart

# A pipeline.trace.Trace and its Steps, read by attribute only: trace.py renders through this
# module (Trace.to_html, Trace._repr_html_), so importing it back here would close a circle.
Trace = Any
Step = Any

__all__ = ["render_fragment", "render_html"]

STATUS_TEXT = {"baseline": "baseline", "kept": "kept", "rolled_back": "rolled back", "failed": "failed", "skipped": "skipped"}
# The numbers of the final-vs-baseline cards (metric, label, True when higher is better).
SUMMARY = (("decode_tokens_per_s", "decode tok/s", True), ("throughput_tokens_per_s", "throughput tok/s", True), ("ttft_ms", "TTFT ms", False),
           ("e2e_ms", "e2e ms", False), ("weight_mb", "weights MB", False))
CALIBRATED = ("decode_tokens_per_s", "ttft_ms", "prefill_ms", "e2e_ms", "throughput_tokens_per_s", "peak_memory_mb")
LATENCY = (("ttft_ms", "TTFT", "ms"), ("itl_ms", "ITL (gap between tokens)", "ms"), ("e2e_ms", "end to end", "ms"))

CSS = """
.fo-report { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; max-width: 1000px; margin: 0 auto; line-height: 1.4; }
.fo-report h1 { font-size: 22px; margin: 16px 0 4px; }
.fo-report h2 { font-size: 18px; margin: 28px 0 6px; border-bottom: 1px solid #ddd; padding-bottom: 3px; }
.fo-report h3 { font-size: 14px; margin: 14px 0 2px; }
.fo-report p.note, .fo-report .meta { color: #555; font-size: 13px; margin: 4px 0 8px; }
.fo-report .banner { background: #fff3cd; border: 1px solid #e0c36a; padding: 6px 10px; margin: 8px 0; }
.fo-report .cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 10px 0; }
.fo-report .card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; min-width: 140px; }
.fo-report .card .k { font-size: 12px; color: #555; }
.fo-report .card .v { font-size: 18px; font-weight: 600; } .fo-report .card small { font-size: 11px; font-weight: normal; color: #555; }
.fo-report .card .good { color: #2e7d32; } .fo-report .card .bad { color: #c0392b; }
.fo-report table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
.fo-report th, .fo-report td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
.fo-report td.num { text-align: right; font-variant-numeric: tabular-nums; }
.fo-report tr.one-user td { border-top: none; color: #333; } .fo-report tr.one-user small { color: #666; }
.fo-report .legend span { display: inline-block; margin-right: 14px; font-size: 12px; }
.fo-report .legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }
.fo-report svg.chart { display: block; margin: 6px 0; max-width: 100%; height: auto; }
.fo-report dl { display: grid; grid-template-columns: max-content auto; gap: 2px 12px; font-size: 13px; }
.fo-report dt { color: #555; } .fo-report dd { margin: 0; }
.fo-report table.answers tr.changed td { background: #fff8e1; } .fo-report table.answers td { max-width: 300px; }
"""

# Records in the page how many charts the browser laid out with a non-zero size and how tall the
# page is (read back from the DOM by the browser test and scripts/screenshot-report.sh; the page
# itself works without it).
SCRIPT = """document.addEventListener('DOMContentLoaded', function () {
  var charts = document.querySelectorAll('.fo-report svg.chart'), drawn = 0;
  charts.forEach(function (c) { var b = c.getBoundingClientRect(); if (b.width > 0 && b.height > 0) drawn++; });
  document.documentElement.setAttribute('data-charts-drawn', drawn + '/' + charts.length);
  document.documentElement.setAttribute('data-page-height', document.documentElement.scrollHeight);
});"""


def render_html(trace: Trace) -> str:
    """The whole report.html page."""
    title = f"fractal_opt report: {trace.recipe.get('name') or trace.recipe.get('model')}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body>{render_fragment(trace, styles=False)}<script>{SCRIPT}</script></body></html>\n")


def render_fragment(trace: Trace, *, styles: bool = True) -> str:
    """The report's content in one ``<div class="fo-report">`` (for notebooks: styles included, scoped)."""
    steps = _all_steps(trace)
    policy = _policy(trace.recipe)
    parts = [f"<style>{CSS}</style>" if styles else "", '<div class="fo-report">', _header(trace)]
    parts += _summary(trace)
    parts += ["<h2>The tower</h2>", ('<p class="note">Bottom up: the baseline, then each pass in tower order, coloured by its verdict '
              "(hover a step for its full reason).</p>"), _legend(), _tower(steps, policy)]
    parts += _waterfalls(trace, steps, policy)
    parts += _roofline(trace, steps)
    parts += _latency(steps)
    parts += _quality(steps, policy)
    from .report_frontier import frontier_html  # every measured plan on the frontiers, and the cost per token

    parts += frontier_html(steps)
    parts.append(answers_html(trace))  # the baseline's and the final plan's answers side by side
    parts += _steps_table(steps, policy)
    parts += _calibration(trace, policy)
    parts += _machine(trace)
    parts.append("</div>")
    return "\n".join(p for p in parts if p)


# --------------------------------------------------------------------------- data helpers
def _all_steps(trace: Trace) -> list[tuple[str, Step]]:
    """``(data-step index, step)``: "0" is the baseline, "1".. the steps in trace.json order."""
    out: list[tuple[str, Step]] = [("0", trace.baseline)] if trace.baseline else []
    return out + [(str(i), s) for i, s in enumerate(trace.steps, start=1)]


def _policy(recipe: dict[str, Any]) -> Policy:
    data = recipe.get("policy") or {}
    names = {f.name for f in dataclasses.fields(Policy)}
    try:
        return Policy(**{k: v for k, v in data.items() if k in names})
    except (RecipeError, TypeError):  # an old or hand-edited trace: the report still renders, with default rules
        return Policy()


def _layer(step: Step) -> Layer | None:
    return Layer.__members__.get(str(step.layer).upper())  # None for the baseline ("-")


def _objective(policy: Policy, step: Step) -> str | None:
    layer = _layer(step)
    return policy.objective_for(layer) if layer else None


def _label(step: Step) -> str:
    return pass_label(step.pass_name, step.params, step.status)


def _dig(metrics: dict[str, Any], path: str) -> Any:
    value: Any = metrics
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _cell(step: str, metrics: dict[str, Any], path: str, fmt: str = "") -> str:
    """A table cell holding a number from trace.json, tied to it by data attributes."""
    v = _dig(metrics, path)
    text = (fmt.format(v) if fmt else fmt_num(v)) if is_num(v) else "–"
    return f'<td class="num"{data_attrs(step, "metrics." + path, v)}>{esc(text)}</td>'


def _pct(v: Any) -> str:
    return f"{v:+.1%}" if is_num(v) else "–"


# --------------------------------------------------------------------------- sections
def _header(trace: Trace) -> str:
    r = trace.recipe
    wl = r.get("workload") or {}
    run = getattr(trace, "run", {}) or {}
    versions = run.get("versions") or {}
    model = run.get("model") or {}
    out = [f"<h1>fractal_opt report: {esc(r.get('name') or r.get('model'))}</h1>",
           f'<p class="meta">Model <b>{esc(r.get("model"))}</b>; workload: suite <code>{esc(wl.get("suite"))}</code>, '
           f"{esc(wl.get('max_new_tokens'))} new tokens max, {esc(wl.get('repeats'))} repeats after {esc(wl.get('warmup'))} warm-up"
           + (f", load profile {esc((wl.get('load') or {}).get('mode'))}" if wl.get("load") else "") + ".</p>"]
    bits = []
    if run.get("started_at"):
        took = wall_time(run) if trace.finished else None
        bits.append(f"run {esc(run.get('started_at'))} → {esc(run.get('ended_at') or 'not finished')}" + (f" (wall time {esc(took)})" if took else ""))
    if versions:
        bits.append(", ".join(f"{esc(k)} {esc(v)}" for k, v in versions.items() if v))
    if model.get("sha256"):
        bits.append(f"model files sha256 {esc(model['sha256'][:16])}… ({esc(model.get('files'))} files, {fmt_num((model.get('bytes') or 0) / 2**20)} MiB)")
    if bits:
        out.append(f'<p class="meta">{"; ".join(bits)}.</p>')
    if not trace.finished:
        out.append('<p class="banner"><b>This run did not finish</b>: the report shows the steps completed so far.</p>')
    return "\n".join(out)


def _summary(trace: Trace) -> list[str]:
    """The final plan; its numbers against the baseline only as the final confirmation measured them
    (pipeline/confirm.py): a plan not yet confirmed is shown as the best so far, without deltas."""
    final = trace.final or {}
    if not final:
        return []
    kept = final.get("kept") or []
    status = final.get("status")  # None: a trace from before the final confirmation existed
    conf = final.get("confirmation") or {}
    sentence = final_lines(final, markdown=False)[0] if status else (f"Final plan: {', '.join(kept)}." if kept else "Final plan: the baseline (no pass was kept).")
    out = ["<h2>Final plan</h2>", f"<p>{esc(sentence)}</p>"]
    if status == "confirmed" and conf.get("metrics"):
        out.append(f'<p class="note">Final vs baseline: {esc(conf.get("note", "measured again"))}, {esc(conf.get("rounds"))} rounds; '
                   "paired estimate [95% interval], medians baseline → final.</p>")
    out.append('<div class="cards">')
    base = trace.baseline.metrics if trace.baseline else {}
    now = final.get("metrics") or {}
    for metric, name, higher in SUMMARY:
        if status == "confirmed" and metric in (conf.get("metrics") or {}):
            m = conf["metrics"][metric]
            path = f"confirmation.metrics.{metric}"
            a, b, change, iv = m.get("final_median"), m.get("baseline_median"), m.get("change"), m.get("interval")
            a_attr, b_attr, c_attr = data_attrs("final", f"{path}.final_median", a), data_attrs("final", f"{path}.baseline_median", b), data_attrs("final", f"{path}.change", change)
            if not is_num(a):  # a census number (weights): no medians in the confirmation, the plans' own figures
                a, b = now.get(metric), base.get(metric)
                a_attr, b_attr = data_attrs("final", f"metrics.{metric}", a), data_attrs("0", f"metrics.{metric}", b)
            verdict = m.get("verdict", "")
            cls = "good" if verdict == "better" else ("bad" if verdict == "worse" else "")
            extra = f" [{iv[0]:+.1%}, {iv[1]:+.1%}]" if iv and all(is_num(x) for x in iv) else ""
        elif status is None and is_num(now.get(metric)):  # an old trace: its own claim, as its report.md made it
            a, b, change = now.get(metric), base.get(metric), (final.get("vs_baseline") or {}).get(metric)
            a_attr, b_attr, c_attr = data_attrs("final", f"metrics.{metric}", a), data_attrs("0", f"metrics.{metric}", b), data_attrs("final", f"vs_baseline.{metric}", change)
            cls = "good" if is_num(change) and change and (change > 0) == higher else ("bad" if is_num(change) and change else "")
            extra = ""
        elif is_num(now.get(metric)):  # not confirmed: the value measured in its last step, no claim against the baseline
            a, b, change = now.get(metric), base.get(metric), None
            a_attr, b_attr, c_attr = data_attrs("final", f"metrics.{metric}", a), data_attrs("0", f"metrics.{metric}", b), ""
            cls, extra = "", ""
        else:
            continue
        delta = f'<span class="{cls}"{c_attr}>{esc(_pct(change))}</span><small>{esc(extra)}</small>' if is_num(change) else ""
        out.append(f'<div class="card"><div class="k">{esc(name)}</div><div class="v"><span{a_attr}>{esc(fmt_num(a))}</span> {delta}</div>'
                   f'<div class="k">baseline <span{b_attr}>{esc(fmt_num(b))}</span></div></div>')
    out.append("</div>")
    return out + _final_one_user(final)


def _final_one_user(final: dict[str, Any]) -> list[str]:
    """One user, baseline -> final plan, from the confirmation's medians (same rounds); nothing unless it measured them."""
    metrics = (final.get("confirmation") or {}).get("metrics") or {}
    if final.get("status") not in ("confirmed", "not_confirmed"):
        return []
    pick = {m: (metrics.get(m) or {}) for m, *_ in one_user.FIGURES}
    figs = one_user.figures({m: e.get("baseline_median") for m, e in pick.items()}, {m: e.get("final_median") for m, e in pick.items()})
    parts = [_figure_html(f, ("final", f"confirmation.metrics.{f.metric}.baseline_median"), ("final", f"confirmation.metrics.{f.metric}.final_median"))
             for f in figs if f.after is not None]
    if not parts:
        return []
    return [(f'<p class="note">One user, baseline → final plan (medians of the confirmation\'s rounds; each % computed from the two numbers '
             f'next to it, not the paired estimate): {", ".join(parts)}.</p>')]


def _figure_html(f: one_user.Figure, before: tuple[str, str], after: tuple[str, str]) -> str:
    """``TTFT 455 → 612 ms (+35%)``, each number tied to trace.json by its (step, path)."""
    a = f"<span{data_attrs(*after, f.after, f.scale)}>{esc(f.after_text)}</span>"
    if f.before is None:
        return f"{esc(f.name)} {a} {esc(f.unit)}"
    b = f"<span{data_attrs(*before, f.before, f.scale)}>{esc(f.before_text)}</span>"
    change = f.change
    return f"{esc(f.name)} {b} → {a} {esc(f.unit)}" + (f" ({change:+.0%})" if change is not None else "")


def _legend() -> str:
    items = "".join(f'<span><i style="background:{COLOURS[k]}"></i>{esc(v)}</span>' for k, v in STATUS_TEXT.items())
    return f'<div class="legend">{items}</div>'


def _tower(steps: list[tuple[str, Step]], policy: Policy) -> str:
    """A stack of boxes, baseline at the bottom; each box: layer, pass, verdict, objective change."""
    row_h, width = 30, 940
    svg = Svg(width, len(steps) * row_h + 10, title="the tower of steps, coloured by verdict")
    for n, (idx, s) in enumerate(reversed(steps)):
        y = 5 + n * row_h
        colour = COLOURS.get(s.status, COLOURS["other"])
        svg.rect(110, y, width - 120, row_h - 4, fill=colour, opacity=0.18, stroke=colour, tip=s.reason,
                 extra=f' data-step="{idx}" data-status="{esc(s.status)}"')
        svg.rect(110, y, 6, row_h - 4, fill=colour)
        svg.text(100, y + 18, s.layer if s.status != "baseline" else "", anchor="end", size=11, fill="#555")
        svg.text(124, y + 18, _clip(_label(s), 56), weight="bold", tip=_label(s))
        objective = _objective(policy, s) if s.status != "baseline" else None
        change = s.changes.get(objective) if objective else None
        detail = esc(STATUS_TEXT.get(s.status, s.status))
        if is_num(change):
            detail += f" · {esc(objective)} <tspan{data_attrs(idx, f'changes.{objective}', change)}>{change:+.1%}</tspan>"
        elif s.status in ("skipped", "failed"):
            detail += f" · {esc(_clip(s.reason.removeprefix('check: '), 48))}"
        svg.add(f'<text x="{width - 16}" y="{y + 18}" text-anchor="end" font-size="11" fill="#222">{detail}</text>')
    return svg.render()


def _waterfalls(trace: Trace, steps: list[tuple[str, Step]], policy: Policy) -> list[str]:
    """Per layer: its objective from the baseline, through each of the layer's measured steps, to the final plan.

    A step's bar runs from the kept plan's value in its own comparison (``value / (1 + change)``)
    to the step's value: solid when kept, hollow when rolled back. The grey band around the start
    of each bar is the noise band the verdict used; a change inside it counts as no change.
    """
    if not trace.baseline:
        return []
    base = trace.baseline.metrics
    final = (trace.final or {}).get("metrics") or {}
    out: list[str] = []
    layers = [lay for lay in Layer if any(s.layer == lay.section and s.metrics for _, s in steps[1:])]
    if not layers:
        return []
    out += ["<h2>Objective per layer</h2>", ('<p class="note">Each layer is judged on its own objective. From the baseline, through every measured '
            "step of the layer (solid: kept, hollow: rolled back; the grey band is the step's noise band), to the final plan. Later layers can "
            "move a layer's objective too (the last bar). The baseline bar is the A/A calibration's measurement and the last bar the final plan's "
            "in its last step; each step's bar is from its own comparison, so the bars need not join on a noisy machine (the final plan "
            "against the baseline, measured again, is under Final plan).</p>")]
    for layer in layers:
        objective = policy.objective_for(layer)
        cols: list[dict[str, Any]] = [{"label": "baseline", "kind": "total", "value": base.get(objective), "step": "0", "path": f"metrics.{objective}"}]
        for idx, s in steps[1:]:
            if s.layer != layer.section or not s.metrics:
                continue
            after, change = s.metrics.get(objective), s.changes.get(objective)
            before = after / (1 + change) if is_num(after) and is_num(change) and change != -1 else None
            cols.append({"label": _label(s), "kind": "step", "before": before, "value": after, "status": s.status, "step": idx, "path": f"metrics.{objective}",
                         "band": s.bands.get(objective), "change": change})
        cols.append({"label": "final plan", "kind": "total", "value": final.get(objective), "step": "final", "path": f"metrics.{objective}"})
        out.append(f"<h3>{esc(layer.section)}: {esc(objective)}</h3>")
        out.append(_waterfall(cols, objective))
    return out


def _waterfall(cols: list[dict[str, Any]], objective: str) -> str:
    values = [c.get(k) for c in cols for k in ("value", "before") if is_num(c.get(k))]
    values += [c["before"] * (1 + c["band"]) for c in cols if is_num(c.get("before")) and is_num(c.get("band"))]
    top = nice_max(max(values) if values else 1.0)
    col_w, left, plot_h, top_pad = 110, 60, 220, 14
    width = max(500, left + col_w * len(cols) + 20)
    height = top_pad + plot_h + 70
    svg = Svg(width, height, title=f"waterfall of {objective}")

    def y_of(v: float) -> float:
        return top_pad + plot_h * (1 - v / top)

    for i in range(6):
        v = top * i / 5
        svg.line(left, y_of(v), width - 10, y_of(v), stroke="#e8e8e8")
        svg.text(left - 6, y_of(v) + 4, fmt_num(v), anchor="end", size=10, fill="#555")
    level = None
    for n, c in enumerate(cols):
        x = left + n * col_w + 15
        w = col_w - 30
        v = c.get("value")
        if c["kind"] == "total":
            if is_num(v):
                svg.rect(x, y_of(v), w, y_of(0) - y_of(v), fill=COLOURS["baseline"], extra=data_attrs(c["step"], c["path"], v), tip=f"{c['label']}: {fmt_num(v)}")
                svg.text(x + w / 2, y_of(v) - 4, fmt_num(v), anchor="middle", size=11)
                level = v
        else:
            before, colour = c.get("before"), COLOURS.get(c.get("status", ""), COLOURS["other"])
            if is_num(before) and is_num(c.get("band")):
                lo, hi = before * (1 - c["band"]), before * (1 + c["band"])
                svg.rect(x - 6, y_of(hi), w + 12, y_of(lo) - y_of(hi), fill="#999", opacity=0.25, tip=f"noise band ±{c['band']:.1%}",
                         extra=data_attrs(c["step"], f"bands.{objective}", c["band"]))
            if is_num(before) and is_num(v):
                y1, y2 = sorted((y_of(before), y_of(v)))
                kept = c.get("status") == "kept"
                svg.rect(x, y1, w, max(y2 - y1, 1.5), fill=colour if kept else "#fff", stroke=colour, dash=not kept,
                         extra=data_attrs(c["step"], c["path"], v), tip=f"{c['label']}: {fmt_num(before)} → {fmt_num(v)} ({_pct(c.get('change'))})")
                svg.text(x + w / 2, y1 - 4, _pct(c.get("change")), anchor="middle", size=11)
                if level is not None:
                    svg.line(x - 30, y_of(level), x, y_of(level), stroke="#888", dash=True)
                level = v if kept else before
        svg.text(x + w / 2, top_pad + plot_h + 16, _clip(c["label"], 17), anchor="middle", size=10, tip=c["label"])
    svg.line(left, y_of(0), width - 10, y_of(0), stroke="#888")
    return svg.render()


def _roofline(trace: Trace, steps: list[tuple[str, Step]]) -> list[str]:
    rows = []
    for idx, s in steps:
        r = s.metrics.get("roofline") if s.metrics else None
        if not isinstance(r, dict):
            continue
        decode, ceiling = s.metrics.get("decode_tokens_per_s"), r.get("decode_ceiling_tokens_per_s")
        share = decode / ceiling if is_num(decode) and is_num(ceiling) and ceiling else None
        note = (f"{share:.0%} of ceiling" if share is not None else "") + (f" · {r.get('bound')}" if r.get("bound") else "")
        rows.append(Bar(label=_label(s), step=idx, status=s.status, value=decode, metric="metrics.decode_tokens_per_s", note=note,
                        ticks=[(ceiling, "metrics.roofline.decode_ceiling_tokens_per_s", "#222", (f"bandwidth ceiling {fmt_num(ceiling)} tok/s "
                                f"(the bytes each decoded token reads, {fmt_num((r.get('bytes_per_token') or 0) / 2**20)} MiB, at the probed bandwidth)"))]))
    if not rows:
        return []
    limits = trace.machine.get("limits") or {}
    bw = limits.get("bandwidth_bytes_per_s")
    head = (f"Bandwidth ceiling: the probed memory bandwidth (<span{data_attrs('machine', 'limits.bandwidth_bytes_per_s', bw, 1e-9)}>{esc(fmt_num((bw or 0) / 1e9))}</span> GB/s"
            f" on {esc(limits.get('device', 'this device'))}) over the bytes one decoded token reads (weights + KV cache)." if is_num(bw) else "")
    return ["<h2>Decode against the bandwidth ceiling</h2>",
            f'<p class="note">Bars: measured decode tokens/s per request; black tick: the step\'s ceiling. {head}</p>',
            hbar_chart(rows, title="decode tokens/s against the bandwidth ceiling", unit="tokens/s")]


def _latency(steps: list[tuple[str, Step]]) -> list[str]:
    measured = [(i, s) for i, s in steps if s.metrics and any(is_num(s.metrics.get(f"{m}_p50")) for m, _, _ in LATENCY)]
    if not measured:
        return []
    load = next((s.metrics.get("load") for _, s in measured if isinstance(s.metrics.get("load"), dict)), None)
    how = (f"under the workload's load profile ({esc(load.get('mode'))}, {esc(load.get('requests'))} requests per round; TTFT includes queueing)"
           if load else "over the suite's requests as the plan serves them, pooled over rounds")
    out = ["<h2>Latency percentiles</h2>", f'<p class="note">Per step, {how}: filled dot p50, half p90, open p99.</p>']
    for metric, name, unit in LATENCY:
        rows = [Bar(label=_label(s), step=i, status=s.status, points=[(s.metrics.get(f"{metric}_p{q}"), f"metrics.{metric}_p{q}", f"p{q}") for q in (50, 90, 99)],
                    note=" / ".join(fmt_num(s.metrics.get(f"{metric}_p{q}")) for q in (50, 90, 99))) for i, s in measured]
        if any(p for r in rows for p in r.points if is_num(p[0])):
            out += [f"<h3>{esc(name)} (p50 / p90 / p99, {esc(unit)})</h3>", range_chart(rows, title=f"{name} percentiles", unit=unit)]
    if load:
        out.append(_load_table(measured))
    return out


def _load_table(measured: list[tuple[str, Step]]) -> str:
    head = "<tr><th>pass</th><th>status</th><th>clients</th><th>output tok/s</th><th>done / timeout / cancelled / rejected</th></tr>"
    body = []
    for i, s in measured:
        info = s.metrics.get("load") or {}
        ended = [sum(r.get(k, 0) for r in info.get("rounds", [])) for k in ("done", "timeout", "cancelled", "rejected")]
        body.append(f"<tr><td>{esc(_label(s))}</td><td>{esc(STATUS_TEXT.get(s.status, s.status))}</td><td>{esc(info.get('clients', '–'))}</td>"
                    f"{_cell(i, s.metrics, 'throughput_tokens_per_s')}<td>{' / '.join(map(str, ended))}</td></tr>")
    return f"<h3>Under load</h3><table>{head}{''.join(body)}</table>"


def _quality(steps: list[tuple[str, Step]], policy: Policy) -> list[str]:
    """Per quality number any step measured: a bar per step and a red tick at the limit its layer's guard sets."""
    measured = [(i, s) for i, s in steps if s.metrics and isinstance(s.metrics.get("quality"), dict)]
    guarded = {g.metric for layer in Layer for g in policy.guards_for(layer)} | {"kl_mean", "agreement"}
    names = [m for m in QUALITY_METRICS if m in guarded and any(is_num(s.metrics["quality"].get(m)) for _, s in measured)]
    if not names:
        return []
    base_q = measured[0][1].metrics["quality"] if measured and measured[0][1].status == "baseline" else {}
    out = ["<h2>Quality against its guards</h2>", ('<p class="note">Against the baseline (KL of next-token distributions on the reference text, '
           "agreement of greedy outputs, accuracy on the eval set when one is given). Red tick: the limit the step's layer guards it with. "
           "The numbers not guarded here (KL p99 and max, top-1 flips, perplexity ratios) are in the table below and in trace.json.</p>")]
    for name in names:
        rows = []
        for i, s in measured:
            v = s.metrics["quality"].get(name)
            guard = _guard(policy, s, name)
            ticks, note = [], fmt_num(v, 4)
            if guard is not None:
                limit = guard.max if guard.max is not None else guard.min
                if limit is None and guard.max_drop is not None and is_num(base_q.get(name)):
                    limit = base_q[name] - guard.max_drop
                if is_num(limit):
                    ticks.append((limit, "", "#c0392b", f"guard: {guard.describe()}"))
                    note += f" (guard {guard.describe().removeprefix(name + ' ')})"
            rows.append(Bar(label=_label(s), step=i, status=s.status, value=v, metric=f"metrics.quality.{name}", ticks=ticks, note=note))
        out += [f"<h3>{esc(name)}</h3>", hbar_chart(rows, title=f"quality: {name}", unit=name)]
    return out


def _guard(policy: Policy, step: Step, metric: str) -> Guard | None:
    layer = _layer(step)
    layers = [layer] if layer else list(Layer)  # the baseline: the limit every layer shares, if one does
    guards = [g for lay in layers for g in policy.guards_for(lay) if g.metric == metric]
    return guards[0] if guards and all(g == guards[0] for g in guards) else None


def _steps_table(steps: list[tuple[str, Step]], policy: Policy) -> list[str]:
    cols = (("decode_tokens_per_s", "decode tok/s"), ("ttft_ms", "TTFT ms"), ("e2e_ms", "e2e ms"), ("throughput_tokens_per_s", "throughput tok/s"),
            ("peak_memory_mb", "peak MB"), ("weight_mb", "weights MB"))
    head = "<tr><th>#</th><th>layer</th><th>pass</th><th>verdict</th>" + "".join(f"<th>{esc(h)}</th>" for _, h in cols) + "<th>KL</th><th>reason</th></tr>"
    users = _one_user_cells(steps)
    body = []
    for i, s in steps:
        colour = COLOURS.get(s.status, COLOURS["other"])
        cells = "".join(_cell(i, s.metrics, k) for k, _ in cols) + _cell(i, s.metrics, "quality.kl_mean", "{:.4f}")
        body.append(f'<tr data-step="{i}"><td>{i}</td><td>{esc(s.layer)}</td><td>{esc(_label(s))}</td>'
                    f'<td style="color:{colour};font-weight:600">{esc(STATUS_TEXT.get(s.status, s.status))}</td>{cells}<td>{esc(s.reason)}</td></tr>')
        if i in users:  # the line under its step: what one user got, previous plan -> this step
            body.append(f'<tr class="one-user" data-one-user="{i}"><td></td><td colspan="{len(cols) + 5}">{users[i]}</td></tr>')
    base = next((s for i, s in steps if i == "0"), None)
    return ["<h2>Every step</h2>", ('<p class="note">Medians; the reason is the verdict\'s, in full. trace.json holds every number. '
            f"Under each measured step, what one user got: per request as one user saw it {esc(one_user.under([base, *(s for _, s in steps)]))}; "
            "TTFT and answer are p50 over requests and rounds, streams the median request's decode tokens/s; previous plan → this step, "
            "each % computed from the two numbers next to it (the verdict's paired estimates are in its reason).</p>"),
            f"<table>{head}{''.join(body)}</table>"]


def _one_user_cells(steps: list[tuple[str, Step]]) -> dict[str, str]:
    """Per step index, the one-user cell (:mod:`.one_user`): the baseline's own numbers, each
    measured step's next to the plan it was judged against; none for a skipped or failed step."""
    base = next((s for i, s in steps if i == "0"), None)
    rest = [(i, s) for i, s in steps if i != "0"]
    out: dict[str, str] = {}
    if base is not None and base.metrics:
        figs = [_figure_html(f, ("0", ""), ("0", f"metrics.{f.metric}")) for f in one_user.figures(None, base.metrics) if f.after is not None]
        if figs:
            out["0"] = "<b>one user</b>: " + ", ".join(figs)
    for (i, s), prev in zip(rest, one_user.previous_plans(base, [s for _, s in rest])):
        if prev is None:
            continue
        figs = [_figure_html(f, (prev.step, f"{prev.path}.{f.metric}"), (i, f"metrics.{f.metric}")) for f in one_user.figures(prev.metrics, s.metrics)
                if f.after is not None]
        if figs:
            out[i] = "<b>one user</b>: " + ", ".join(figs) + f' <small>({esc(prev.source())})</small>'
    return out


def _calibration(trace: Trace, policy: Policy) -> list[str]:
    cal = trace.calibration or {}
    intervals = cal.get("intervals") or {}
    metrics = [m for m in CALIBRATED if is_num(cal.get(m))]
    if not metrics:
        return []
    spans = [abs(x) for m in metrics for x in (intervals.get(m) or [cal[m]]) if is_num(x)] + [policy.min_effect]
    half = nice_max(max(spans) * 1.05)
    row_h, width = 24, 900
    svg = Svg(width, 10 + len(metrics) * row_h + 40, title="noise calibration: A/A change with 95% intervals")
    x0, x1 = LABEL_W, width - 170
    xc = (x0 + x1) / 2
    sc = (x1 - x0) / 2 / half
    bottom = 10 + len(metrics) * row_h
    svg.rect(xc - policy.min_effect * sc, 4, 2 * policy.min_effect * sc, bottom - 4, fill="#2e9e4f", opacity=0.12,
             tip=f"±min_effect {policy.min_effect:.0%}: the smallest change that counts even on a quiet machine")
    for k in range(-2, 3):
        x = xc + k * (x1 - x0) / 4
        svg.line(x, 4, x, bottom, stroke="#e3e3e3" if k else "#888")
        svg.text(x, bottom + 14, f"{k * half / 2:+.0%}" if k else "0", anchor="middle", size=10, fill="#555")
    for n, m in enumerate(metrics):
        y = 10 + n * row_h + row_h / 2
        svg.text(x0 - 8, y + 4, m, anchor="end")
        iv = intervals.get(m)
        if iv and all(is_num(x) for x in iv):
            lo, hi = (max(-half, min(half, x)) for x in iv)
            svg.line(xc + lo * sc, y, xc + hi * sc, y, stroke="#4c78a8", width=2)
        svg.circle(xc + max(-half, min(half, cal[m])) * sc, y, 4.5, fill="#4c78a8", extra=data_attrs("calibration", m, cal[m]),
                   tip=f"{m}: A/A {cal[m]:+.1%}" + (f" [{iv[0]:+.1%}, {iv[1]:+.1%}]" if iv else ""))
        svg.text(x1 + 8, y + 4, f"{cal[m]:+.1%}" + (f" [{iv[0]:+.1%}, {iv[1]:+.1%}]" if iv else ""), size=11)
    rounds = cal.get("rounds")
    return ["<h2>Noise calibration</h2>",
            (f'<p class="note">The baseline measured against itself{f", interleaved, {esc(rounds)} rounds" if rounds else ""}: how much a change of nothing moves '
            "each number here (dot: A/A change, line: 95% interval, clipped to the axis). Green: the minimum effect the policy asks for.</p>"), svg.render()]


def _machine(trace: Trace) -> list[str]:
    m = trace.machine or {}
    if not m:
        return []
    limits = m.get("limits") or {}
    rows = [("CPU", f"{m.get('cpu')}, {m.get('logical_cores')} logical / {m.get('physical_cores')} physical cores"),
            ("memory", f"{(m.get('memory_bytes') or 0) / 2**30:.1f} GiB"),
            ("GPUs", ", ".join(m.get("cuda_devices") or []) or "none"),
            ("platform", m.get("platform"))]
    if limits:
        flops = ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in (limits.get("peak_flops") or {}).items() if is_num(v))
        rows += [("memory bandwidth", (f"{(limits.get('bandwidth_bytes_per_s') or 0) / 1e9:.1f} GB/s read, {(limits.get('copy_bandwidth_bytes_per_s') or 0) / 1e9:.1f} GB/s copy "
                  f"({limits.get('device')}, {limits.get('threads')} threads, probed in {limits.get('probe_s')} s{', cached' if limits.get('cached') else ''}, "
                  f"load average {limits.get('load_average')})")),
                 ("matmul peak", flops or "–")]
    packages = m.get("packages") or {}
    rows.append(("packages", ", ".join(f"{k} {v}" for k, v in packages.items() if v)))
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in rows)
    return ["<h2>The machine</h2>", f"<dl>{dl}</dl>"]
