"""The run's time budget: durations, what is left, and what a search is told it may spend."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.pipeline.time_budget import TimeBudget, parse_duration, search_context, step_seconds
from fractal_opt.report.trace import Step, Trace
from fractal_opt.testing import cpu_machine
from fractal_opt.tower.plan import Plan


def _step(status, **timings):
    return Step(pass_name="x", layer="hardware", params={}, status=status, reason="", timings=timings)


def test_durations_read_as_people_write_them_and_bad_ones_are_refused():
    """6m, 90s, 1h and plain seconds; anything else names what is allowed."""
    assert (parse_duration("6m"), parse_duration("90 s"), parse_duration("1.5h"), parse_duration(45)) == (360.0, 90.0, 5400.0, 45.0)
    for bad in ("six minutes", "-3m", "0", True):
        with pytest.raises(RecipeError, match="time budget"):
            parse_duration(bad)


def test_the_budget_is_spent_when_its_time_has_passed():
    """No budget is never spent; a budget says so once its seconds have passed."""
    now = [0.0]
    budget = TimeBudget(60, clock=lambda: now[0])
    assert budget.spent() is None and budget.left() == 60
    now[0] = 61
    assert "time budget (1m00s) is spent" in budget.spent()
    assert TimeBudget(None).spent() is None and TimeBudget(None).left() is None


def test_a_search_is_told_the_budget_less_what_the_run_needs_after_it():
    """The reserve: the final confirmation (half the baseline's A/A measurement) and a judged step
    on the tuned plan (30 s) per pass behind the search; the screened steps' mean and the latest
    judged step come from the trace, and so do the plans a quality guard refused."""
    now = [100.0]
    budget = TimeBudget(300, clock=lambda: now[0])
    now[0] = 150.0
    trace = Trace(recipe={}, baseline=_step("baseline", measure_s=40.0),
                  steps=[_step("rolled_back", build_s=5.0, measure_s=80.0, quality_s=40.0), _step("screened_out", build_s=2.0, measure_s=3.0),
                         _step("screened_out", build_s=2.0, measure_s=5.0), _step("kept", build_s=5.0, measure_s=15.0, quality_s=10.0)])
    assert step_seconds(trace.steps) == {"screened_out": 6.0, "judged": 30.0}
    context = search_context(plan=Plan(source="x"), machine=cpu_machine(), workload=None, trace=trace, budget=budget, passes_after=2,
                             skip=lambda p, plan: None, runtimes=())
    assert context.remaining_s == 300 - 50 - 20 - 2 * 25
    assert context.refused == ()
    trace.steps[0].plan = {"hardware": {"runtime": "llama_cpp"}}
    trace.steps[0].metrics = {"tripped": {"guards": ["accuracy"], "quality": ["accuracy"]}}
    refused = search_context(plan=Plan(source="x"), machine=cpu_machine(), workload=None, trace=trace, budget=budget, passes_after=0,
                             skip=lambda p, plan: None, runtimes=()).refused
    assert refused == (("x()", {"hardware": {"runtime": "llama_cpp"}}, ("accuracy",)),)
    assert context.step_s == {"screened_out": 6.0, "judged": 30.0}
