"""Chart primitives for report.html: inline SVG written as text.

Hand-written because the report must be one self-contained file with no new dependency (no
matplotlib, no JavaScript library, no CDN), and the charts it needs are a handful of bars, ranges
and ticks. Every mark that shows a number carries ``data-step`` / ``data-metric`` / ``data-value``
attributes (the raw number from trace.json), so a test can read them back from a browser's DOM.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.text import clip

__all__ = ["COLOURS", "Bar", "Svg", "data_attrs", "esc", "fmt_num", "hbar_chart", "nice_max", "range_chart"]

# Verdict colours (colour-blind safe pairs: blue / green / orange / red / grey).
COLOURS = {"baseline": "#4c78a8", "kept": "#2e9e4f", "rolled_back": "#f58518", "screened_out": "#b279a2", "failed": "#c0392b", "skipped": "#9e9e9e",
           "other": "#7f7f7f"}
FONT = 12
LABEL_W = 260  # left margin of the row charts, for step labels
_LABEL_CHARS = 38  # characters of a step label per line in that margin (11 px system-ui: ~6.2 px a character, 8 px kept clear)


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def fmt_num(v: Any, digits: int = 3) -> str:
    """A number for a human: 3 significant digits, thousands without exponent; "–" when missing."""
    if not is_num(v):
        return "–"
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{v:.{decimals}f}"


def data_attrs(step: str | int | None, metric: str | None, value: Any, scale: float = 1.0) -> str:
    """The attributes that tie a mark to trace.json (``repr`` keeps the float exact); ``scale``:
    the text shows ``value x scale`` (bytes/s shown as GB/s)."""
    if step is None or not metric or not is_num(value):
        return ""
    return f' data-step="{esc(step)}" data-metric="{esc(metric)}" data-value="{float(value)!r}"' + (f' data-scale="{scale!r}"' if scale != 1.0 else "")


def nice_max(v: float) -> float:
    """The smallest 1 / 2 / 2.5 / 5 x 10^k at or above ``v`` (an axis end a reader can read)."""
    if not is_num(v) or v <= 0:
        return 1.0
    base = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if m * base >= v * 0.999999:
            return m * base
    return 10 * base


class Svg:
    """An SVG canvas collecting elements as text."""

    def __init__(self, width: int, height: int, *, title: str = "", css_class: str = "chart"):
        self.width, self.height, self.title, self.css_class = width, height, title, css_class
        self.parts: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def rect(self, x: float, y: float, w: float, h: float, *, fill: str, stroke: str = "none", extra: str = "", tip: str = "", dash: bool = False,
             opacity: float = 1.0) -> None:
        style = ' stroke-dasharray="4 2"' if dash else ""
        body = f"<title>{esc(tip)}</title>" if tip else ""
        self.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" fill="{fill}" stroke="{stroke}" '
                 f'fill-opacity="{opacity}"{style}{extra}>{body}</rect>')

    def line(self, x1: float, y1: float, x2: float, y2: float, *, stroke: str = "#333", width: float = 1, dash: bool = False, extra: str = "") -> None:
        style = ' stroke-dasharray="3 3"' if dash else ""
        self.add(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" stroke-width="{width}"{style}{extra}/>')

    def circle(self, x: float, y: float, r: float, *, fill: str, stroke: str = "none", extra: str = "", tip: str = "") -> None:
        body = f"<title>{esc(tip)}</title>" if tip else ""
        self.add(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{fill}" stroke="{stroke}" stroke-width="1.5"{extra}>{body}</circle>')

    def text(self, x: float, y: float, s: str, *, anchor: str = "start", size: int = FONT, weight: str = "normal", fill: str = "#222",
             extra: str = "", tip: str = "") -> None:
        body = esc(s) + (f"<title>{esc(tip)}</title>" if tip else "")
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" font-weight="{weight}" fill="{fill}"{extra}>{body}</text>')

    def label(self, x: float, y: float, s: str, *, chars: int, lines: int = 2, anchor: str = "start", size: int = FONT, line_h: float | None = None) -> None:
        """``s`` wrapped at word or ``(`` / ``,`` boundaries into at most ``lines`` lines of ``chars``
        characters, the first line's baseline at ``y``; cut with an ellipsis only when it does not
        fit in them all (the full text stays in the tooltip). Long pass labels such as
        ``runtime(backend=llama_cpp, dtype=bfloat16)`` then read whole where they fit."""
        rows = wrap(s, chars, lines=lines)
        step = line_h or size + 2
        spans = "".join(f'<tspan x="{x:.1f}" dy="{0 if i == 0 else step:.1f}">{esc(r)}</tspan>' for i, r in enumerate(rows))
        tip = f"<title>{esc(s)}</title>" if rows != [s] else ""
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" fill="#222">{spans}{tip}</text>')

    def axis(self, x0: float, x1: float, y: float, top: float, vmax: float, unit: str = "", ticks: int = 5) -> None:
        """A horizontal value axis from 0 to ``vmax`` at ``y`` with grid lines up to ``top``."""
        for i in range(ticks + 1):
            v = vmax * i / ticks
            x = x0 + (x1 - x0) * i / ticks
            self.line(x, top, x, y, stroke="#e3e3e3")
            self.text(x, y + 14, fmt_num(v), anchor="middle", size=10, fill="#555")
        self.line(x0, y, x1, y, stroke="#888")
        if unit:
            self.text(x1, y + 28, unit, anchor="end", size=10, fill="#555")

    def render(self) -> str:
        label = f' role="img" aria-label="{esc(self.title)}"' if self.title else ""
        return (f'<svg class="{self.css_class}" xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}"{label}>' + "".join(self.parts) + "</svg>")


@dataclass
class Bar:
    """One row of a bar or range chart."""

    label: str
    step: str | int  # "0" baseline, "1".. steps: the index data-step carries
    status: str
    value: float | None = None  # bar end (hbar_chart)
    metric: str = ""  # the trace.json path of value, e.g. "roofline.decode_ceiling_tokens_per_s"
    ticks: list[tuple[float, str, str, str]] = field(default_factory=list)  # (value, metric path, colour, tip): a vertical mark on the row
    points: list[tuple[float, str, str]] = field(default_factory=list)  # (value, metric path, name) for range_chart
    note: str = ""  # text at the end of the row
    tip: str = ""


def wrap(text: str, chars: int, *, lines: int = 2) -> list[str]:
    """``text`` in at most ``lines`` lines of at most ``chars`` characters, broken after a space,
    ``(`` or ``,`` where one falls in the line (else mid-word); the last line ends with "…" only
    when the text does not fit in ``lines`` lines."""
    text = " ".join(text.split())
    rows: list[str] = []
    while text and len(rows) < lines:
        if len(text) <= chars:
            rows.append(text)
            text = ""
            break
        if len(rows) == lines - 1:
            rows.append(clip(text, chars))
            text = ""
            break
        cut = max(text.rfind(c, 0, chars) for c in " (,")
        cut = cut + 1 if cut > 0 else chars
        rows.append(text[:cut].rstrip())
        text = text[cut:].lstrip()
    return rows or [""]


def _row_layout(n: int, *, row_h: int, top: int = 10, bottom: int = 40) -> int:
    return top + n * row_h + bottom


def hbar_chart(rows: Sequence[Bar], *, title: str, unit: str, width: int = 980, row_h: int = 24, vmax: float | None = None) -> str:
    """Horizontal bars, one per row, coloured by verdict, with optional vertical ticks (a ceiling, a guard)."""
    values = [r.value for r in rows if is_num(r.value)] + [t[0] for r in rows for t in r.ticks if is_num(t[0])]
    top_v = nice_max(vmax if vmax is not None else (max(values) if values else 1.0))
    height = _row_layout(len(rows), row_h=row_h)
    svg = Svg(width, height, title=title)
    x0, x1 = LABEL_W, width - 230
    scale = (x1 - x0) / top_v
    y_axis = 10 + len(rows) * row_h
    svg.axis(x0, x1, y_axis, 4, top_v, unit)
    for i, r in enumerate(rows):
        y = 10 + i * row_h
        svg.label(x0 - 8, y + row_h * 0.65 - (6 if len(r.label) > _LABEL_CHARS else 0), r.label, chars=_LABEL_CHARS, anchor="end", size=11, line_h=12)
        if is_num(r.value):
            svg.rect(x0, y + 4, min(r.value, top_v) * scale, row_h - 8, fill=COLOURS.get(r.status, COLOURS["other"]),
                     extra=data_attrs(r.step, r.metric, r.value), tip=r.tip or f"{r.label}: {fmt_num(r.value)} {unit}")
        for value, metric, colour, tip in r.ticks:
            if is_num(value):
                x = x0 + min(value, top_v) * scale
                svg.add(f'<line x1="{x:.1f}" y1="{y + 1:.1f}" x2="{x:.1f}" y2="{y + row_h - 1:.1f}" stroke="{colour}" stroke-width="3"'
                        f'{data_attrs(r.step, metric, value)}><title>{esc(tip)}</title></line>')
        svg.text(x1 + 8, y + row_h * 0.65, r.note, size=11, fill="#333")
    return svg.render()


# Marks of range_chart's points, in order (p50, p90, p99).
_POINT_STYLE = (("fill", 4.5), ("half", 4.5), ("open", 4.5))


def range_chart(rows: Sequence[Bar], *, title: str, unit: str, width: int = 980, row_h: int = 22) -> str:
    """Per row a line from the first point to the last with a dot at each (percentiles p50 / p90 / p99)."""
    values = [p[0] for r in rows for p in r.points if is_num(p[0])]
    top_v = nice_max(max(values) if values else 1.0)
    svg = Svg(width, _row_layout(len(rows), row_h=row_h), title=title)
    x0, x1 = LABEL_W, width - 230
    scale = (x1 - x0) / top_v
    svg.axis(x0, x1, 10 + len(rows) * row_h, 4, top_v, unit)
    for i, r in enumerate(rows):
        y = 10 + i * row_h + row_h / 2
        colour = COLOURS.get(r.status, COLOURS["other"])
        svg.label(x0 - 8, y + 4 - (6 if len(r.label) > _LABEL_CHARS else 0), r.label, chars=_LABEL_CHARS, anchor="end", size=11, line_h=12)
        pts = [(x0 + v * scale, v, metric, name) for v, metric, name in r.points if is_num(v)]
        if len(pts) >= 2:
            svg.line(pts[0][0], y, pts[-1][0], y, stroke=colour, width=2)
        for (x, v, metric, name), (style, radius) in zip(pts, _POINT_STYLE):
            fill = colour if style == "fill" else ("#fff" if style == "open" else _lighter(colour))
            svg.circle(x, y, radius, fill=fill, stroke=colour, extra=data_attrs(r.step, metric, v), tip=f"{r.label}: {name} {fmt_num(v)} {unit}")
        svg.text(x1 + 8, y + 4, r.note, size=11, fill="#333")
    return svg.render()


def _lighter(colour: str) -> str:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*((c + 255) // 2 for c in (r, g, b)))
