"""The search pass on the fake engine: candidates generated, screened, then judged; the screen keeps a winner it should keep."""

from __future__ import annotations

import pytest
from conftest import small_recipe_dict

from fractal_opt.core.errors import RecipeError
from fractal_opt.language.recipe import load_recipe
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.search.search_pass import HardwareSearch, ModelSearch, search_for
from fractal_opt.testing import FakeEngine, cpu_machine
from fractal_opt.tower.passes import Layer

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
BF16_MACHINE = {"cpu_flags": frozenset({"avx512f", "avx512_bf16"})}
# The machine's round-to-round noise: the float32 plan's serve calls alternate 4% apart, so one
# round's paired change strays about 4% either way (the A/A calibration measures it).
NOISY = {"hardware.dtype": {"float32": (1.0, 1.04) * 20}}


def _run(recipe, **fake):
    return Pipeline(recipe, progress=False, machine=cpu_machine(**BF16_MACHINE), build=FakeEngine.factory(**fake), refuse=FakeEngine.refuse,
                    limits=LIMITS).run()


def _recipe(fake_model, search, **workload):
    wl = {"repeats": 4, "max_repeats": 8, **workload}
    recipe = small_recipe_dict(fake_model, passes={"hardware": [{"search": search}]}, policy={"guards": {"ttft_ms": None}}, **wl)
    recipe["quality"].pop("eval")  # the default eval: its serve calls are part of the rounds' planted speeds below
    return recipe


def test_a_candidate_slower_in_its_first_round_but_faster_over_full_rounds_is_kept(fake_model):
    """bfloat16 is about 4% slower than the kept plan in the screen's round and 50% faster in every round
    after it: within the screen's interval (the calibration's round-to-round noise), so it gets the
    full rounds and is kept; no candidate is dropped by an unlucky first round."""
    speeds = {**NOISY["hardware.dtype"], "bfloat16": (1.0, 1.0, 1.5)}
    result = _run(_recipe(fake_model, {"only": ["dtype"]}), round_speed={"hardware.dtype": speeds})
    (step,) = result.trace.steps
    assert step.params == {"dtype": "bfloat16"}
    assert step.metrics["comparison"]["screen"]["change"] < 0 < step.metrics["comparison"]["screen"]["interval"][1] - 0.05
    assert step.status == "kept", step.reason
    assert result.plan.hardware.dtype == "bfloat16"


def test_a_candidate_far_behind_is_screened_out_with_its_screen_numbers(fake_model):
    """A candidate at half the kept plan's speed stops after one paired round: status screened_out,
    its screen numbers in the trace, no quality scored, and the search's answer counts it."""
    result = _run(_recipe(fake_model, {"only": ["dtype"]}), speed={"hardware.dtype": {"bfloat16": 0.5}}, round_speed=NOISY)
    (step,) = result.trace.steps
    assert step.status == "screened_out"
    screen = step.metrics["screen"]
    assert screen["rounds"] == 1 and screen["change"] < -0.3 and screen["interval"][1] < 0.05 and not screen["passed"]
    assert step.reason.startswith("screened out: decode_tokens_per_s")
    assert "kl_mean" not in step.metrics.get("quality", {})
    assert result.plan.hardware.dtype == "float32"
    (found,) = result.trace.searches
    assert found["screened_out"] == 1 and found["considered"] == 1
    assert found["answer"].startswith("1 candidates considered (1 screened out, 0 judged in full, 0 kept)")


def test_without_screening_every_candidate_gets_the_full_rounds(fake_model):
    """screen: false judges the same slow candidate in full: rolled back, never screened_out."""
    result = _run(_recipe(fake_model, {"only": ["dtype"], "screen": False}), speed={"hardware.dtype": {"bfloat16": 0.5}})
    (step,) = result.trace.steps
    assert step.status == "rolled_back" and "screen" not in step.metrics["comparison"]


def test_a_kept_candidate_changes_what_is_generated_next(fake_model):
    """One change at a time: after bfloat16 is kept, the next candidates are generated for the new
    plan (threads), and each candidate is tried once."""
    result = _run(_recipe(fake_model, {"only": ["dtype", "threads"]}), speed={"hardware.dtype": {"bfloat16": 2.0}})
    tried = [s.params for s in result.trace.steps]
    assert tried[0] == {"dtype": "bfloat16"} and result.trace.steps[0].status == "kept"
    assert {"count": "auto"} in tried and len(tried) == len({str(t) for t in tried})


def test_the_budget_stops_the_search_and_says_what_it_did_not_try(fake_model):
    """With a budget shorter than the baseline, nothing is tried: the steps are skipped with the
    budget's reason, and the final plan is the baseline."""
    result = _run(_recipe(fake_model, {"only": ["dtype", "threads"]}, budget_s=0.01), speed={"hardware.dtype": {"bfloat16": 2.0}})
    (step,) = result.trace.steps
    assert step.status == "skipped" and "time budget" in step.reason
    assert result.plan.hardware.dtype == "float32"


def test_a_recipe_says_search_under_a_layer_and_bad_parameters_are_refused(fake_model):
    """``search`` is one class a layer; ``only`` names that layer's passes (the closest name is
    suggested), and the application layer has no generated candidates."""
    recipe = load_recipe(small_recipe_dict(fake_model, passes={"hardware": ["search"], "model": [{"search": {"only": ["quantize"]}}]}))
    assert [type(p) for p in recipe.passes] == [HardwareSearch, ModelSearch]
    assert load_recipe(recipe.to_dict()).passes == recipe.passes
    with pytest.raises(RecipeError, match="'quantise' is not a pass of this layer.*quantize"):
        ModelSearch(only=("quantise",))
    with pytest.raises(RecipeError, match="not 'application'"):
        search_for(Layer.APPLICATION)


def test_weights_a_quality_guard_refused_are_not_judged_again_in_another_build():
    """After llama.cpp on the GGUF's own weights tripped the eval, the build for this CPU on the
    same weights is left out with why; on BF16 weights it is still tried."""
    from fractal_opt.runtimes import RUNTIMES
    from fractal_opt.search.search_pass import HardwareSearch
    from fractal_opt.tower.passes import SearchContext, StepResult
    from fractal_opt.tower.plan import Plan

    from fractal_opt.layers.hardware import Runtime

    base = Plan(source="smollm2-135m-instruct")
    wheel = Runtime(backend="llama_cpp")
    refused = StepResult(step=wheel, status="rolled_back", outcome="guard", quality_tripped=("accuracy",), plan=wheel.apply(base).to_dict())
    context = SearchContext(plan=base, machine=cpu_machine(**BF16_MACHINE, packages={**cpu_machine().packages, "xllamacpp": "0.2"}), runtimes=RUNTIMES)
    open_, left = HardwareSearch().candidates(context, (refused,))
    why = {c.p.describe(): w for c, w in left}
    assert "accuracy" in why["runtime(backend=llama_cpp, path=native)"]
    assert "runtime(backend=llama_cpp, path=native, dtype=bfloat16)" in [c.p.describe() for c in open_]


def test_the_weight_ladder_is_walked_down_until_a_quality_guard_refuses():
    """On llama.cpp with BF16 weights the ladder's highest rung below the source (Q4_K_M) comes
    first; once its answers trip the eval, the rungs with fewer bits a weight are left out, with why."""
    from fractal_opt.runtimes import RUNTIMES
    from fractal_opt.tower.passes import SearchContext, StepResult
    from fractal_opt.tower.plan import Plan

    plan = Plan(source="smollm2-135m-instruct").replace_section("hardware", runtime="llama_cpp", dtype="bfloat16")
    context = SearchContext(plan=plan, machine=cpu_machine(**BF16_MACHINE), runtimes=RUNTIMES)
    open_, left = ModelSearch(only=("quantize",)).candidates(context)
    assert [c.p.method for c in open_] == ["q4_k_m"]
    assert all("one rung at a time" in why for _, why in left)
    tripped = StepResult(step=open_[0].p, status="rolled_back", outcome="guard", quality_tripped=("accuracy",), plan=open_[0].p.apply(plan).to_dict())
    open_, left = ModelSearch(only=("quantize",)).candidates(context, (tripped,))
    assert open_ == [] and {c.p.method for c, _ in left} == {"q4_0", "iq4_xs"}
    assert all("whose answers tripped accuracy: fewer bits are not tried" in why for _, why in left)


def test_the_16_bit_copies_come_before_the_ggufs_own_4_bit_kernels_and_a_refusal_reaches_the_next_layer():
    """From float32 transformers on the embedded Q4_1 GGUF, the first rung is 16 bits (llama.cpp
    on a BF16 copy, bfloat16 on transformers), the GGUF's own 5 bits after it; once llama.cpp on
    Q4_1 tripped the eval anywhere in the run, the model layer's rungs below it are not tried."""
    from fractal_opt.runtimes import RUNTIMES
    from fractal_opt.tower.passes import SearchContext
    from fractal_opt.tower.plan import Plan

    machine = cpu_machine(**BF16_MACHINE, packages={**cpu_machine().packages, "xllamacpp": "0.2"})
    base = Plan(source="smollm2-135m-instruct")
    open_, left = HardwareSearch().candidates(SearchContext(plan=base, machine=machine, runtimes=RUNTIMES))
    # The build for this CPU first (no skip rule here, so it counts as built), the wheel's after it.
    assert {c.bits for c in open_ if c.rung} == {16.0} and open_[0].p.describe() == "runtime(backend=llama_cpp, path=native, dtype=bfloat16)"
    assert "runtime(backend=llama_cpp, dtype=bfloat16)" in [c.p.describe() for c in open_]
    assert "after runtime(backend=llama_cpp, path=native, dtype=bfloat16)" in dict((c.p.describe(), w) for c, w in left)["runtime(backend=llama_cpp)"]
    bf16 = base.replace_section("hardware", runtime="llama_cpp", dtype="bfloat16")
    q41 = bf16.replace_section("hardware", dtype="float32").to_dict()
    context = SearchContext(plan=bf16, machine=machine, runtimes=RUNTIMES, refused=(("dtype(dtype=float32)", q41, ("accuracy",)),))
    open_, left = ModelSearch(only=("quantize",)).candidates(context)
    assert open_ == [] and all("below dtype(dtype=float32)" in why for _, why in left)


def test_a_faster_candidate_whose_answers_change_is_stopped_by_the_quality_gate_after_its_screen(fake_model):
    """bfloat16 decodes twice as fast but its log-probabilities drift past the KL guard: the
    quality gate runs right after the passing screen, a quality guard trips, and the step is
    rolled back on that one round (no full rounds, no round alone for memory)."""
    recipe = _recipe(fake_model, {"only": ["dtype"]})
    recipe["policy"]["guards"]["kl_mean"] = {"max": 0.01}
    result = _run(recipe, speed={"hardware.dtype": {"bfloat16": 2.0}}, drift={"hardware.dtype": {"bfloat16": 5.0}})
    (step,) = result.trace.steps
    assert step.status == "rolled_back" and "kl_mean" in step.metrics["tripped"]["quality"], step.reason
    assert step.metrics["comparison"]["rounds"] == 1 and step.metrics["comparison"]["screen"]["passed"]
    assert "no round alone" in step.metrics["comparison"]["memory"]
    assert "the quality gate ran after the screen" in step.reason and step.timings["quality_s"] >= 0
    assert result.plan.hardware.dtype == "float32"


def test_a_faster_candidate_that_keeps_the_answers_gets_its_full_rounds_and_its_quality_numbers(fake_model):
    """The same candidate without the drift passes the quality gate after its screen, is measured
    over the full rounds and kept, with the quality numbers scored after the screen."""
    recipe = _recipe(fake_model, {"only": ["dtype"]})
    recipe["policy"]["guards"]["kl_mean"] = {"max": 0.01}
    result = _run(recipe, speed={"hardware.dtype": {"bfloat16": 2.0}})
    (step,) = result.trace.steps
    assert step.status == "kept", step.reason
    assert step.metrics["comparison"]["rounds"] >= 4 and step.metrics["quality"]["kl_mean"] is not None
    assert "the quality gate ran after the screen" not in step.reason


def test_a_search_with_nothing_to_try_still_answers_why(fake_model):
    """On a machine without bf16 units the dtype search has no candidate: no step is run, and the
    trace still holds the search's answer (0 considered), not a missing record."""
    recipe = _recipe(fake_model, {"only": ["dtype"]})
    result = Pipeline(recipe, progress=False, machine=cpu_machine(cpu_flags=frozenset({"avx2"})), build=FakeEngine.factory(),
                      refuse=FakeEngine.refuse, limits=LIMITS).run()
    assert result.trace.steps == []
    (found,) = result.trace.searches
    assert found["considered"] == 0 and found["answer"].startswith("0 candidates considered")


def test_a_refusal_of_the_kept_plans_own_numbers_rules_out_no_candidate():
    """Slots for 4 clients on the kept continuous plan tripped agreement (batched answers): the same
    weights as the kept plan, so the next slot count is still tried; a refusal of other weights
    (Q4_1's) still rules out a build computing those."""
    from fractal_opt.runtimes import RUNTIMES
    from fractal_opt.search.search_pass import SchedulingSearch
    from fractal_opt.tower.passes import SearchContext
    from fractal_opt.tower.plan import Plan
    from fractal_opt.workloads.workload import Workload

    machine = cpu_machine(**BF16_MACHINE, packages={**cpu_machine().packages, "xllamacpp": "0.2"})
    kept = Plan(source="smollm2-135m-instruct").replace_section("hardware", runtime="llama_cpp", dtype="bfloat16")
    kept = kept.replace_section("scheduling", batching="continuous")
    four = kept.replace_section("scheduling", max_concurrency=4).to_dict()
    workload = Workload(load={"mode": "closed", "concurrency": 4, "requests": 4})
    context = SearchContext(plan=kept, machine=machine, runtimes=RUNTIMES, workload=workload,
                            refused=(("concurrency(mode=fixed, limit=4)", four, ("agreement",)),))
    open_, left = SchedulingSearch(only=("concurrency",)).candidates(context)
    assert any(getattr(c.p, "limit", None) == 8 for c in open_), [(c.p.describe(), w) for c, w in left]
