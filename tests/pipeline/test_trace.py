"""The trace on its own: the terminal table fits, labels show what differs, trace.json is strict and versioned, reprs are short."""

from __future__ import annotations

import io
import json
import math
import warnings

import pytest

from fractal_opt.core.quiet import quiet_third_party
from fractal_opt.layers.scheduling import Batching
from fractal_opt.pipeline.progress import Progress
from fractal_opt.pipeline.run_info import model_fingerprint
from fractal_opt.pipeline.runner import Result
from fractal_opt.pipeline.trace import SCHEMA_VERSION, Step, Trace, TraceSchemaError
from fractal_opt.tower.plan import Plan

LONG_REASON = ("decode_tokens_per_s paired estimate +4.0% [95%: -1.0%, +9.0%], medians 20.1 -> 20.9, noise band ±6.0%; "
               "guard ttft_ms max_regression 10% tripped: paired estimate +35.0% [95%: +30.0%, +41.0%], medians 300 -> 405; "
               "guard throughput_tokens_per_s max_regression 10% tripped: paired estimate -37.3% [95%: -40.0%, -33.0%] THE-END")


def _metrics(decode: float, kl: float = 0.0) -> dict:
    return {"decode_tokens_per_s": decode, "ttft_ms": 300.0, "prefill_ms": 280.0, "e2e_ms": 4000.0, "throughput_tokens_per_s": 21.7,
            "peak_memory_mb": 1234.0, "weight_mb": 513.0, "quality": {"kl_mean": kl, "agreement": 1.0}}


def _trace(**kw) -> Trace:
    batching = Batching(mode="continuous", batch_size=6)
    return Trace(
        recipe={"name": "t", "model": "org/not-local", "workload": {}, "policy": {}},
        machine={"packages": {"torch": "2.13.0+cpu", "transformers": "5.24.0"}},
        baseline=Step(pass_name="baseline", layer="-", params={}, status="baseline", reason="plain transformers", metrics=_metrics(20.0)),
        steps=[
            Step(pass_name="batching", layer="scheduling", params=batching.params(), status="rolled_back", reason=LONG_REASON,
                 metrics=_metrics(20.9, 0.001), changes={"throughput_tokens_per_s": -0.373, "decode_tokens_per_s": 0.04}),
            Step(pass_name="max_new_tokens", layer="application", params={"limit": 24, "stop": []}, status="kept", reason="e2e_ms -12.5%",
                 metrics=_metrics(20.5), changes={"e2e_ms": -0.125}),
        ],
        final={"kept": ["application/max_new_tokens"], "vs_baseline": {"e2e_ms": -0.125}},
        finished=True, **kw,
    )


@pytest.mark.parametrize("width", [120, 100, 80])
def test_terminal_table_fits_the_width(width):
    """Every line of to_text(width) fits; 120 columns by default; what was left out is named."""
    text = _trace().to_text(width=width)
    assert max(map(len, text.splitlines())) <= width, "\n" + text
    if width == 120:
        assert text == _trace().to_text()
    assert "decode tok/s" in text.splitlines()[0]


def test_labels_show_only_non_default_parameters():
    """A pass label names the parameters that differ from the pass's defaults (and its first one), not every field."""
    trace = _trace()
    label = trace.steps[0].label()
    assert label == "batching(mode=continuous, batch_size=6)"
    assert "page_size" not in trace.to_markdown()
    assert trace.steps[1].label() == "max_new_tokens(limit=24)"


def test_long_reasons_are_cut_in_the_terminal_and_whole_in_report_md():
    """A reason over two lines ends with a pointer to report.md; report.md holds it in full."""
    trace = _trace()
    text = trace.to_text()
    assert "THE-END" not in text and "[...report.md]" in text
    assert LONG_REASON in trace.to_markdown()


def test_trace_json_is_strict_and_names_what_was_not_finite():
    """NaN and infinity are written as null (json.loads with no NaN allowed reads the file) and listed under non_finite."""
    trace = _trace()
    trace.steps[0].metrics["quality"]["kl_mean"] = math.nan
    trace.steps[1].changes["e2e_ms"] = -math.inf

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    data = json.loads(trace.to_json(), parse_constant=refuse)
    assert data["steps"][0]["metrics"]["quality"]["kl_mean"] is None
    assert data["non_finite"] == {"steps[0].metrics.quality.kl_mean": "nan", "steps[1].changes.e2e_ms": "-inf"}


def test_trace_json_records_versions_times_and_the_model():
    """schema_version, fractal_opt / torch / transformers versions, start and end times, and how the model was (not) hashed."""
    data = json.loads(_trace().to_json())
    assert data["schema_version"] == SCHEMA_VERSION
    run = data["run"]
    assert run["versions"]["torch"] == "2.13.0+cpu" and run["versions"]["transformers"] == "5.24.0" and run["versions"]["fractal_opt"]
    assert run["started_at"] <= run["ended_at"]
    assert run["model"]["status"].startswith("not hashed")  # a hub id: nothing downloaded to hash


def test_a_finished_trace_keeps_its_end_time(monkeypatch):
    """Reading a finished trace and writing it again does not move its end time."""
    first = json.loads(_trace().to_json())
    first["run"]["ended_at"] = "2020-01-01T00:00:00+00:00"
    again = json.loads(Trace.from_dict(first).to_json())
    assert again["run"] == first["run"]


def test_model_fingerprint_changes_with_the_files(tmp_path):
    """The fingerprint hashes names, sizes and (small) contents: a changed file changes it, the same files give the same one."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    one, two = model_fingerprint(str(tmp_path)), model_fingerprint(str(tmp_path))
    assert one == two and one["files"] == 2 and one["bytes"] == 123 and "50 MiB" in one["method"]
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 100)
    assert model_fingerprint(str(tmp_path))["sha256"] != one["sha256"]


def test_reading_other_schemas_says_what_to_do():
    """A newer trace.json is refused with the versions and the fix; an older one reads with a warning; a non-trace is named."""
    data = json.loads(_trace().to_json())
    with pytest.raises(TraceSchemaError, match=r"schema_version 99, newer than this fractal_opt reads \(2\).*Upgrade fractal-opt"):
        Trace.from_dict({**data, "schema_version": 99})
    old = {k: v for k, v in data.items() if k not in ("schema_version", "run")}
    with pytest.warns(UserWarning, match="schema_version 1"):
        trace = Trace.from_dict(old)
    assert trace.steps[1].status == "kept"
    with pytest.raises(TraceSchemaError, match="not a fractal_opt trace"):
        Trace.from_dict({"steps": []})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trace.from_dict(data)  # the current schema: no warning


def test_load_names_the_file(tmp_path):
    """A trace.json that is not JSON fails naming the file."""
    bad = tmp_path / "trace.json"
    bad.write_text("{not json")
    with pytest.raises(TraceSchemaError, match=str(bad)):
        Trace.load(bad)


def test_reprs_are_a_few_readable_lines():
    """repr() of a Trace, a Step and a Plan: a few lines, only what differs from defaults."""
    trace = _trace()
    text = repr(trace)
    assert len(text.splitlines()) <= 4 and len(text) < 400, text
    assert "2 steps (1 rolled back, 1 kept)" in text and "e2e_ms -12.5%" in text
    assert repr(trace.steps[1]) == "Step(application/max_new_tokens(limit=24): kept, e2e_ms -12.5%)"
    assert repr(trace.steps[0]).startswith("Step(scheduling/batching(mode=continuous, batch_size=6): rolled_back, decode_tokens_per_s paired")
    assert len(repr(trace.steps[0])) < 160
    plan = Plan(source="m").replace_section("scheduling", batching="static", batch_size=6).with_applied("batching")
    assert repr(plan) == "Plan(source='m'\n  scheduling: batching='static', batch_size=6\n  applied: batching)"
    assert repr(Plan(source="m")) == "Plan(source='m')"
    assert repr(plan.scheduling) == "SchedulingPlan(batching='static', batch_size=6)"
    result = repr(Result(plan=plan, trace=trace, recipe=None, out_dir=None))  # type: ignore[arg-type]
    assert result.startswith("Result(\n  plan: Plan(source='m'\n      scheduling:") and len(result.splitlines()) <= 10, result


def test_a_provisional_final_plan_claims_no_change():
    """Until the final confirmation measured it, repr() names the kept passes but no change against the baseline."""
    trace = _trace()
    trace.final["status"] = "provisional"
    assert "final vs baseline" not in repr(trace) and "application/max_new_tokens" in repr(trace)


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


def test_quiet_third_party_leaves_user_settings(monkeypatch):
    """Third-party load bars and advisories are silenced unless the user chose otherwise."""
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    quiet_third_party()
    import os

    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_report_md_and_html_state_the_wall_time_of_a_finished_run():
    """A finished run's report says how long it took, from the trace's own start and end times; an
    unfinished one says nothing about it."""
    from fractal_opt.pipeline.report_html import render_html

    data = json.loads(_trace().to_json())
    data["run"].update(started_at="2026-12-01T14:49:17+00:00", ended_at="2026-12-01T15:05:18+00:00")
    trace = Trace.from_dict(data)
    assert "Wall time: 16 min 1 s" in trace.to_markdown()
    assert "wall time 16 min 1 s" in render_html(trace)
    data["finished"] = False
    assert "Wall time" not in Trace.from_dict(data).to_markdown()


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


def _progress_on_clock(monkeypatch, readings):
    """A Progress writing to a string, its clock reading ``readings`` in turn (the first is its start)."""
    clock = iter(readings)
    monkeypatch.setattr("fractal_opt.pipeline.progress.time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    return Progress(stream=out), out


def test_the_tuned_recipe_pins_the_thread_count_the_kept_plan_ran_with():
    """A kept plan that leaves threads to its runtime is written with the count its census recorded; a plan that set threads keeps its own."""
    trace = _trace()
    trace.steps[-1].plan = Plan(source="org/not-local").replace_section("hardware", runtime="llama_cpp").to_dict()
    trace.steps[-1].census = {"threads": 2}
    recipe = trace.to_recipe()
    assert recipe.plan().hardware.threads == 2 and trace.ran_threads() == 2
    trace.steps[-1].plan = Plan(source="org/not-local").replace_section("hardware", threads="auto").to_dict()
    assert trace.to_recipe().plan().hardware.threads is None  # auto belongs to a kept step; nothing is added on top of it
    trace.steps[-1].census = {}
    trace.steps[-1].plan = Plan(source="org/not-local").to_dict()
    assert trace.to_recipe().plan().hardware.threads is None  # a runtime that does not say: nothing invented
