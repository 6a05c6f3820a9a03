"""What the terminal prints when a run ends: the answer in the first lines, then a table that fits the width."""

from __future__ import annotations

import re

import pytest
from demo_trace import demo_trace

from fractal_opt.core.text import BOUND_RATIO
from fractal_opt.report.markdown import report_md
from fractal_opt.report.terminal import summary, tower_table

LONG_REASON = ("decode_tokens_per_s paired estimate +4.0% [95%: -1.0%, +9.0%], medians 20.1 -> 20.9, noise band ±6.0%; "
               "guard ttft_ms max_regression 10% tripped: paired estimate +35.0% [95%: +30.0%, +41.0%], medians 300 -> 405; "
               "guard throughput_tokens_per_s max_regression 10% tripped: paired estimate -37.3% [95%: -40.0%, -33.0%] THE-END")
# An interval printed as numbers: "[95%: +2.0%, +4.0%]" or "[95%: 5.20x, 6.41x]".
INTERVAL = re.compile(r"([+-]?\d+\.\d+)(%|x) \[95%: ([+-]?\d+\.\d+)(?:%|x), ([+-]?\d+\.\d+)(?:%|x)\]")


def test_the_first_15_lines_answer_the_recipe():
    """The summary's first 15 lines hold the one-request decode ratio with its interval, the
    throughput ratio at the offered load with its interval, and the eval's questions lost and gained."""
    head = summary(demo_trace()).splitlines()[:15]
    text = "\n".join(head)
    one_user = head.index("One user, one request at a time (2 rounds):")
    assert "decode 15.3 -> 88.4 tokens/s per stream: 5.78x [95%: 5.20x, 6.41x], confirmed (hardware objective)" in head[one_user + 1]
    at_load = head.index("At the offered load, 4 clients at once (3 rounds):")
    assert "throughput 13.6 -> 30.2 tokens/s: 2.20x [95%: 2.06x, 2.34x], confirmed (scheduling objective)" in head[at_load + 1]
    assert "Answers kept: eval basics: 35 of 45 right (baseline 35), lost 0, gained 0" in text


def test_a_traded_objective_is_a_line_under_its_figure_not_the_headline():
    """Decode at the burst of 4 (traded by batching, its interval unbounded) is the line under the one-request figure."""
    head = summary(demo_trace()).splitlines()
    decode = next(i for i, line in enumerate(head) if line.strip().startswith("decode 15.3 -> 88.4"))
    assert head[decode + 1].strip() == ("4 clients at once: 16.2 -> 32.1 tokens/s per stream, +15.3%, too few rounds to bound: "
                                        "traded by scheduling/batching for throughput (-78.5% in that step)")


@pytest.mark.parametrize("render", [lambda t: summary(t), report_md], ids=["terminal", "report.md"])
def test_no_interval_wider_than_ten_times_its_estimate_is_printed(render):
    """Every interval the terminal summary and report.md print as numbers is at most 10x as wide as its estimate;
    the unbounded ones say so (the demo has two: decode at 4 clients and TTFT one request at a time)."""
    text = render(demo_trace())
    printed = INTERVAL.findall(text)
    assert len(printed) >= 8, printed
    for estimate, unit, low, high in printed:
        e, lo, hi = (float(v) - (1 if unit == "x" else 0) for v in (estimate, low, high))  # a ratio's change is ratio - 1
        assert hi - lo <= BOUND_RATIO * abs(e) + 0.02, (estimate, low, high)  # 0.02: the printed rounding
    assert "too few rounds to bound" in text and "-64.0%" not in text and "+269.1%" not in text


@pytest.mark.parametrize("width", [120, 100, 80])
def test_terminal_table_fits_the_width(width):
    """Every line of the tower table fits the width; 120 columns by default; what was left out is named."""
    text = tower_table(demo_trace(), width=width)
    assert max(map(len, text.splitlines())) <= width, "\n" + text
    if width == 120:
        assert text == tower_table(demo_trace())
    assert "decode tok/s" in text.splitlines()[0]


def test_long_reasons_are_cut_in_the_terminal_and_whole_in_report_md():
    """A reason over two lines ends with a pointer to report.md; report.md holds it in full."""
    trace = demo_trace()
    trace.steps[0].reason = LONG_REASON
    assert "THE-END" not in tower_table(trace) and "[...report.md]" in tower_table(trace)
    assert LONG_REASON in report_md(trace)
