"""Scheduling passes: what they change in the plan, what check() refuses, and the concurrency search."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.language.policy import Guard
from fractal_opt.layers.scheduling import Batching, Concurrency, Queue, Streaming
from fractal_opt.pipeline.gate import PassSteps, skip_reason
from fractal_opt.serving.server import in_flight_limit
from fractal_opt.testing import check_pass
from fractal_opt.tower.passes import StepResult
from fractal_opt.tower.plan import ApplicationPlan, ModelPlan, Plan, SchedulingPlan

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


def test_prefix_cache_is_transformers_block_sharing_and_off_unless_asked():
    """transformers' paged cache shares prefix pages by default; the plan turns that on only with
    the prefix_cache pass, and a sequential plan that asks for it is refused (no paged cache there)."""
    from fractal_opt.layers.scheduling import PrefixCache
    from fractal_opt.runtimes import refuse
    from fractal_opt.runtimes.transformers.continuous import cb_config

    continuous = Batching(mode="continuous").apply(PLAN)
    assert cb_config(continuous.scheduling, in_flight=4, budget=8, seed=0).allow_block_sharing is False
    shared = PrefixCache().apply(continuous)
    assert cb_config(shared.scheduling, in_flight=4, budget=8, seed=0).allow_block_sharing is True
    assert refuse(shared) is None
    assert "continuous batching's paged cache" in (refuse(PrefixCache().apply(PLAN)) or "")


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


SLO = (Guard(metric="ttft_ms_p90", max=4000), Guard(metric="kl_mean", max=0.05))  # a latency SLO, and a quality guard that is not one


def _search(ramp, holds, guards=SLO):
    """Drive ``ramp``'s search as the runner does; ``holds(level, nth)`` says whether the nth
    measurement of a level holds. Returns the measured levels in order and the conclusion."""
    steps, seen = PassSteps(ramp), {}
    for s in steps:
        seen[s.limit] = seen.get(s.limit, 0) + 1
        ok = holds(s.limit, seen[s.limit])
        steps.record(s, "kept" if ok else "rolled_back", "kept" if ok else "guard")
    return [r.step.limit for r in steps.history], steps.conclusion(guards)


def test_the_search_doubles_until_a_level_fails_then_bisects_to_the_knee():
    """From 1 the search doubles while levels hold, re-measures the first that trips, then bisects
    between the last that held (8) and the first that failed (16) down to the knee (12)."""
    order, found = _search(Concurrency(mode="ramp"), lambda level, nth: level <= 12)
    assert order == [1, 2, 4, 8, 16, 16, 12, 14, 14, 13, 13]
    assert found["value"] == 12
    assert found["answer"] == "max concurrency that meets TTFT p90 <= 4 s: 12"
    assert (found["levels_measured"], found["measurements"]) == (8, 11)
    assert "16 failed (tripped twice)" in found["summary"]


def test_one_noisy_trip_does_not_end_the_search():
    """A level whose first measurement trips and whose second holds counts as held: two agreeing
    trips are needed to fail a level."""
    order, found = _search(Concurrency(mode="ramp", start=4, max_limit=32), lambda level, nth: level <= 12 and not (level == 8 and nth == 1))
    assert order[:4] == [4, 8, 8, 16] and found["value"] == 12
    assert "8 held (tripped, then held)" in found["summary"]


def test_the_search_stops_at_its_range_and_coarser_resolution_measures_less():
    """Nothing fails up to max_limit: the answer says it is a lower bound. A resolution of 4
    stops bisecting when the gap is 4 or less."""
    order, found = _search(Concurrency(mode="ramp", start=8, max_limit=48), lambda level, nth: True)
    assert order == [8, 16, 32, 48]
    assert found["answer"].endswith(": 48 or more (the search's max_limit; no level up to it failed)")
    order, found = _search(Concurrency(mode="ramp", start=8, max_limit=64, resolution=4), lambda level, nth: level <= 21)
    assert order == [8, 16, 32, 32, 24, 24, 20] and found["value"] == 20
    _, none = _search(Concurrency(mode="ramp", start=1), lambda level, nth: False, guards=())
    assert none["value"] is None
    assert none["answer"] == "max concurrency that holds (no absolute latency SLO set: the guards in force, throughput not worse): none: 1 already fails"


def test_a_failed_or_refused_level_fails_at_once_and_an_unchanged_one_holds(machine):
    """A crash or a refusal (the KV cache does not fit) is not noise: the level fails without a
    second measurement. A level the plan already has ("changes nothing") holds."""
    ramp = Concurrency(mode="ramp", start=2, max_limit=16)
    one = Concurrency(limit=2)
    assert ramp.next_step(()) == one
    assert ramp.next_step((StepResult(step=one, status="unchanged"),)) == Concurrency(limit=4)
    history = (StepResult(step=one, status="kept"), StepResult(step=Concurrency(limit=4), status="skipped"))
    assert ramp.next_step(history) == Concurrency(limit=3)
    refused = (StepResult(step=one, status="skipped"), StepResult(step=Concurrency(limit=1), status="skipped"))
    assert ramp.next_step(refused) is None
    assert ramp.conclusion(refused)["answer"].endswith(": not found: no level could be measured (the skipped or failed steps say why)")
    steps = PassSteps(ramp)
    first = next(iter(steps))
    served = first.apply(Batching(mode="continuous").apply(PLAN))
    steps.record(first, "skipped", reason=skip_reason(first, served, machine, refuse=lambda plan: None))  # the plan already has 2
    assert steps.history[-1].status == "unchanged"


def test_the_search_params_and_older_recipes_levels():
    """Reports show what each mode reads; older recipes' ``levels`` become the search's range;
    a fixed pass runs once, as itself."""
    ramp = Concurrency(mode="ramp", levels=(8, 16, 32))
    assert ramp == Concurrency(mode="ramp", start=8, max_limit=32)
    assert ramp.describe() == "concurrency(mode=ramp, start=8, max_limit=32)"
    assert ramp.apply(PLAN).scheduling.max_concurrency == 8
    fixed = Concurrency(limit=16)
    assert fixed.describe() == "concurrency(mode=fixed, limit=16)" and Concurrency.from_params(fixed.params()) == fixed
    assert Concurrency(limit=8).describe() == "concurrency(mode=fixed, limit=8)"  # the default limit too: a search lists 4 and 8
    assert fixed.next_step(()) is fixed and fixed.next_step((StepResult(step=fixed, status="kept"),)) is None
    assert not PassSteps(fixed).searches and PassSteps(ramp).searches
    with pytest.raises(RecipeError, match="rising"):
        Concurrency(mode="ramp", levels=(16, 8))
    with pytest.raises(RecipeError, match="max_limit"):
        Concurrency(mode="ramp", start=16, max_limit=8)
    with pytest.raises(RecipeError, match="not both"):
        Concurrency(mode="ramp", levels=(4, 8), start=2)


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


def test_the_search_starts_at_the_requests_the_kept_plan_serves_at_once(machine):
    """Under a closed load of 8 clients that continuous batching already serves at once, a search
    from 4 starts at 8 (a lower level only offers less work and would measure "worse" without an
    SLO failing), then doubles; without a load, or below the kept plan's own limit, start stands."""
    from fractal_opt.tower.passes import SearchContext
    from fractal_opt.workloads.workload import Workload

    served = Batching(mode="continuous").apply(PLAN)
    load = Workload(load={"mode": "closed", "concurrency": 8, "requests": 16})
    ramp = Concurrency(mode="ramp", start=4, max_limit=16)
    context = SearchContext(plan=served, machine=machine, workload=load)
    assert ramp.next_step((), context=context) == Concurrency(limit=8)
    assert ramp.next_step((StepResult(step=Concurrency(limit=8), status="kept"),), context=context) == Concurrency(limit=16)
    assert ramp.next_step((), context=SearchContext(plan=served, machine=machine, workload=Workload())) == Concurrency(limit=4)
    two = Concurrency(limit=2).apply(served)
    assert ramp.next_step((), context=SearchContext(plan=two, machine=machine, workload=load)) == Concurrency(limit=4)


def test_batching_runs_on_a_runtimes_own_quantized_kv_cache(machine):
    """llama.cpp's q8_0 cache (kv_cache quantized, backend native) is the cache its continuous
    batching runs on: the step is not skipped; a transformers quantized cache still is."""
    native = ModelPlan(kv_cache="quantized", kv_bits=8, kv_backend="native")
    assert Batching(mode="continuous").check(Plan(source="tiny", model=native), machine) is None
    quanto = ModelPlan(kv_cache="quantized", kv_bits=8, kv_backend="quanto")
    assert "dynamic KV cache" in Batching(mode="continuous").check(Plan(source="tiny", model=quanto), machine)
