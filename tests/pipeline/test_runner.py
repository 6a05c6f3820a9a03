"""The pipeline end to end on the tiny model: measure, try each pass, keep or roll back, write the results."""

from __future__ import annotations

import json

import pytest

from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.recipe import load_recipe
from fractal_opt.runtimes.transformers.engine import TransformersEngine

METRIC_KEYS = ("prefill_ms", "ttft_ms", "decode_tokens_per_s", "peak_memory_mb", "e2e_ms")
STEP_KEYS = ("pass", "layer", "params", "status", "reason", "metrics")


@pytest.fixture(scope="module")
def run(tiny_dir, mixed_suite, small_recipe, tmp_path_factory):
    """One pipeline run: kv_cache off (model layer), then a 2-token cap (application layer).

    The workload holds a short and a ~1000-token prompt from the default suite, 16 new tokens each:
    without a KV cache every decode step recomputes the whole prompt, so decode is many times slower.
    The recipe removes the default ttft_ms guard of the application layer (``ttft_ms: null``): the
    cap does not change TTFT, and on a shared machine TTFT noise alone could otherwise trip it.
    """
    recipe = small_recipe(
        tiny_dir,
        suite=str(mixed_suite),
        limit=None,
        max_new_tokens=16,
        policy={"guards": {"ttft_ms": None}},
        passes={"application": [{"max_new_tokens": {"limit": 2}}], "model": [{"kv_cache": {"implementation": "off"}}]},
    )
    out = tmp_path_factory.mktemp("pipeline-out")
    result = Pipeline(recipe, out_dir=out, progress=False).run()
    return result, out


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
    assert "decode_tokens_per_s" in step.reason
    assert step.changes["decode_tokens_per_s"] < -0.3
    assert result.plan.model.kv_cache == "dynamic"


def test_token_cap_is_kept(run):
    """The 2-token cap cuts end-to-end latency per request and is kept (ttft_ms guard removed by the recipe)."""
    result, _ = run
    step = _step(result, "max_new_tokens")
    assert step.status == "kept", step.reason
    assert step.changes["e2e_ms"] < 0
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
        assert isinstance(metrics["quality"]["kl_mean"], int | float)
        assert isinstance(metrics["quality"]["agreement"], int | float)
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


def test_skipped_and_failed_passes_do_not_stop_the_run(tiny_dir, small_recipe, tmp_path, monkeypatch):
    """A pass check refuses is 'skipped' with its reason; a pass whose build raises is 'failed' and the next pass still runs."""
    original = TransformersEngine.build.__func__

    def build(cls, plan, **kwargs):
        if plan.hardware.dtype == "float16":
            raise RuntimeError("simulated out of memory while loading float16 weights")
        return original(cls, plan, **kwargs)

    monkeypatch.setattr(TransformersEngine, "build", classmethod(build))
    recipe = small_recipe(
        tiny_dir, limit=1, max_new_tokens=4, repeats=1, warmup=0,
        passes={
            "hardware": [{"dtype": {"dtype": "float32"}}, {"dtype": {"dtype": "float16"}}],
            "application": [{"max_new_tokens": {"limit": 2}}],
        },
    )
    result = Pipeline(recipe, out_dir=tmp_path, progress=False).run()
    skipped, failed, last = result.trace.steps
    assert skipped.status == "skipped"
    assert skipped.reason.startswith("check:") and "already runs in float32" in skipped.reason
    assert failed.status == "failed"
    assert "RuntimeError" in failed.reason and "simulated out of memory" in failed.reason
    assert result.plan.hardware.dtype == "float32", "the failed pass leaked into the plan"
    assert last.pass_name == "max_new_tokens" and last.status in ("kept", "rolled_back")
    assert last.metrics, "the pass after a failure was not measured"
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [s["status"] for s in trace["steps"]][:2] == ["skipped", "failed"]
