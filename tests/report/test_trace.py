"""The trace on its own, a plain record: trace.json is strict and versioned, labels show what differs, reprs are short, the tuned recipe is its kept passes."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from fractal_opt.layers.scheduling import Batching
from fractal_opt.pipeline.runner import Result
from fractal_opt.report.markdown import report_md
from fractal_opt.report.trace import SCHEMA_VERSION, Step, Trace, TraceSchemaError
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


def test_labels_show_only_non_default_parameters():
    """A pass label names the parameters that differ from the pass's defaults (and its first one), not every field."""
    trace = _trace()
    label = trace.steps[0].label()
    assert label == "batching(mode=continuous, batch_size=6)"
    assert "page_size" not in report_md(trace)
    assert trace.steps[1].label() == "max_new_tokens(limit=24)"


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


def test_reading_and_writing_a_trace_keeps_its_run_record():
    """Reading a trace and writing it again keeps its versions, start and end times as recorded (rendering stamps nothing)."""
    first = json.loads(_trace().to_json())
    first["run"]["ended_at"] = "2020-01-01T00:00:00+00:00"
    again = json.loads(Trace.from_dict(first).to_json())
    assert again["run"] == first["run"]


def test_reading_other_schemas_says_what_to_do():
    """A newer trace.json is refused with the versions and the fix; an older one reads with a warning; a non-trace is named."""
    data = json.loads(_trace().to_json())
    assert data["schema_version"] == SCHEMA_VERSION
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
