"""report.md says where the run's time went, per step and in all, with the numbers trace.json recorded."""

from __future__ import annotations

import json

import pytest
from conftest import small_recipe_dict

from fractal_opt.language.recipe import load_recipe
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.report.tables import time_line
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.testing import FakeEngine, cpu_machine

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run on the fake engine: bfloat16 decodes 1.5x faster, is kept and confirmed."""
    model = tmp_path_factory.mktemp("fake-time") / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "fake"}', encoding="utf-8")
    out = tmp_path_factory.mktemp("time-out")
    recipe = load_recipe(small_recipe_dict(model, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}]}, max_new_tokens=8, repeats=3, limit=2),
                         check_model=False)
    build = FakeEngine.factory(per_token_ms=2.0, speed={"hardware.dtype": {"bfloat16": 1.5}})
    result = Pipeline(recipe, out_dir=out, progress=False, machine=cpu_machine(), build=build, refuse=FakeEngine.refuse, limits=LIMITS).run()
    return result, out


def test_each_step_records_its_build_measure_and_quality_time(run):
    """The baseline's and the step's timings hold build, measure and quality seconds (and the
    baseline its reference scoring); the confirmation its build and measure seconds."""
    result, out = run
    trace = json.loads((out / "trace.json").read_text())
    assert {"build_s", "warmup_s", "reference_s", "measure_s", "quality_s"} <= set(trace["baseline"]["timings"])
    (step,) = trace["steps"]
    assert step["status"] == "kept" and {"build_s", "warmup_s", "measure_s", "quality_s"} <= set(step["timings"])
    assert step["timings"]["measure_s"] > step["timings"]["warmup_s"] > 0
    assert set(trace["final"]["confirmation"]["timings"]) == {"build_s", "measure_s"}


def test_report_md_gives_each_steps_time_line_and_the_total_from_the_trace(run):
    """report.md has one "time:" line per measured step and for the confirmation, each number the
    trace's, and a total above them that is the sum of those numbers."""
    result, out = run
    report = (out / "report.md").read_text()
    base, (step,) = result.trace.baseline, result.trace.steps
    bt, st, ct = base.timings, step.timings, result.trace.final["confirmation"]["timings"]
    rounds = result.trace.calibration["rounds"]
    assert (f"- baseline (A/A calibration): time: build {bt['build_s']:.1f} s, reference {bt['reference_s']:.1f} s, "
            f"measure {bt['measure_s']:.1f} s ({rounds} rounds, warm-ups included: this plan's {bt['warmup_s']:.1f} s), quality {bt['quality_s']:.1f} s") in report
    assert (f"- hardware/{step.label()}: time: build {st['build_s']:.1f} s, measure {st['measure_s']:.1f} s "
            f"({step.metrics['comparison']['rounds']} rounds, warm-ups included: this plan's {st['warmup_s']:.1f} s), quality {st['quality_s']:.1f} s") in report
    conf_rounds = result.trace.final["confirmation"]["rounds"]
    assert f"- final vs baseline: time: build {ct['build_s']:.1f} s, measure {ct['measure_s']:.1f} s ({conf_rounds} rounds)" in report
    build = bt["build_s"] + st["build_s"] + ct["build_s"]
    measure = bt["measure_s"] + st["measure_s"] + ct["measure_s"]
    quality = bt["quality_s"] + st["quality_s"]
    total = build + bt["reference_s"] + measure + quality
    assert (f"Where the time went: {total:.1f} s in these stages (build {build:.1f} s, reference {bt['reference_s']:.1f} s, "
            f"measure {measure:.1f} s, quality {quality:.1f} s)") in report
    assert report.index("Where the time went") < report.index("| layer | pass |")  # at the top, above the steps


def test_a_time_line_names_only_what_was_recorded():
    """A failed step's timings (a traceback, no quality) give only the parts it recorded; none at all give no line."""
    assert time_line({"build_s": 2.04, "compile_s": 41.0, "traceback": "Traceback ..."}) == "time: build 2.0 s, compile 41.0 s"
    assert time_line({"measure_s": 12.25, "warmup_s": 1.5}, rounds=4) == "time: measure 12.2 s (4 rounds, warm-ups included: this plan's 1.5 s)"
    assert time_line({"from_journal": True}) is None and time_line(None) is None
