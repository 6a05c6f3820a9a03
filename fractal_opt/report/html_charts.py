"""report.html's charts of the steps: the tower, the objective per layer (waterfalls), decode
against the bandwidth ceiling, latency percentiles with the load table, quality against its guards.

Each section is one function ``(trace or steps, policy) -> list of HTML pieces``; a label that does
not fit its place is wrapped onto a second line rather than cut (:func:`.svg.wrap`).
"""

from __future__ import annotations

from typing import Any

from ..core.text import clip as _clip
from ..core.text import fmt
from ..language.policy import QUALITY_METRICS, Guard, Policy
from ..tower.passes import Layer
from .html_parts import Step, Trace, cell, label, layer_of, objective_of, pct, status_text
from .reader import Reader
from .svg import COLOURS, Bar, Svg, data_attrs, esc, fmt_num, hbar_chart, is_num, nice_max, range_chart

__all__ = ["LATENCY", "latency", "legend", "quality", "roofline", "tower", "waterfalls"]

LATENCY = (("ttft_ms", "TTFT", "ms"), ("itl_ms", "ITL (gap between tokens)", "ms"), ("e2e_ms", "end to end", "ms"))


def legend(steps: list[tuple[str, Step]]) -> str:
    """The colour of every status the run's steps have (a status without a colour of its own shares "other")."""
    present = list(dict.fromkeys(s.status for _, s in steps))
    ordered = [k for k in COLOURS if k in present] + [k for k in present if k not in COLOURS]
    items = "".join(f'<span><i style="background:{COLOURS.get(k, COLOURS["other"])}"></i>{esc(status_text(k))}</span>' for k in ordered)
    return f'<div class="legend">{items}</div>'


def tower(steps: list[tuple[str, Step]], policy: Policy) -> str:
    """A stack of boxes, baseline at the bottom; each box: layer, pass, verdict, objective change."""
    row_h, width = 30, 1320  # the page's width: a skipped step's reason has the room right of its label
    svg = Svg(width, len(steps) * row_h + 10, title="the tower of steps, coloured by verdict")
    for n, (idx, s) in enumerate(reversed(steps)):
        y = 5 + n * row_h
        colour = COLOURS.get(s.status, COLOURS["other"])
        svg.rect(110, y, width - 120, row_h - 4, fill=colour, opacity=0.18, stroke=colour, tip=s.reason,
                 extra=f' data-step="{idx}" data-status="{esc(s.status)}"')
        svg.rect(110, y, 6, row_h - 4, fill=colour)
        svg.text(100, y + 18, s.layer if s.status != "baseline" else "", anchor="end", size=11, fill="#555")
        shown = _clip(label(s), 64)
        svg.text(124, y + 18, shown, weight="bold", tip=label(s))
        objective = objective_of(policy, s) if s.status != "baseline" else None
        change = s.changes.get(objective) if objective else None
        detail = esc(status_text(s.status))
        if is_num(change):
            detail += f" · {esc(objective)} <tspan{data_attrs(idx, f'changes.{objective}', change)}>{change:+.1%}</tspan>"
        elif s.status == "screened_out" and is_num((screen := s.metrics.get("screen") or {}).get("change")):
            low, high = screen["interval"]  # one paired round: the screen's change and the interval it was stopped on
            detail += (f" · {esc(screen['metric'])} <tspan{data_attrs(idx, 'metrics.screen.change', screen['change'])}>{screen['change']:+.1%}</tspan>"
                       f" [{low:+.0%}, {high:+.0%}] in one round: cannot beat the kept plan by {screen['min_effect']:.0%}")
        elif s.status in ("skipped", "failed"):
            reason = s.reason.removeprefix("check: ")
            # the characters between the label and the right edge: bold 12 px ~7.5 px a character, 11 px ~6 px, 24 px apart
            room = max(24, int((width - 16 - 124 - 7.5 * len(shown) - 24) / 6.0) - len(detail) - 3)
            detail += f" · {esc(_clip(reason, room))}" + (f"<title>{esc(reason)}</title>" if len(reason) > room else "")
        svg.add(f'<text x="{width - 16}" y="{y + 18}" text-anchor="end" font-size="11" fill="#222">{detail}</text>')
    return svg.render()


def waterfalls(trace: Trace, steps: list[tuple[str, Step]], policy: Policy) -> list[str]:
    """Per layer: its objective from the baseline, through each of the layer's measured steps, to the final plan.

    A step's bar runs from the kept plan's value in its own comparison (``value / (1 + change)``)
    to the step's value: solid when kept, hollow when rolled back. The grey band around the start
    of each bar is the threshold the verdict used (the step's interval half-width, at least min_effect;
    not the A/A calibration's noise); a change inside it counts as no change.
    """
    if not trace.baseline:
        return []
    out: list[str] = []
    layers = [lay for lay in Layer if any(s.layer == lay.section and s.metrics for _, s in steps[1:])]
    if not layers:
        return []
    out += ["<h2>Objective per layer</h2>", ('<p class="note">Each layer is judged on its own objective. From the baseline, through every measured '
            "step of the layer (solid: kept, hollow: rolled back; the grey band is the step's threshold: its interval half-width, at least min_effect), to the final plan. Later layers can "
            "move a layer's objective too (the last bar). The first and last bars are the baseline and the final plan as the final "
            "confirmation measured them at the load the layer was judged on, the numbers of The answer (before a confirmation: the baseline's calibration and the final "
            "plan's last step); each step's bar is from its own comparison, so the bars need not join on a noisy machine.</p>")]
    for layer in layers:
        objective = policy.objective_for(layer)
        first, last = _totals(trace, objective)
        cols: list[dict[str, Any]] = [first]
        for idx, s in steps[1:]:
            if s.layer != layer.section or not s.metrics or s.status == "screened_out":  # a screened candidate had one round: the tower shows it
                continue
            after, change = s.metrics.get(objective), s.changes.get(objective)
            before = after / (1 + change) if is_num(after) and is_num(change) and change != -1 else None
            cols.append({"label": label(s), "kind": "step", "before": before, "value": after, "status": s.status, "step": idx, "path": f"metrics.{objective}",
                         "band": s.bands.get(objective), "change": change})
        cols.append(last)
        out.append(f'<div class="fig"><h3>{esc(layer.section)}: {esc(objective)}</h3>{_waterfall(cols, objective)}</div>')
    return [*out[:2], '<div class="figs">', *out[2:], "</div>"]


def _totals(trace: Trace, objective: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The waterfall's baseline and final-plan bars: the confirmation's medians of ``objective`` at
    the load its layer was judged on (:meth:`.reader.Reader.objective_figure`: one request at a
    time for an objective a later step traded, where its own step measured it), the numbers of the
    first screen; before a confirmation, the baseline's own measurement and the final plan's last step."""
    fig = Reader(trace).objective_figure(objective)
    if fig is not None and is_num(fig.final) and is_num(fig.baseline):
        where = f" ({fig.clients} client{'' if fig.clients == 1 else 's'})" if fig.clients is not None else ""
        return ({"label": f"baseline{where}", "kind": "total", "value": fig.baseline, "step": "final", "path": f"{fig.path}.baseline_median"},
                {"label": f"final plan{where}", "kind": "total", "value": fig.final, "step": "final", "path": f"{fig.path}.final_median"})
    final = trace.final or {}
    return ({"label": "baseline", "kind": "total", "value": trace.baseline.metrics.get(objective), "step": "0", "path": f"metrics.{objective}"},
            {"label": "final plan", "kind": "total", "value": (final.get("metrics") or {}).get(objective), "step": "final", "path": f"metrics.{objective}"})


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
                lo, hi = max(0.0, before * (1 - c["band"])), before * (1 + c["band"])  # a band wider than 100% stops at zero: no rate is negative
                svg.rect(x - 6, y_of(hi), w + 12, y_of(lo) - y_of(hi), fill="#999", opacity=0.25, tip=f"threshold ±{c['band']:.1%} (interval half-width, at least min_effect)",
                         extra=data_attrs(c["step"], f"bands.{objective}", c["band"]))
            if is_num(before) and is_num(v):
                y1, y2 = sorted((y_of(before), y_of(v)))
                kept = c.get("status") == "kept"
                svg.rect(x, y1, w, max(y2 - y1, 1.5), fill=colour if kept else "#fff", stroke=colour, dash=not kept,
                         extra=data_attrs(c["step"], c["path"], v), tip=f"{c['label']}: {fmt_num(before)} → {fmt_num(v)} ({pct(c.get('change'))})")
                svg.text(x + w / 2, y1 - 4, pct(c.get("change")), anchor="middle", size=11)
                if level is not None:
                    svg.line(x - 30, y_of(level), x, y_of(level), stroke="#888", dash=True)
                level = v if kept else before
        svg.label(x + w / 2, top_pad + plot_h + 16, c["label"], chars=20, lines=3, anchor="middle", size=10, line_h=12)
    svg.line(left, y_of(0), width - 10, y_of(0), stroke="#888")
    return svg.render()


def roofline(trace: Trace, steps: list[tuple[str, Step]]) -> list[str]:
    rows = []
    for idx, s in steps:
        r = s.metrics.get("roofline") if s.metrics else None
        if not isinstance(r, dict):
            continue
        decode, ceiling = s.metrics.get("decode_tokens_per_s"), r.get("decode_ceiling_tokens_per_s")
        share = decode / ceiling if is_num(decode) and is_num(ceiling) and ceiling else None
        note = (f"{share:.0%} of ceiling" if share is not None else "") + (f" · {r.get('bound')}" if r.get("bound") else "")
        rows.append(Bar(label=label(s), step=idx, status=s.status, value=decode, metric="metrics.decode_tokens_per_s", note=note,
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


def latency(steps: list[tuple[str, Step]]) -> list[str]:
    measured = [(i, s) for i, s in steps if s.metrics and any(is_num(s.metrics.get(f"{m}_p50")) for m, _, _ in LATENCY)]
    if not measured:
        return []
    load = next((s.metrics.get("load") for _, s in measured if isinstance(s.metrics.get("load"), dict)), None)
    how = (f"under the workload's load profile ({esc(load.get('mode'))}, {esc(load.get('requests'))} requests per round; TTFT includes queueing)"
           if load else "over the suite's requests as the plan serves them, pooled over rounds")
    out = ["<h2>Latency percentiles</h2>", f'<p class="note">Per step, {how}: filled dot p50, half p90, open p99.</p>']
    for metric, name, unit in LATENCY:
        rows = [Bar(label=label(s), step=i, status=s.status, points=[(s.metrics.get(f"{metric}_p{q}"), f"metrics.{metric}_p{q}", f"p{q}") for q in (50, 90, 99)],
                    note=" / ".join(fmt_num(s.metrics.get(f"{metric}_p{q}")) for q in (50, 90, 99))) for i, s in measured]
        if any(p for r in rows for p in r.points if is_num(p[0])):
            out += [f"<h3>{esc(name)} (p50 / p90 / p99, {esc(unit)})</h3>", range_chart(rows, title=f"{name} percentiles", unit=unit)]
    if load:
        out.append(_load_table(measured))
    return out


def _load_table(measured: list[tuple[str, Step]]) -> str:
    head = "<tr><th>pass</th><th>status</th><th>offered load</th><th>output tok/s</th><th>done / timeout / cancelled / rejected</th></tr>"
    body = []
    for i, s in measured:
        info = s.metrics.get("load") or {}
        ended = [sum(r.get(k, 0) for r in info.get("rounds", [])) for k in ("done", "timeout", "cancelled", "rejected")]
        body.append(f"<tr><td>{esc(label(s))}</td><td>{esc(status_text(s.status))}</td><td>{esc(_offered(info))}</td>"
                    f"{cell(i, s.metrics, 'throughput_tokens_per_s')}<td>{' / '.join(map(str, ended))}</td></tr>")
    return f"<h3>Under load</h3><table>{head}{''.join(body)}</table>"


def _offered(info: dict[str, Any]) -> str:
    """What the load profile offered, in its own unit: arrivals a second for an open (Poisson)
    load, whose in-flight count is whatever the arrivals make it; clients or users for a closed one."""
    mode = info.get("mode")
    if mode == "poisson":
        rate = info.get("rate")
        return f"Poisson, {fmt(rate, whole=True)} requests/s" if is_num(rate) else "Poisson arrivals"
    if mode == "conversations":
        return f"{info.get('users', info.get('clients', '–'))} users"
    return f"{info['clients']} clients" if info.get("clients") is not None else "–"


def quality(steps: list[tuple[str, Step]], policy: Policy) -> list[str]:
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
            rows.append(Bar(label=label(s), step=i, status=s.status, value=v, metric=f"metrics.quality.{name}", ticks=ticks, note=note))
        out += [f"<h3>{esc(name)}</h3>", hbar_chart(rows, title=f"quality: {name}", unit=name)]
    return out


def _guard(policy: Policy, step: Step, metric: str) -> Guard | None:
    layer = layer_of(step)
    layers = [layer] if layer else list(Layer)  # the baseline: the limit every layer shares, if one does
    guards = [g for lay in layers for g in policy.guards_for(lay) if g.metric == metric]
    return guards[0] if guards and all(g == guards[0] for g in guards) else None
