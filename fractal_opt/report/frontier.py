"""report.html's trade-offs: every measured plan of the run on three frontiers, and its cost per token.

Each step measures a plan, yet a trace read step by step hides the trade-offs. Three scatter charts
put every measured plan (the baseline, kept and rolled-back steps) side by side:

- throughput (output tokens/s) against TTFT p90: what the service sells against what a user waits;
- decode tokens/s against KL to the baseline: speed against faithfulness;
- peak memory against decode tokens/s: what the machine holds against what one stream gets.

A plan is on the Pareto frontier of a chart when no other plan is at least as good on both axes and
better on one; frontier plans are drawn larger with a dark ring, the chosen plan (the last kept step,
or the baseline when none was kept) with a star. Every point links to its step's row in the cost
table under the charts (``#fo-step-N``), which holds its verdict and its cost per token: CPU-seconds
per 1,000 output tokens, dollars per million at the recipe's machine price, joules per token, and the
line saying where the energy came from or why it could not be read.

Every point carries ``data-step`` / ``data-metric`` / ``data-value`` (as the other charts do), plus
``data-pareto`` and ``data-chosen``, so a browser test reads the frontier back from the DOM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .labels import pass_label
from .svg import COLOURS, Svg, data_attrs, esc, fmt_num, is_num, nice_max

__all__ = ["FRONTIERS", "Point", "chosen_step", "frontier_html", "frontier_sets", "pareto"]

# (x metric path, x higher is better, y metric path, y higher is better, title)
FRONTIERS = (
    ("throughput_tokens_per_s", True, "ttft_ms_p90", False, "throughput against TTFT p90"),
    ("decode_tokens_per_s", True, "quality.kl_mean", False, "decode speed against KL to the baseline"),
    ("peak_memory_mb", False, "decode_tokens_per_s", True, "peak memory against decode speed"),
)
COST = (("cpu_s_per_1k_tokens", "CPU-s / 1k tokens"), ("usd_per_m_tokens", "$ / M tokens"), ("joules_per_token", "J / token"))
_W, _H, _PAD = 480, 300, 56  # one chart's size and margin (px): two side by side in a 980 px report


@dataclass(frozen=True)
class Point:
    """One measured plan on one chart."""

    step: str  # "0" the baseline, "1".. the steps (report.html's data-step)
    label: str
    status: str
    x: float
    y: float


def _dig(metrics: dict[str, Any], path: str) -> Any:
    value: Any = metrics
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _measured(steps: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The steps that measured a plan (the baseline, kept and rolled back)."""
    return [(i, s) for i, s in steps if s.metrics and s.status in ("baseline", "kept", "rolled_back")]


def chosen_step(steps: Sequence[tuple[str, Any]]) -> str | None:
    """The data-step of the plan the run chose: its last kept step, else the baseline."""
    kept = [i for i, s in steps if s.status == "kept"]
    return kept[-1] if kept else next((i for i, s in steps if s.status == "baseline"), None)


def pareto(points: Sequence[Point], *, x_higher: bool, y_higher: bool) -> set[str]:
    """The steps whose point no other point dominates (at least as good on both axes, better on one)."""

    def score(p: Point) -> tuple[float, float]:
        return (p.x if x_higher else -p.x, p.y if y_higher else -p.y)

    out = set()
    for p in points:
        sp = score(p)
        if not any((sq := score(q))[0] >= sp[0] and sq[1] >= sp[1] and sq != sp for q in points):
            out.add(p.step)
    return out


def _points(steps: Sequence[tuple[str, Any]], x: str, y: str) -> list[Point]:
    out = []
    for i, s in _measured(steps):
        vx, vy = _dig(s.metrics, x), _dig(s.metrics, y)
        if is_num(vx) and is_num(vy):
            out.append(Point(step=i, label=pass_label(s.pass_name, s.params, s.status), status=s.status, x=float(vx), y=float(vy)))
    return out


def frontier_sets(steps: Sequence[tuple[str, Any]]) -> dict[str, list[tuple[str, str]]]:
    """Per frontier (by title), its plans as ``(step id, label)``, for frontiers with two plans or more.
    ``fractal-opt compare`` pools the steps of several runs (ids ``A3``, ``B0``) to list them across runs."""
    out = {}
    for x, x_hi, y, y_hi, title in FRONTIERS:
        points = _points(steps, x, y)
        if len(points) >= 2:
            on = pareto(points, x_higher=x_hi, y_higher=y_hi)
            out[title] = [(p.step, p.label) for p in points if p.step in on]
    return out


def _chart(points: list[Point], frontier: set[str], chosen: str | None, *, x: str, y: str, title: str) -> str:
    svg = Svg(_W, _H, title=title)
    x1, y0 = _W - 16, _H - _PAD
    xmax, ymax = nice_max(max(p.x for p in points)), nice_max(max(p.y for p in points))
    svg.text(_PAD, 16, title, weight="600")
    svg.axis(_PAD, x1, y0, 28, xmax, unit=x)
    for k in range(6):  # the y axis: ticks at fifths of its end
        yy = y0 - (y0 - 28) * k / 5
        svg.line(_PAD, yy, x1, yy, stroke="#eeeeee")
        svg.text(_PAD - 6, yy + 4, fmt_num(ymax * k / 5), anchor="end", size=10, fill="#555")
    svg.text(_PAD - 6, 24, y, anchor="end", size=10, fill="#555")
    ordered = sorted((p for p in points if p.step in frontier), key=lambda p: p.x)
    coords = {p.step: (_PAD + (x1 - _PAD) * p.x / xmax, y0 - (y0 - 28) * p.y / ymax) for p in points}
    for a, b in zip(ordered, ordered[1:]):  # the frontier as a line through its plans, left to right
        svg.line(*coords[a.step], *coords[b.step], stroke="#333", dash=True)
    for p in points:
        cx, cy = coords[p.step]
        on = p.step in frontier
        attrs = data_attrs(p.step, f"metrics.{x}", p.x) + f' data-y-metric="metrics.{esc(y)}" data-y-value="{p.y!r}" data-pareto="{int(on)}" data-chosen="{int(p.step == chosen)}"'
        tip = f"step {p.step}: {p.label} ({p.status}); {x} {fmt_num(p.x)}, {y} {fmt_num(p.y)}" + ("; on the frontier" if on else "")
        svg.add(f'<a href="#fo-step-{esc(p.step)}">')
        svg.circle(cx, cy, 7 if on else 5, fill=COLOURS.get(p.status, COLOURS["other"]), stroke="#222" if on else "none", extra=' class="fo-point"' + attrs, tip=tip)
        if p.step == chosen:
            svg.text(cx + 9, cy - 7, "★ chosen", size=11, weight="600")
        svg.add("</a>")
    return svg.render()


def _cost_table(steps: Sequence[tuple[str, Any]], fronts: dict[str, list[str]], chosen: str | None) -> str:
    head = "<tr><th>#</th><th>pass</th><th>verdict</th>" + "".join(f"<th>{esc(h)}</th>" for _, h in COST) + "<th>on the frontier of</th></tr>"
    rows = []
    for i, s in _measured(steps):
        cells = "".join(f'<td class="num"{data_attrs(i, f"metrics.{m}", _dig(s.metrics, m))}>{fmt_num(_dig(s.metrics, m))}</td>' for m, _ in COST)
        mark = " ★" if i == chosen else ""
        rows.append(f'<tr id="fo-step-{esc(i)}" data-step="{esc(i)}"><td>{esc(i)}{mark}</td><td>{esc(pass_label(s.pass_name, s.params, s.status))}</td>'
                    f"<td>{esc(s.status)}</td>{cells}<td>{esc(', '.join(fronts.get(i, [])) or '–')}</td></tr>")
    return f'<table class="fo-cost">{head}{"".join(rows)}</table>'


def _cost_notes(steps: Sequence[tuple[str, Any]]) -> str:
    """Where the energy came from (or why not) and which price was used, once per distinct line."""
    lines: list[str] = []
    for _, s in _measured(steps):
        cost = s.metrics.get("cost") if isinstance(s.metrics.get("cost"), dict) else {}
        for key in ("energy", "price"):
            if cost.get(key) and f"{key}: {cost[key]}" not in lines:
                lines.append(f"{key}: {cost[key]}")
    return "; ".join(lines) or "energy and price: not recorded in this trace (measured before the cost per token existed)"


def frontier_html(steps: Sequence[tuple[str, Any]]) -> list[str]:
    """The section: the three frontiers (each with two or more plans to compare) and the cost table."""
    chosen = chosen_step(steps)
    charts, fronts = [], {}
    for x, x_hi, y, y_hi, title in FRONTIERS:
        points = _points(steps, x, y)
        if len(points) < 2:
            continue
        frontier = pareto(points, x_higher=x_hi, y_higher=y_hi)
        for step in frontier:
            fronts.setdefault(step, []).append(title)
        charts.append(_chart(points, frontier, chosen, x=x, y=y, title=title))
    if not _measured(steps):
        return []
    note = ("Every measured plan of the run, side by side. Larger ringed points are on the Pareto frontier (no other plan is at least as good on "
            "both axes and better on one); ★ marks the chosen plan. Each point links to its row below.") if charts else \
        "Fewer than two measured plans with these numbers: no frontier to draw."
    return ["<h2>Trade-offs and the cost per token</h2>", f'<p class="note">{esc(note)}</p>', *charts,
            '<h3>The cost per token</h3>', f'<p class="note">{esc(_cost_notes(steps))}</p>', _cost_table(steps, fronts, chosen)]
