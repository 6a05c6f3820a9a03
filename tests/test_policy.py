"""Policy: keep a pass only when its objective improves beyond noise and no guard trips."""

from __future__ import annotations

from fractal_opt.passes import Layer
from fractal_opt.policy import Policy
from fractal_opt.recipe import load_recipe

BEFORE = {"decode_tokens_per_s": 100.0, "ttft_ms": 50.0, "e2e_ms": 1000.0, "throughput_tokens_per_s": 90.0, "peak_memory_mb": 500.0, "kl_mean": 0.0}
BANDS = {"decode_tokens_per_s": 0.05, "ttft_ms": 0.05, "e2e_ms": 0.05, "throughput_tokens_per_s": 0.05, "peak_memory_mb": 0.05}


def _judge(policy: Policy, layer: Layer, changes: dict[str, float], *, kl: float = 0.0, bands: dict[str, float] | None = None):
    """Judge a step whose metrics moved by ``changes`` (relative) and whose kl_mean is ``kl``."""
    after = {m: v * (1 + changes.get(m, 0.0)) for m, v in BEFORE.items() if m != "kl_mean"}
    after["kl_mean"] = kl
    full = {m: changes.get(m, 0.0) for m in BANDS}
    return policy.judge(layer, BEFORE, after, full, bands or BANDS)


def test_kept_when_objective_improves_beyond_band():
    """A hardware pass that raises decode tokens/s by 20% (band 5%) with no guard tripping is kept."""
    verdict = _judge(Policy(), Layer.HARDWARE, {"decode_tokens_per_s": 0.20})
    assert verdict.kept, verdict.reason
    assert "decode_tokens_per_s" in verdict.reason and "no guard tripped" in verdict.reason
    assert verdict.changes["decode_tokens_per_s"] == 0.2


def test_change_within_band_is_no_change():
    """A 2% improvement inside a 5% noise band is rolled back as 'no change beyond noise'."""
    verdict = _judge(Policy(), Layer.HARDWARE, {"decode_tokens_per_s": 0.02})
    assert not verdict.kept
    assert "no change beyond noise" in verdict.reason


def test_objective_getting_worse_is_rolled_back():
    """A pass that lowers its objective beyond the band is rolled back as 'worse'."""
    verdict = _judge(Policy(), Layer.MODEL, {"decode_tokens_per_s": -0.5})
    assert not verdict.kept and verdict.reason.startswith("worse")


def test_wider_band_swallows_the_same_gain():
    """The noise band decides: +8% counts with a 5% band and does not with a 10% band."""
    assert _judge(Policy(), Layer.HARDWARE, {"decode_tokens_per_s": 0.08}).kept
    wide = {**BANDS, "decode_tokens_per_s": 0.10}
    assert not _judge(Policy(), Layer.HARDWARE, {"decode_tokens_per_s": 0.08}, bands=wide).kept


def test_regression_guard_trips():
    """Faster decode with TTFT 50% worse trips the ttft_ms max_regression guard; the reason names it."""
    verdict = _judge(Policy(), Layer.HARDWARE, {"decode_tokens_per_s": 0.30, "ttft_ms": 0.50})
    assert not verdict.kept
    assert "guard ttft_ms max_regression" in verdict.reason and "tripped" in verdict.reason


def test_regression_within_limit_plus_band_is_allowed():
    """A TTFT 12% worse stays under max_regression 10% + band 5% and does not trip."""
    verdict = _judge(Policy(), Layer.HARDWARE, {"decode_tokens_per_s": 0.30, "ttft_ms": 0.12})
    assert verdict.kept, verdict.reason


def test_higher_is_better_metric_regresses_downwards():
    """For a higher-is-better watched metric (throughput), a drop trips the guard and a rise does not."""
    assert not _judge(Policy(), Layer.MODEL, {"decode_tokens_per_s": 0.3, "throughput_tokens_per_s": -0.4}).kept
    assert _judge(Policy(), Layer.MODEL, {"decode_tokens_per_s": 0.3, "throughput_tokens_per_s": 0.4}).kept


def test_kl_mean_guard_trips():
    """A big speed-up with kl_mean 0.2 (default max 0.05) is rolled back, naming kl_mean."""
    verdict = _judge(Policy(), Layer.MODEL, {"decode_tokens_per_s": 1.0}, kl=0.2)
    assert not verdict.kept
    assert "guard kl_mean max 0.05 tripped" in verdict.reason


def test_auto_objective_per_layer():
    """objective auto picks decode tokens/s for hardware and model, throughput for scheduling, e2e for application."""
    policy = Policy()
    assert policy.objective_for(Layer.HARDWARE) == "decode_tokens_per_s"
    assert policy.objective_for(Layer.MODEL) == "decode_tokens_per_s"
    assert policy.objective_for(Layer.SCHEDULING) == "throughput_tokens_per_s"
    assert policy.objective_for(Layer.APPLICATION) == "e2e_ms"


def test_scheduling_judged_on_throughput_not_per_request_speed():
    """A scheduling pass with +50% throughput and -30% per-request decode is kept (batching's trade)."""
    verdict = _judge(Policy(), Layer.SCHEDULING, {"throughput_tokens_per_s": 0.5, "decode_tokens_per_s": -0.3})
    assert verdict.kept, verdict.reason
    assert "throughput_tokens_per_s" in verdict.reason


def test_application_judged_on_e2e_latency():
    """An application pass that cuts e2e latency 40% is kept; one that only raises decode speed is not."""
    assert _judge(Policy(), Layer.APPLICATION, {"e2e_ms": -0.4}).kept
    assert not _judge(Policy(), Layer.APPLICATION, {"decode_tokens_per_s": 0.4}).kept


def test_explicit_objective_overrides_auto():
    """A recipe objective applies to every layer."""
    policy = Policy(objective="peak_memory_mb")
    assert policy.objective_for(Layer.SCHEDULING) == "peak_memory_mb"
    assert _judge(policy, Layer.HARDWARE, {"peak_memory_mb": -0.3}).kept


def test_recipe_guard_overrides_default():
    """A recipe's kl_mean max 0.5 replaces the default 0.05: kl_mean 0.2 is then acceptable."""
    policy = Policy(guards={"kl_mean": {"max": 0.5}})
    assert _judge(policy, Layer.MODEL, {"decode_tokens_per_s": 1.0}, kl=0.2).kept
    assert not _judge(policy, Layer.MODEL, {"decode_tokens_per_s": 1.0}, kl=0.6).kept


def test_null_removes_default_guard():
    """A guard set to null in the recipe removes the default: kl_mean and the ttft regression stop counting."""
    recipe = load_recipe({"model": "tiny", "policy": {"guards": {"kl_mean": None, "ttft_ms": None}}}, check_model=False)
    metrics = {g.metric for g in recipe.policy.guards_for(Layer.HARDWARE)}
    assert "kl_mean" not in metrics and "ttft_ms" not in metrics
    assert _judge(recipe.policy, Layer.HARDWARE, {"decode_tokens_per_s": 0.3, "ttft_ms": 0.5}, kl=3.0).kept


def test_recipe_adds_a_min_guard():
    """A recipe can add a guard on any metric: agreement min 0.9 rolls back a pass at 0.5."""
    policy = Policy(guards={"agreement": {"min": 0.9}})
    after = {**BEFORE, "decode_tokens_per_s": 150.0, "agreement": 0.5}
    verdict = policy.judge(Layer.MODEL, BEFORE, after, {"decode_tokens_per_s": 0.5}, BANDS)
    assert not verdict.kept and "guard agreement min 0.9 tripped" in verdict.reason


def test_unmeasured_objective_is_rolled_back():
    """When the objective could not be measured, the pass is not kept and the reason says so."""
    verdict = Policy().judge(Layer.HARDWARE, BEFORE, BEFORE, {"decode_tokens_per_s": None}, BANDS)
    assert not verdict.kept and "could not be measured" in verdict.reason


def test_weights_that_grow_beyond_max_regression_roll_back_a_faster_hardware_pass():
    """weight_mb (from the census, exact: no band) is watched like peak memory: +21% weights for
    +6% decode is rolled back by default, and kept when the recipe allows the memory."""
    before = {**BEFORE, "weight_mb": 513.0}
    after = {**before, "decode_tokens_per_s": 106.0, "weight_mb": 621.0}
    changes = {**dict.fromkeys(BANDS, 0.0), "decode_tokens_per_s": 0.06, "weight_mb": 621 / 513 - 1}
    verdict = Policy().judge(Layer.HARDWARE, before, after, changes, BANDS)
    assert not verdict.kept and verdict.outcome == "guard" and "weight_mb max_regression 10% tripped: +21.1% (513.0 -> 621.0)" in verdict.reason
    relaxed = Policy(guards={"weight_mb": {"max_regression": 0.25}}).judge(Layer.HARDWARE, before, after, changes, BANDS)
    assert relaxed.kept, relaxed.reason
    shrunk = Policy().judge(Layer.MODEL, before, {**after, "weight_mb": 210.0}, {**changes, "weight_mb": 210 / 513 - 1}, BANDS)
    assert shrunk.kept, shrunk.reason  # smaller weights are never a regression


NOTE_ARGS = ({"decode_tokens_per_s": 100.0}, {"decode_tokens_per_s": 0.2}, {"decode_tokens_per_s": 0.05})


def test_unmeasurable_kl_guard_is_named():
    """A kl_mean left None by a runtime without log-probabilities is named in the verdict, not silently skipped."""
    after = {"decode_tokens_per_s": 120.0, "kl_mean": None, "kl_method": "unavailable: X gives no log-probabilities"}
    v = Policy().judge(Layer.HARDWARE, NOTE_ARGS[0], after, NOTE_ARGS[1], NOTE_ARGS[2])
    assert v.kept and "guard kl_mean not measurable on this runtime (unavailable: X gives no log-probabilities)" in v.reason
    assert "accuracy" not in v.reason  # a guard with no probe configured (no eval set) stays silent


def test_kl_guard_on_a_top_k_bound_says_so():
    """A kl_mean from the top-k lower bound is judged and the verdict says it can only be too lenient."""
    after = {"decode_tokens_per_s": 120.0, "kl_mean": 0.002, "kl_method": "top-k lower bound (k=20, first 256 positions)"}
    v = Policy().judge(Layer.HARDWARE, NOTE_ARGS[0], after, NOTE_ARGS[1], NOTE_ARGS[2])
    assert v.kept and "guard kl_mean judged a lower bound (top-k lower bound (k=20, first 256 positions)): it can only be too lenient" in v.reason
