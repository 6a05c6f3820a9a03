"""Speed first: a step's quality probes and eval run only when quality can decide its verdict."""

from __future__ import annotations

import pytest
from conftest import small_recipe_dict

from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.pipeline.step_quality import StepQuality
from fractal_opt.testing import FakeEngine, cpu_machine

# Ceilings handed to the runner, so no test waits for a machine probe (the fake's numbers are far below them).
LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
UNSCORED = "the objective did not improve beyond its threshold: no quality number can keep the step"
SUFFIX = "; quality not scored (it cannot keep a step whose objective did not improve)"



@pytest.fixture
def scored(monkeypatch):
    """The labels StepQuality.score was called with, in order (the runner's quality callable)."""
    labels: list[str] = []
    real = StepQuality.score

    def counting(self, engine, m, label, **kwargs):
        labels.append(label)
        return real(self, engine, m, label, **kwargs)

    monkeypatch.setattr(StepQuality, "score", counting)
    return labels


def _run(recipe, said=None, out=None, **fake):
    return Pipeline(recipe, out_dir=out, progress=said.append if said is not None else False, machine=cpu_machine(),
                    build=FakeEngine.factory(**fake), refuse=FakeEngine.refuse, limits=LIMITS).run()


def test_a_slower_step_is_rolled_back_without_its_quality(fake_model, scored, tmp_path):
    """bfloat16 decoding 5x slower: rolled back on its objective, the reason as the policy words it
    plus why quality was not scored; the quality callable ran for the baseline only; agreement
    kept; the reports (KL column, quality and frontier charts) are written without its KL."""
    said: list[str] = []
    recipe = small_recipe_dict(fake_model, max_new_tokens=16, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}]})
    result = _run(recipe, said, tmp_path, speed={"hardware.dtype": {"bfloat16": 0.2}})
    (step,) = result.trace.steps
    assert step.status == "rolled_back"
    # The fake's decode clock readings are exact: 1 ms a token, 5 ms in bfloat16; the guards' throughput is wall-clock.
    assert step.reason.startswith("decode_tokens_per_s paired estimate -80.0% [95%: -80.0%, -80.0%], medians 1000.0 -> 200.0, "
                                  "threshold ±5.0% (interval half-width, at least min_effect); guard ttft_ms max_regression 10% tripped: "
                                  "paired estimate +400.0% [95%: +400.0%, +400.0%], medians 1 -> 5; guard throughput_tokens_per_s"), step.reason
    assert step.reason.endswith(SUFFIX), step.reason
    assert step.metrics["quality_skipped"] == UNSCORED
    assert scored == ["baseline"]
    quality = step.metrics["quality"]
    assert quality["agreement"] == 1.0  # from the measured outputs: free
    assert "kl_mean" not in quality and "accuracy" not in quality
    assert "quality_s" not in step.timings
    assert f"[1/1] hardware/dtype(dtype=bfloat16): quality not scored ({UNSCORED})" in said
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert f"{SUFFIX} |" in report  # the steps table's reason cell
    assert "quality not scored (it cannot keep a step whose objective" in (tmp_path / "report.html").read_text(encoding="utf-8")


def test_a_step_within_noise_is_rolled_back_without_its_quality(fake_model, scored):
    """A dtype the fake decodes at the same speed: "no change beyond noise", quality not scored."""
    recipe = small_recipe_dict(fake_model, max_new_tokens=16, policy={"min_effect": 0.5}, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}]})
    (step,) = _run(recipe).trace.steps
    assert step.status == "rolled_back"
    assert step.reason.startswith("no change beyond noise: decode_tokens_per_s paired estimate +0.0% [95%: +0.0%, +0.0%], medians 1000.0 -> 1000.0, "
                                  "threshold ±50.0% (interval half-width, at least min_effect)"), step.reason
    assert step.reason.endswith(SUFFIX), step.reason
    assert step.metrics["quality_skipped"] == UNSCORED
    assert scored == ["baseline"]


def test_a_faster_step_is_scored(fake_model, scored):
    """bfloat16 decoding 3x faster: quality is scored (KL in its metrics), and it is kept."""
    recipe = small_recipe_dict(fake_model, max_new_tokens=16, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}]})
    (step,) = _run(recipe, speed={"hardware.dtype": {"bfloat16": 3.0}}).trace.steps
    assert step.status == "kept", step.reason
    assert step.reason == ("decode_tokens_per_s paired estimate +200.0% [95%: +200.0%, +200.0%], medians 1000.0 -> 3000.0, "
                           "threshold ±5.0% (interval half-width, at least min_effect); no guard tripped")
    assert scored == ["baseline", "[1/1] hardware/dtype(dtype=bfloat16)"]
    assert "quality_skipped" not in step.metrics
    assert step.metrics["quality"]["kl_mean"] == pytest.approx(0.0, abs=1e-5)
    assert "quality_s" in step.timings


def test_a_search_level_that_may_hold_is_scored(fake_model, scored):
    """Concurrency levels the fake serves at the same throughput are "no change", which the search
    holds: each is scored (its quality guards could still refuse it) and kept as holding."""
    recipe = small_recipe_dict(fake_model, max_new_tokens=8, repeats=3, max_repeats=6, policy={"min_effect": 0.4},
                               passes={"scheduling": [{"batching": {"mode": "static", "batch_size": 2}},
                                                      {"concurrency": {"mode": "ramp", "start": 1, "max_limit": 2}}]})
    result = _run(recipe, speed={"scheduling.batching": {"static": 5.0}})
    batching, *levels = result.trace.steps
    assert batching.status == "kept", batching.reason
    assert [s.pass_name for s in levels] == ["concurrency", "concurrency"]
    for level in levels:
        assert level.status == "kept", level.reason
        assert level.reason.startswith("holds, no change beyond noise: throughput_tokens_per_s paired estimate"), level.reason
        assert "; no guard tripped (the concurrency search keeps the highest level that holds)" in level.reason, level.reason
        assert "quality_skipped" not in level.metrics
        assert "kl_mean" in level.metrics["quality"]
    assert scored == ["baseline", "[1/2] scheduling/batching(mode=static, batch_size=2)",
                      "[2/2, search step 1] scheduling/concurrency(mode=fixed, limit=1)",
                      "[2/2, search step 2] scheduling/concurrency(mode=fixed, limit=2)"]
