"""What one user gets, per step: report.md and report.html show TTFT, streaming speed and answer time, previous plan -> step.

Most tests build the trace by hand (as test_trace.py does) so the numbers are known; one runs the
pipeline on fake engines (as test_html.py does) and reads the files it writes.
"""

from __future__ import annotations

import doctest
import re

import pytest
from conftest import small_recipe_dict

from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.report import one_user
from fractal_opt.report.html import render_html
from fractal_opt.report.markdown import report_md
from fractal_opt.report.trace import Step, Trace
from fractal_opt.testing import FakeEngine, cpu_machine

# "TTFT 455 -> 612 ms (+35%)" as report.md prints it (report.html prints the arrow as →).
FIGURE = re.compile(r"(TTFT|streams|answer) ([\d.,]+) (?:->|→) ([\d.,]+) (ms|tok/s|s)(?: \(([+-]\d+)%\))?")
LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})


def _user(ttft: float, decode: float, e2e: float, **more) -> dict:
    return {"ttft_ms_p50": ttft, "decode_tokens_per_s": decode, "e2e_ms_p50": e2e, "throughput_tokens_per_s": 20.0, "quality": {}, **more}


def _step(name: str, layer: str, status: str, metrics: dict | None = None, **params) -> Step:
    return Step(pass_name=name, layer=layer, params=params, status=status, reason=f"{name} {status}", metrics=metrics or {})


def _trace(steps: list[Step], **kw) -> Trace:
    baseline = Step(pass_name="baseline", layer="-", params={}, status="baseline", reason="plain", metrics=_user(455.0, 18.0, 2140.0))
    return Trace(recipe={"name": "t", "model": "m", "workload": {}, "policy": {}}, baseline=baseline, steps=steps, finished=True, run={}, **kw)


def _section(md: str) -> list[str]:
    """The bullet lines of report.md's one-user section."""
    start = md.index("What one user gets")
    lines = md[start:].split("\n\n", 2)[1]
    return lines.splitlines()


@pytest.fixture
def trace() -> Trace:
    """Baseline, a kept dtype, a batching that buys throughput with each user's wait (rolled back), a skipped and a failed step."""
    return _trace([
        _step("dtype", "hardware", "kept", _user(430.0, 24.0, 1700.0), dtype="bfloat16"),
        _step("batching", "scheduling", "rolled_back", _user(1720.4, 9.04, 4400.0, throughput_tokens_per_s=61.0)),
        _step("kv_cache", "model", "skipped"),
        _step("compile", "hardware", "failed"),
    ])


def test_one_user_line_shows_previous_and_step_numbers(trace):
    """Each measured step's line holds the previous kept plan's TTFT, streaming speed and answer time next to its own."""
    rows = _section(report_md(trace))
    assert rows[0] == "- baseline: TTFT 455 ms, streams 18.0 tok/s, answer 2.14 s"
    batching = next(r for r in rows if "scheduling/batching" in r)
    assert "TTFT 430 -> 1,720 ms (+300%)" in batching  # the kept dtype is the plan it was judged against
    assert "streams 24.0 -> 9.04 tok/s (-62%)" in batching and "answer 1.70 -> 4.40 s (+159%)" in batching
    assert "(previous plan: hardware/dtype(dtype=bfloat16) as its own step measured it)" in batching


@pytest.mark.parametrize("where", ["md", "html"])
def test_every_percentage_is_the_ratio_of_the_printed_pair(trace, where):
    """Each % printed next to a pair equals (second / first - 1) of the two numbers as printed, in report.md and report.html."""
    text = report_md(trace) if where == "md" else re.sub(r"<[^>]+>", "", render_html(trace))
    pairs = FIGURE.findall(text)
    assert len(pairs) >= 6, pairs
    for _, before, after, _, pct in pairs:
        b, a = float(before.replace(",", "")), float(after.replace(",", ""))
        assert int(pct) == round((a / b - 1) * 100), (before, after, pct)


def test_percentage_is_computed_from_the_rounded_numbers():
    """The % is the printed pair's ratio (9.95 -> 10.1 is +2%), not the stored values' (9.954 -> 10.05 is +1%)."""
    assert one_user.line({"decode_tokens_per_s": 9.954}, {"decode_tokens_per_s": 10.05}) == "one user: streams 9.95 -> 10.1 tok/s (+2%)"


def test_skipped_and_failed_steps_show_nothing(trace):
    """A skipped or failed step measured nothing: it has no one-user line in report.md nor in report.html."""
    rows = _section(report_md(trace))
    assert len(rows) == 3 and not any("kv_cache" in r or "compile" in r for r in rows), rows
    page = render_html(trace)
    assert re.findall(r'data-one-user="(\d+)"', page) == ["0", "1", "2"]


def test_previous_plan_is_the_last_kept_step_or_the_baseline():
    """A step after a rollback is set against the plan still kept, not the rolled-back one."""
    steps = [_step("a", "hardware", "rolled_back", _user(900.0, 10.0, 3000.0)), _step("b", "hardware", "rolled_back", _user(500.0, 20.0, 2000.0))]
    prev = one_user.previous_plans(_trace(steps).baseline, steps)
    assert [p.step for p in prev] == ["0", "0"] and prev[1].metrics["ttft_ms_p50"] == 455.0
    rows = _section(report_md(_trace(steps)))
    assert "TTFT 455 -> 500 ms (+10%)" in rows[2] and "baseline as the A/A calibration measured it" in rows[2]


def test_previous_plan_from_the_same_rounds_when_the_step_stores_it():
    """A step that stores the previous plan's medians of its own rounds (metrics.previous) is set against those, and says so."""
    steps = [_step("batching", "scheduling", "kept", _user(612.0, 33.1, 1430.0, previous=_user(470.0, 18.5, 2200.0)))]
    row = _section(report_md(_trace(steps)))[1]
    assert "TTFT 470 -> 612 ms (+30%)" in row and "(previous plan in the same rounds)" in row
    assert 'data-step="1" data-metric="metrics.previous.ttft_ms_p50" data-value="470.0"' in render_html(_trace(steps))


def test_under_a_load_profile_the_label_says_queueing_is_included():
    """Under a load profile the heading says the numbers are each request as its caller saw it, queueing included."""
    load = {"mode": "poisson", "rate": 2.0, "requests": 12, "rounds": []}
    steps = [_step("batching", "scheduling", "kept", _user(612.0, 33.1, 1430.0, load=load))]
    md = report_md(_trace(steps))
    assert "per request as one user saw it under this workload's load profile (poisson, 2.0/s: TTFT includes queueing)" in md


def test_the_confirmed_final_plan_shows_what_one_user_gets_on_the_first_screen():
    """The confirmed final plan's decode, TTFT and answer time are on report.md's first screen, from the
    confirmation's medians with their intervals, and in report.html tied to them; a provisional plan shows none."""
    def entry(b, a):
        return {"change": a / b - 1, "interval": [a / b - 1.05, a / b - 0.95], "band": 0.05, "verdict": "better", "baseline_median": b, "final_median": a}
    final = {"kept": ["hardware/dtype"], "status": "confirmed", "vs_baseline": {},
             "confirmation": {"mode": "interleaved", "rounds": 3, "note": "n", "objectives": ["decode_tokens_per_s"],
                              "metrics": {"ttft_ms": entry(455.0, 300.0), "decode_tokens_per_s": entry(18.0, 24.2), "e2e_ms": entry(2140.0, 1650.0)}}}
    steps = [_step("dtype", "hardware", "kept", _user(430.0, 24.0, 1700.0), dtype="bfloat16")]
    md = report_md(_trace(steps, final=final))
    answer = md[md.index("## The answer"):md.index("## How it was measured")]
    assert "**decode 18.0 -> 24.2 tokens/s per stream: +34.4% [95%: +29.4%, +39.4%], confirmed (hardware objective)**" in answer
    assert "TTFT 455 -> 300 ms: -34.1%" in answer and "answer time 2.14 -> 1.65 s: -22.9%" in answer
    page = render_html(_trace(steps, final=final))
    assert 'data-metric="confirmation.metrics.e2e_ms.final_median" data-value="1650.0" data-scale="0.001">1.65<' in page
    provisional = report_md(_trace(steps, final={"kept": ["hardware/dtype"], "status": "provisional"}))
    assert "per stream" not in provisional[provisional.index("## The answer"):provisional.index("## How it was measured")]


def test_report_html_ties_each_number_to_trace_json(trace):
    """report.html's one-user line marks each number with its step and trace.json path (the answer shown in seconds)."""
    page = render_html(trace)
    row = re.search(r'<tr class="one-user" data-one-user="2">(.*?)</tr>', page).group(1)
    assert 'data-step="1" data-metric="metrics.ttft_ms_p50" data-value="430.0">430<' in row
    assert 'data-step="2" data-metric="metrics.e2e_ms_p50" data-value="4400.0" data-scale="0.001">4.40<' in row


def test_docstring_example_holds():
    """The module's example (the compact line a terminal can print) is what line() returns."""
    assert doctest.testmod(one_user).failed == 0


def test_a_pipeline_run_writes_the_one_user_section(tiny_dir, tmp_path):
    """On fake engines: report.md has a line for the baseline and each measured step, none for the failed or skipped one."""
    recipe = small_recipe_dict(tiny_dir, limit=2, max_new_tokens=8, repeats=2, warmup=0,
                               passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}, {"dtype": {"dtype": "float16"}}],
                                       "model": [{"kv_cache": {"implementation": "dynamic"}}, {"kv_cache": {"implementation": "off"}}]})
    build = FakeEngine.factory(speed={"hardware.dtype": {"bfloat16": 1.5}, "model.kv_cache": {"off": 0.3}},
                               fail={"hardware.dtype": {"float16": "simulated out of memory"}})
    result = Pipeline(recipe, out_dir=tmp_path, progress=False, machine=cpu_machine(), build=build, refuse=FakeEngine.refuse, limits=LIMITS).run()
    rows = _section((tmp_path / "report.md").read_text())
    assert [s.status for s in result.trace.steps] == ["kept", "failed", "skipped", "rolled_back"], [s.reason for s in result.trace.steps]
    bf16, _, _, off = result.trace.steps
    assert bf16.reason.startswith("decode_tokens_per_s paired estimate +50.0% [95%: +50.0%, +50.0%], medians 1000.0 -> 1500.0"), bf16.reason
    assert off.reason.startswith("decode_tokens_per_s paired estimate -70.0% [95%: -70.0%, -70.0%], medians 1500.0 -> 450.0"), off.reason
    measured = [bf16, off]
    assert len(rows) == 1 + len(measured), rows
    for s, row in zip(measured, rows[1:]):
        assert row.startswith(f"- {s.layer}/{s.label()}, ") and "TTFT " in row and "streams " in row and "answer " in row
    assert 'metrics.decode_tokens_per_s' in (tmp_path / "report.html").read_text()
