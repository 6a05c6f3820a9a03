"""The eval set's answers are served once per plan they depend on: a token cap at or above the
eval's budget reuses an earlier step's, a quantized model or a tighter cap serves them again."""

from __future__ import annotations

from collections import Counter

import pytest
import yaml
from conftest import small_recipe_dict

from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.pipeline.step_quality import eval_key
from fractal_opt.testing import FakeEngine, cpu_machine
from fractal_opt.tower.plan import Plan

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
EVAL_IDS = ("q0", "q1", "q2")
QUANTIZE = "[1/2] model/quantize(bits=4)"
REUSED = f"[2/2] application/max_new_tokens(limit=8): eval set: reused from {QUANTIZE} (this pass changes nothing the eval depends on)"



@pytest.fixture(scope="module")
def eval_set(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "three.yaml"
    items = [{"id": rid, "prompt": f"question {i}?", "answer": str(i)} for i, rid in enumerate(EVAL_IDS)]
    path.write_text(yaml.safe_dump({"name": "three", "items": items}), encoding="utf-8")
    return path


def _recording(build, served: Counter):
    """``build``, whose engines count the eval items they serve by the passes their plan applied."""
    def recorded_build(plan, **kwargs):
        engine = build(plan, **kwargs)
        serve = engine.serve

        def counted(requests, **kw):
            served.update(engine.plan.applied for r in requests if r.id in EVAL_IDS)
            return serve(requests, **kw)

        engine.serve = counted
        return engine
    return recorded_build


def _run(fake_model, eval_set, limit: int):
    """Quantize (3x faster decode, kept), then a cap of ``limit`` tokens; 16 new tokens a request, an eval budget of 4."""
    recipe = small_recipe_dict(fake_model, max_new_tokens=16,
                               passes={"model": [{"quantize": {"bits": 4}}], "application": [{"max_new_tokens": {"limit": limit}}]})
    recipe["quality"].update(eval=str(eval_set), eval_max_new_tokens=4)
    served: Counter = Counter()
    said: list[str] = []
    build = _recording(FakeEngine.factory(speed={"model.weight_bits": {4: 3.0}}), served)
    result = Pipeline(recipe, progress=said.append, machine=cpu_machine(), build=build, refuse=FakeEngine.refuse, limits=LIMITS).run()
    return result, served, said


def test_a_cap_above_the_eval_budget_reuses_the_eval(fake_model, eval_set):
    """A cap of 8 tokens (the eval asks for 4): kept on e2e, its eval numbers are the quantize
    step's, served by no engine of its own; the quantize step served the eval again."""
    result, served, said = _run(fake_model, eval_set, limit=8)
    quantize, cap = result.trace.steps
    assert (quantize.status, cap.status) == ("kept", "kept"), (quantize.reason, cap.reason)
    assert cap.reason == ("e2e_ms paired estimate -50.0% [95%: -50.0%, -50.0%], medians 5.333 -> 2.667, "
                          "threshold ±5.0% (interval half-width, at least min_effect); no guard tripped")
    assert served == {(): 3, ("quantize",): 3}  # the baseline's and the quantized model's: once each
    q, c = quantize.metrics["quality"], cap.metrics["quality"]
    assert c["eval_reused_from"] == QUANTIZE
    assert "eval_reused_from" not in q
    assert c["eval_items"] == q["eval_items"]
    # Paired against the baseline as if served: the fake answers by prompt, so nothing changed.
    assert (c["eval_lost"], c["eval_gained"], c["eval_changed"], c["eval_worse_p"]) == (0, 0, 0, 1.0)
    assert c["accuracy"] == q["accuracy"] == result.trace.baseline.metrics["quality"]["accuracy"]
    assert REUSED in said
    assert f"{QUANTIZE}: eval set (3 questions)" in said


def test_a_cap_below_the_eval_budget_serves_the_eval_again(fake_model, eval_set):
    """A cap of 2 tokens cuts the eval's 4: its answers change, so the eval is served again."""
    result, served, said = _run(fake_model, eval_set, limit=2)
    _, cap = result.trace.steps
    assert served == {(): 3, ("quantize",): 3, ("quantize", "max_new_tokens"): 3}
    assert "eval_reused_from" not in cap.metrics["quality"]
    assert "[2/2] application/max_new_tokens(limit=2): eval set (3 questions)" in said


def test_the_eval_key_reads_the_cap_as_the_eval_meets_it():
    """No cap, a cap at or above the budget: one key; a cap below it, or another dtype: another; the passes' names are not in it."""
    plan = Plan(source="fake")
    capped = lambda n: plan.replace_section("application", max_new_tokens=n)  # noqa: E731
    assert eval_key(plan, 24) == eval_key(capped(24), 24) == eval_key(capped(32).with_applied("max_new_tokens"), 24)
    assert eval_key(capped(16), 24) != eval_key(plan, 24)
    assert eval_key(plan.replace_section("hardware", dtype="bfloat16"), 24) != eval_key(plan, 24)
