"""Scheduling passes: what they change in the plan, what check() refuses, and the ramp expansion."""

from __future__ import annotations

import pytest

from fractal_opt.errors import RecipeError
from fractal_opt.layers.application import MaxNewTokens
from fractal_opt.layers.scheduling import Batching, Concurrency, Queue, Streaming
from fractal_opt.pipeline.gate import expand_ramps, skip_reason
from fractal_opt.plan import ApplicationPlan, ModelPlan, Plan, SchedulingPlan
from fractal_opt.serving.server import in_flight_limit
from fractal_opt.testing import check_pass

PLAN = Plan(source="tiny")


@pytest.mark.parametrize("cls", [Batching, Concurrency, Streaming, Queue])
def test_scheduling_pass_keeps_the_contract(cls):
    """Each scheduling pass passes the conformance helper."""
    check_pass(cls)


def test_continuous_batching_sets_the_cb_config_fields():
    """batching(mode=continuous) writes its ContinuousBatchingConfig parameters into the plan."""
    p = Batching(mode="continuous", max_batch_tokens=128, num_blocks=32, page_size=64, scheduler="prefill_first").apply(PLAN)
    s = p.scheduling
    assert (s.batching, s.cb_max_batch_tokens, s.cb_num_blocks, s.cb_page_size, s.cb_scheduler) == ("continuous", 128, 32, 64, "prefill_first")
    assert p.hardware == PLAN.hardware and p.application == PLAN.application


def test_sequential_batching_resets_the_batch_size():
    """batching(mode=sequential) means one request per generate call whatever batch_size says."""
    static = Batching(mode="static", batch_size=4).apply(PLAN)
    assert Batching(mode="sequential", batch_size=4).apply(static).scheduling.batch_size == 1


def test_batching_check_refuses_what_the_engine_cannot_do(machine):
    """Continuous batching needs a dynamic cache and no option it would ignore (repetition penalty, beams); a no-op is refused too."""
    static_cache = Plan(source="tiny", model=ModelPlan(kv_cache="static"))
    assert "dynamic KV cache" in skip_reason(Batching(mode="continuous"), static_cache, machine)
    penalty = Plan(source="tiny", application=ApplicationPlan(repetition_penalty=1.2))
    assert "repetition_penalty" in skip_reason(Batching(mode="continuous"), penalty, machine)
    beams = Plan(source="tiny", application=ApplicationPlan(num_beams=2))
    assert "num_beams" in skip_reason(Batching(mode="continuous"), beams, machine)
    assert skip_reason(Batching(mode="continuous"), PLAN, machine) is None
    assert "already" in skip_reason(Batching(mode="sequential", batch_size=1), PLAN, machine)


def test_batching_rejects_bad_parameters_by_name():
    """Invalid CB parameters fail at construction with the parameter and the value."""
    with pytest.raises(RecipeError, match="'page_size': got 2"):
        Batching(mode="continuous", page_size=2)
    with pytest.raises(RecipeError, match="max_memory_percent"):
        Batching(mode="continuous", max_memory_percent=1.5)
    with pytest.raises(RecipeError, match="Did you mean 'continuous'"):
        Batching.from_params({"mode": "continous"})


def test_concurrency_limits_in_flight_requests_per_mode(machine):
    """concurrency(limit) caps requests in flight; on a static plan it is the batch size."""
    cont = Concurrency(limit=4).apply(Batching(mode="continuous").apply(PLAN))
    assert cont.scheduling.max_concurrency == 4 and in_flight_limit(cont.scheduling) == 4
    static = Concurrency(limit=3).apply(Batching(mode="static", batch_size=8).apply(PLAN))
    assert in_flight_limit(static.scheduling) == 3
    assert "sequential" in Concurrency(limit=4).check(PLAN, machine)


def test_a_ramp_expands_to_rising_levels_and_starts_small():
    """A ramping concurrency pass becomes one fixed pass per level, smallest first, sharing a ramp id."""
    ramp = Concurrency(mode="ramp", levels=(8, 16, 32))
    expanded = expand_ramps([Batching(mode="continuous"), ramp, MaxNewTokens(limit=8)])
    assert [type(p).__name__ for p, _ in expanded] == ["Batching", "Concurrency", "Concurrency", "Concurrency", "MaxNewTokens"]
    assert [p.limit for p, _ in expanded[1:4]] == [8, 16, 32]
    assert len({r for _, r in expanded[1:4]}) == 1 and expanded[0][1] is None
    assert ramp.apply(PLAN).scheduling.max_concurrency == 8
    # Reports and written recipes show what each mode reads; the params rebuild the same pass.
    assert expanded[2][0].describe() == "concurrency(mode=fixed, limit=16)"
    assert ramp.describe() == "concurrency(mode=ramp, levels=[8, 16, 32])"
    assert Concurrency.from_params(expanded[2][0].params()) == expanded[2][0]
    with pytest.raises(RecipeError, match="rising"):
        Concurrency(mode="ramp", levels=(16, 8))


def test_streaming_and_queue_set_their_fields(machine):
    """streaming(enabled) and queue(max_queue, timeout_s) change only their own fields; bad values are refused."""
    off = Streaming(enabled=False).apply(PLAN)
    assert off.scheduling.streaming is False and skip_reason(Streaming(enabled=True), PLAN, machine)
    q = Queue(max_queue=4, timeout_s=2.5).apply(PLAN)
    assert (q.scheduling.max_queue, q.scheduling.timeout_s) == (4, 2.5)
    assert q.scheduling.batching == PLAN.scheduling.batching
    with pytest.raises(RecipeError, match="max_queue"):
        Queue(max_queue=0)
    with pytest.raises(RecipeError, match="timeout_s"):
        Queue(timeout_s=-1)


def test_scheduling_fields_survive_plan_round_trip():
    """A plan with every scheduling field set survives to_dict/from_dict."""
    plan = Plan(source="tiny", scheduling=SchedulingPlan(batching="continuous", max_concurrency=4, streaming=False, max_queue=3, timeout_s=1.0, cb_num_blocks=8))
    assert Plan.from_dict(plan.to_dict()) == plan
