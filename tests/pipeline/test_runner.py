"""The pipeline's flow on the fake engine: measure, try each pass, keep or roll back, write the results."""

from __future__ import annotations

import json

import pytest
from conftest import small_recipe_dict

from fractal_opt.language.recipe import load_recipe
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.testing import FakeEngine, cpu_machine

# Ceilings handed to the runner, so no test waits for a machine probe (the fake's numbers are far below them).
LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
METRIC_KEYS = ("prefill_ms", "ttft_ms", "decode_tokens_per_s", "peak_memory_mb", "e2e_ms")
STEP_KEYS = ("pass", "layer", "params", "status", "reason", "metrics")



def _run(recipe, out=None, **fake):
    """One run of ``recipe`` on fake engines built with ``FakeEngine.factory(**fake)``."""
    return Pipeline(recipe, out_dir=out, progress=False, machine=cpu_machine(), build=FakeEngine.factory(**fake), refuse=FakeEngine.refuse,
                    limits=LIMITS).run()


@pytest.fixture(scope="module")
def run(fake_model, mixed_suite, tmp_path_factory):
    """One pipeline run: kv_cache off (model layer), then a 2-token cap (application layer).

    The workload holds a short and a long prompt, 16 new tokens each; the fake engine decodes 5x
    slower without a KV cache, as a real one does on long prompts. The recipe removes the default
    ttft_ms guard of the application layer (``ttft_ms: null``): the cap does not change TTFT.
    """
    recipe = small_recipe_dict(
        fake_model,
        suite=str(mixed_suite),
        limit=None,
        max_new_tokens=16,
        policy={"guards": {"ttft_ms": None}},
        passes={"application": [{"max_new_tokens": {"limit": 2}}], "model": [{"kv_cache": {"implementation": "off"}}]},
    )
    out = tmp_path_factory.mktemp("pipeline-out")
    return _run(recipe, out, speed={"model.kv_cache": {"off": 0.2}}), out


def _step(result, name):
    (step,) = [s for s in result.trace.steps if s.pass_name == name]
    return step


def test_steps_run_in_tower_order(run):
    """Passes run bottom up (model before application) although the recipe lists application first."""
    result, _ = run
    assert [s.pass_name for s in result.trace.steps] == ["kv_cache", "max_new_tokens"]


def test_kv_cache_off_is_rolled_back(run):
    """Turning the KV cache off makes decode far slower on long prompts, so it is rolled back with a reason."""
    result, _ = run
    step = _step(result, "kv_cache")
    assert step.status == "rolled_back", step.reason
    # The fake's decode clock readings are exact: 1 ms a token, 5 ms without the cache.
    assert step.reason.startswith("decode_tokens_per_s paired estimate -80.0% [95%: -80.0%, -80.0%], medians 1000.0 -> 200.0"), step.reason
    assert step.changes["decode_tokens_per_s"] == pytest.approx(-0.8)
    assert result.plan.model.kv_cache == "dynamic"


def test_token_cap_is_kept(run):
    """The 2-token cap cuts end-to-end latency per request and is kept (ttft_ms guard removed by the recipe)."""
    result, _ = run
    step = _step(result, "max_new_tokens")
    assert step.status == "kept", step.reason
    # 1 ms prefill + 15 gaps of 1 ms -> 1 ms + 1 gap: the reason quotes the exact readings.
    assert step.reason.startswith("e2e_ms paired estimate -87.5% [95%: -87.5%, -87.5%], medians 16.0 -> 2,") and "no guard tripped" in step.reason, step.reason
    assert step.changes["e2e_ms"] == pytest.approx(-0.875)
    assert step.metrics["new_tokens"] == 2
    assert result.plan.application.max_new_tokens == 2
    assert result.trace.final["kept"] == ["application/max_new_tokens"]


def test_out_dir_holds_the_three_files(run):
    """The output folder holds trace.json, report.md and recipe.yaml."""
    _, out = run
    for name in ("trace.json", "report.md", "recipe.yaml"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name


def test_trace_json_shape(run):
    """trace.json holds baseline, steps with pass/layer/params/status/reason/metrics, final and machine; metrics include timing, memory and quality."""
    _, out = run
    trace = json.loads((out / "trace.json").read_text())
    for key in ("baseline", "steps", "final", "machine"):
        assert trace.get(key), f"trace.json lacks {key!r}"
    assert trace["finished"] is True
    assert trace["machine"]["logical_cores"] >= 1
    for step in [trace["baseline"], *trace["steps"]]:
        for key in STEP_KEYS:
            assert key in step, f"step {step.get('pass')} lacks {key!r}"
        metrics = step["metrics"]
        for key in METRIC_KEYS:
            assert isinstance(metrics.get(key), int | float), f"step {step['pass']}: metric {key} = {metrics.get(key)!r}"
        # A step rolled back on speed records why its probes did not run instead of their numbers; agreement is always there.
        assert isinstance(metrics["quality"].get("kl_mean"), int | float) or metrics.get("quality_skipped")
        assert isinstance(metrics["quality"]["agreement"], int | float)
    assert "kl_mean" not in trace["steps"][0]["metrics"]["quality"]  # kv_cache off: 5x slower, rolled back on speed alone
    assert isinstance(trace["steps"][1]["metrics"]["quality"]["kl_mean"], int | float)  # the kept cap was scored
    assert trace["baseline"]["metrics"]["quality"]["kl_mean"] == pytest.approx(0.0, abs=1e-5)
    assert trace["baseline"]["metrics"]["quality"]["agreement"] == 1.0
    assert trace["steps"][0]["params"]["implementation"] == "off"
    assert trace["steps"][1]["layer"] == "application"
    assert trace["final"]["plan"]["application"]["max_new_tokens"] == 2


def test_report_names_every_step(run):
    """report.md shows a row per step with its status, and the final plan."""
    _, out = run
    report = (out / "report.md").read_text()
    assert "kv_cache(implementation=off" in report and "rolled_back" in report
    assert "max_new_tokens(limit=2" in report and "kept" in report
    assert "Final plan: application/max_new_tokens" in report


def test_written_recipe_rebuilds_the_final_plan(run):
    """recipe.yaml holds only the kept passes, and its plan() has the same sections as the run's final plan."""
    result, out = run
    recipe = load_recipe(out / "recipe.yaml")
    assert [p.name for p in recipe.passes] == ["max_new_tokens"]
    plan = recipe.plan()
    assert plan.source == result.plan.source
    for section in ("hardware", "model", "scheduling", "application"):
        assert getattr(plan, section) == getattr(result.plan, section), section
    assert plan.applied == result.plan.applied
    assert recipe == result.recipe


def test_skipped_and_failed_passes_do_not_stop_the_run(fake_model, tmp_path):
    """A pass check refuses is 'skipped' with its reason; a pass whose build raises is 'failed' and the next pass still runs."""
    recipe = small_recipe_dict(
        fake_model, limit=1, max_new_tokens=4, repeats=1, warmup=0,
        passes={
            "hardware": [{"dtype": {"dtype": "float32"}}, {"dtype": {"dtype": "float16"}}],
            "application": [{"max_new_tokens": {"limit": 2}}],
        },
    )
    result = _run(recipe, tmp_path, fail={"hardware.dtype": {"float16": "simulated out of memory while loading float16 weights"}})
    skipped, failed, last = result.trace.steps
    assert skipped.status == "skipped"
    assert skipped.reason.startswith("check:") and "already runs in float32" in skipped.reason
    assert failed.status == "failed"
    assert "RuntimeError" in failed.reason and "simulated out of memory" in failed.reason
    assert result.plan.hardware.dtype == "float32", "the failed pass leaked into the plan"
    assert last.pass_name == "max_new_tokens" and last.status == "kept", last.reason
    assert last.reason.startswith("e2e_ms paired estimate -50.0% [95%: -50.0%, -50.0%], medians 4 -> 2,") and "no guard tripped" in last.reason, last.reason
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [s["status"] for s in trace["steps"]][:2] == ["skipped", "failed"]


def test_a_pass_that_changes_nothing_is_skipped_without_a_build(fake_model):
    """A pass whose apply leaves the plan as it is is skipped by the runner ("already"), never measured."""
    recipe = small_recipe_dict(fake_model, limit=1, max_new_tokens=4, repeats=1, warmup=0, passes={"model": [{"kv_cache": {"implementation": "dynamic"}}]})
    (step,) = _run(recipe).trace.steps
    assert step.status == "skipped" and "already" in step.reason and not step.metrics


def test_the_runtime_refusal_skips_the_step_with_its_reason(fake_model):
    """After the pass's check, the runtime's refuse(candidate) can skip the step; its reason is the step's."""
    recipe = small_recipe_dict(fake_model, limit=1, max_new_tokens=4, repeats=1, warmup=0, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}]})
    result = Pipeline(recipe, progress=False, machine=cpu_machine(), build=FakeEngine.factory(), limits=LIMITS,
                      refuse=lambda plan: "no bf16 here" if plan.hardware.dtype == "bfloat16" else None).run()
    (step,) = result.trace.steps
    assert step.status == "skipped" and step.reason.endswith("no bf16 here")
    assert result.plan.hardware.dtype == "float32"


def test_start_up_work_is_timed_and_named_in_the_reason(fake_model):
    """What Engine.prepare reports (compile_s) lands in the step's timings and its reason, excluded from the numbers."""
    recipe = small_recipe_dict(fake_model, limit=1, max_new_tokens=4, repeats=1, warmup=0, passes={"hardware": [{"compile": {"mode": "default"}}]})
    (step,) = _run(recipe).trace.steps
    assert step.timings["compile_s"] > 0 and "compiling took" in step.reason
    # The fake compiles to the same speed: exactly no change, so the compile is rolled back.
    assert step.status == "rolled_back" and step.reason.startswith(
        "no change beyond noise: decode_tokens_per_s paired estimate +0.0% [95%: +0.0%, +0.0%], medians 1000.0 -> 1000.0"), step.reason


# Throughput is tokens over the wall clock, which the fake's sleeps only bound from below: on a
# busy shared CPU a wake-up can come late by a few percent. 10 ms a token and a 25% noise band
# keep that jitter inside "no change", while the speed steps below are 50% and more.
RAMP_CLOCK = {"per_token_ms": 10.0, "prefill_ms": 5.0}


def _ramp_recipe(fake_model):
    recipe = small_recipe_dict(
        fake_model, limit=2, max_new_tokens=4, repeats=1, warmup=0, policy={"min_effect": 0.25},
        passes={"scheduling": [{"batching": {"mode": "static", "batch_size": 2}}, {"concurrency": {"mode": "ramp", "levels": [2, 4, 8]}}]},
    )
    # No eval set: these tests judge the ramp on throughput and TTFT, and the packaged set's 45
    # questions at the fake's 10 ms a token would be most of their time.
    recipe["quality"]["eval"] = None
    return recipe


def test_a_ramp_steps_up_while_levels_hold_and_keeps_the_last(fake_model):
    """Each level that raises throughput is kept and the ramp steps up; the plan ends at the highest level."""
    speed = {"scheduling.batching": {"static": 2.0}, "scheduling.max_concurrency": {2: 1.5, 4: 2.5, 8: 4.0}}
    result = _run(_ramp_recipe(fake_model), **RAMP_CLOCK, speed=speed)
    assert [s.status for s in result.trace.steps] == ["kept", "kept", "kept", "kept"], [s.reason for s in result.trace.steps]
    # Throughput is wall-clock (the batcher's wait adds to it), so only its direction is exact:
    # each step is a planted gain of 50% or more, beyond the 25% band, and no guard trips.
    for step in result.trace.steps:
        assert step.reason.startswith("throughput_tokens_per_s paired estimate +") and "no guard tripped" in step.reason, step.reason
        assert step.changes["throughput_tokens_per_s"] > 0.25, step.reason
    assert result.plan.scheduling.max_concurrency == 8


def test_a_ramp_stops_after_a_level_that_did_not_hold(fake_model):
    """A level that makes throughput worse is measured again, fails on the second trip, and the
    search bisects below it (3, worse too) instead of stepping up: the answer is the last level that held."""
    speed = {"scheduling.batching": {"static": 2.0}, "scheduling.max_concurrency": {2: 2.0, 4: 0.5}}
    result = _run(_ramp_recipe(fake_model), **RAMP_CLOCK, speed=speed)
    levels = [(s.params["limit"], s.status) for s in result.trace.steps[1:]]
    assert levels == [(2, "kept"), (4, "rolled_back"), (4, "rolled_back"), (3, "rolled_back"), (3, "rolled_back")], [s.reason for s in result.trace.steps]
    # TTFT comes from the fake's readings: 1.25 ms at level 2, 4x at level 4 (a quarter of the speed), 2x at level 3.
    four, three = result.trace.steps[2], result.trace.steps[4]
    assert "guard ttft_ms_p90 max_regression 50% tripped: paired estimate +300.0% [95%: +300.0%, +300.0%], medians 1.25 -> 5" in four.reason, four.reason
    assert "guard ttft_ms_p90 max_regression 50% tripped: paired estimate +100.0% [95%: +100.0%, +100.0%], medians 1.25 -> 2.5" in three.reason, three.reason
    assert result.plan.scheduling.max_concurrency == 2 and result.trace.searches[0]["value"] == 2


def test_a_ramp_level_with_no_change_holds(fake_model):
    """A level that trips nothing and changes nothing beyond noise holds: kept, and the ramp goes on."""
    speed = {"scheduling.batching": {"static": 2.0}}
    result = _run(_ramp_recipe(fake_model), **RAMP_CLOCK, speed=speed)
    levels = result.trace.steps[1:]
    assert all(s.status == "kept" and s.reason.startswith("holds") for s in levels), "\n".join(s.reason for s in levels)
    assert result.plan.scheduling.max_concurrency == 8
