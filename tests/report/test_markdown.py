"""report.md: the answer first, then how it was measured, every step, and the final plan in full."""

from __future__ import annotations

import json

from demo_trace import demo_trace

from fractal_opt.report.html import render_html
from fractal_opt.report.markdown import report_md
from fractal_opt.report.trace import Trace


def test_the_answer_is_the_first_section():
    """The first section after the title is the answer; the machine and the tables come after it."""
    md = report_md(demo_trace())
    sections = [line for line in md.splitlines() if line.startswith("## ")]
    assert sections[:3] == ["## The answer", "## How it was measured", "## Every step"]
    assert md.index("5.78x [95%: 5.20x, 6.41x]") < md.index("Machine:")


def test_a_busy_machine_is_said_under_the_answer():
    """When the A/A calibration could not resolve min_effect, the warning comes right after the answer, once."""
    trace = demo_trace()
    trace.calibration.update(resolves=False, resolution={"decode_tokens_per_s": 0.7}, busy={"busy": True, "text": "load 5"})
    md = report_md(trace)
    assert md.count("This machine is busy") == 1 and md.index("## The answer") < md.index("This machine is busy") < md.index("## How it was measured")


def test_report_md_and_html_state_the_wall_time_of_a_finished_run():
    """A finished run's report says how long it took, from the trace's own start and end times; an unfinished one says nothing about it."""
    data = json.loads(demo_trace().to_json())
    data["run"].update(started_at="2026-12-01T14:49:17+00:00", ended_at="2026-12-01T15:05:18+00:00")
    trace = Trace.from_dict(data)
    assert "Wall time: 16 min 1 s" in report_md(trace)
    assert "wall time 16 min 1 s" in render_html(trace)
    data["finished"] = False
    assert "Wall time" not in report_md(Trace.from_dict(data))
