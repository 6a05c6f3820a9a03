"""The live status line: steps counted, time elapsed, and an ETA from the finished steps."""

from __future__ import annotations

import io

from fractal_opt.pipeline.progress import Progress


def _progress_on_clock(monkeypatch, readings):
    """A Progress writing to a string, its clock reading ``readings`` in turn (the first is its start)."""
    clock = iter(readings)
    monkeypatch.setattr("fractal_opt.pipeline.progress.time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    return Progress(stream=out), out


def test_progress_shows_step_elapsed_and_eta(monkeypatch):
    """The status line counts steps and, once a step has finished, estimates the rest from the mean step time."""
    p, out = _progress_on_clock(monkeypatch, [0.0, 1.0, 11.0, 21.0, 22.0])  # t0 = 0
    p("baseline: loading")  # 1 s
    p("[1/3] hardware/dtype(dtype=bfloat16): building")  # 11 s: first step starts
    p("[2/3] model/quantize(bits=8): building")  # 21 s: one step took 10 s, two remain
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1s] baseline: loading"
    assert lines[1] == "[11s · step 1/3] hardware/dtype(dtype=bfloat16): building"
    assert lines[2] == "[21s · step 2/3 · ETA 20s] model/quantize(bits=8): building"


def test_the_eta_counts_finished_steps_only_and_falls_as_a_step_goes_on(monkeypatch):
    """A long current step neither inflates the mean step time nor drives the ETA below the steps still to come."""
    p, out = _progress_on_clock(monkeypatch, [0.0, 0.0, 10.0, 15.0, 40.0])  # t0 = 0
    p("[1/3] a: building")  # 0 s
    p("[2/3] b: building")  # 10 s: one step took 10 s; two remain (20 s)
    p("[2/3] b: measuring")  # 15 s into b: 20 - 5 = 15 s left
    p("[2/3] b: still measuring")  # b is slow (30 s so far): at least the last step's mean, 10 s
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("[10s · step 2/3 · ETA 20s]")
    assert lines[2].startswith("[15s · step 2/3 · ETA 15s]")
    assert lines[3].startswith("[40s · step 2/3 · ETA 10s]")


def test_with_a_budget_the_line_shows_what_is_left_and_the_eta_never_runs_past_it(monkeypatch):
    """A run with a 30 s budget: each line says how much of it is left, and the ETA is at most that."""
    p, out = _progress_on_clock(monkeypatch, [0.0, 0.0, 10.0, 20.0])
    p.budget_s = 30.0
    p("[1/5] a: building")
    p("[2/5] b: building")  # one step took 10 s, four remain (40 s), but only 20 s of the budget are left
    p("baseline: nothing")  # no step: the budget alone
    lines = out.getvalue().splitlines()
    assert lines[1] == "[10s · step 2/5 · ETA 20s · budget 20s left] b: building"
    assert lines[2].endswith("budget 10s left] baseline: nothing")
