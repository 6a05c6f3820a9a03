"""report.html: the run as pictures, one self-contained file (inline SVG and CSS, no network).

What it shows, top to bottom: the answer to the recipe's question (:mod:`.html_first_screen`:
one user, the offered load, the cost, the answers kept, from the final confirmation); the tower (each step coloured
by its verdict); per layer a waterfall of its objective from the baseline to the final plan with
each step's threshold (its interval half-width, at least min_effect); decode tokens/s against the bandwidth ceiling (the roofline); TTFT / ITL /
e2e percentiles; quality against its guards; the frontiers; the answers side by side; every step
with its full reason and what one user got from it (:mod:`.one_user`); the noise calibration and
the machine. It reads only what trace.json stores, so an old trace renders too.

The sections live in :mod:`.html_first_screen`, :mod:`.html_sections` (text and tables) and
:mod:`.html_charts` (the step charts), their shared helpers in :mod:`.html_parts`; this module is
the page: its styles, its script and the order of the sections, one call each.

:func:`render_html` is the whole page; :func:`render_fragment` the same content for a notebook
(``Result._repr_html_``, :class:`fractal_opt.report.Report`), its styles scoped to the fragment.
"""

from __future__ import annotations

from .answers import answers_html
from .frontier import frontier_html
from .html_charts import latency, legend, quality, roofline, tower, waterfalls
from .html_first_screen import CSS as ANSWER_CSS
from .html_first_screen import answer_section
from .html_sections import calibration, header, machine, steps_table
from .reader import Reader
from .svg import esc
from .trace import Trace

__all__ = ["render_fragment", "render_html"]


def render_html(trace: Trace) -> str:
    """The whole report.html page."""
    title = f"fractal_opt report: {trace.recipe.get('name') or trace.recipe.get('model')}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body>{render_fragment(trace, styles=False)}<script>{SCRIPT}</script></body></html>\n")


def render_fragment(trace: Trace, *, styles: bool = True) -> str:
    """The report's content in one ``<div class="fo-report">`` (for notebooks: styles included, scoped)."""
    reader = Reader(trace)
    steps, policy = reader.steps(), reader.policy
    parts = [f"<style>{CSS}</style>" if styles else "", '<div class="fo-report">', header(trace)]
    parts += answer_section(trace)  # what the recipe asked, answered: the first screen
    parts += ["<h2>The tower</h2>", ('<p class="note">Bottom up: the baseline, then each pass in tower order, coloured by its verdict '
              "(hover a step for its full reason).</p>"), legend(steps), tower(steps, policy)]
    parts += waterfalls(trace, steps, policy)
    parts += roofline(trace, steps)
    parts += latency(steps)
    parts += quality(steps, policy)
    parts += frontier_html(steps)  # every measured plan on the frontiers, and the cost per token
    parts.append(answers_html(trace))  # the baseline's and the final plan's answers side by side
    parts += steps_table(steps, policy)
    parts += calibration(trace, policy)
    parts += machine(trace)
    parts.append("</div>")
    return "\n".join(p for p in parts if p)


CSS = """
.fo-report { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; max-width: 1360px; margin: 0 auto; padding: 0 12px; line-height: 1.4; }
.fo-report .figs { display: flex; flex-wrap: wrap; gap: 4px 24px; align-items: flex-start; } .fo-report .figs .fig { flex: 0 1 auto; max-width: 100%; }
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
""" + ANSWER_CSS

# Records in the page how many charts the browser laid out with a non-zero size, how tall the page
# is, and where each of the answer's cards (data-answer) ends, in px from the top of the page at
# the window's width (read back from the DOM by the browser tests and scripts/screenshot-report.sh;
# the page itself works without it).
SCRIPT = """document.addEventListener('DOMContentLoaded', function () {
  var charts = document.querySelectorAll('.fo-report svg.chart'), drawn = 0, ends = [];
  charts.forEach(function (c) { var b = c.getBoundingClientRect(); if (b.width > 0 && b.height > 0) drawn++; });
  document.querySelectorAll('.fo-report [data-answer]').forEach(function (e) {
    var b = e.getBoundingClientRect(); if (b.width > 0) ends.push(e.getAttribute('data-answer') + ':' + Math.ceil(b.bottom + window.scrollY)); });
  document.documentElement.setAttribute('data-charts-drawn', drawn + '/' + charts.length);
  document.documentElement.setAttribute('data-page-height', document.documentElement.scrollHeight);
  document.documentElement.setAttribute('data-answer-ends', window.innerWidth + ' ' + ends.join(' '));
});"""
