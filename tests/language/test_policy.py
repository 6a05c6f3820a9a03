"""Policy: keep a pass only when its objective improves beyond noise and no guard trips."""

from __future__ import annotations

import json
import math
import re

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.language.policy import Policy
from fractal_opt.language.recipe import load_recipe
from fractal_opt.tower.passes import Layer

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


def test_unmeasurable_kl_guard_trips_as_unknown():
    """A kl_mean left None by a runtime without log-probabilities is unknown, and an unknown guard rolls the step back."""
    after = {"decode_tokens_per_s": 120.0, "kl_mean": None, "kl_method": "unavailable: X gives no log-probabilities"}
    v = Policy().judge(Layer.HARDWARE, NOTE_ARGS[0], after, NOTE_ARGS[1], NOTE_ARGS[2])
    assert not v.kept and "guard kl_mean unknown: not measurable on this runtime (unavailable: X gives no log-probabilities)" in v.reason
    assert "accuracy" not in v.reason  # a guard with no probe configured (no eval set) stays silent


def test_kl_guard_on_a_top_k_bound_is_unknown_and_trips():
    """A kl_mean from the top-k lower bound is not judged as if exact: the step is rolled back, saying why."""
    after = {"decode_tokens_per_s": 120.0, "kl_mean": 0.002, "kl_method": "top-k lower bound (k=20, first 256 positions)"}
    v = Policy().judge(Layer.HARDWARE, NOTE_ARGS[0], after, NOTE_ARGS[1], NOTE_ARGS[2])
    assert not v.kept and v.outcome == "guard"
    assert "guard kl_mean unknown: only a lower bound (top-k lower bound (k=20, first 256 positions))" in v.reason
    assert "too lenient" not in v.reason


def test_accept_unknown_keeps_the_step_and_says_so():
    """accept_unknown: true under a guard keeps a step whose number is only a bound, with the default limit kept and a note."""
    policy = Policy(guards={"kl_mean": {"accept_unknown": True}})
    assert [g for g in policy.guards_for(Layer.HARDWARE) if g.metric == "kl_mean"][0].max == 0.05
    after = {"decode_tokens_per_s": 120.0, "kl_mean": 0.002, "kl_method": "top-k lower bound (k=20, first 256 positions)"}
    v = policy.judge(Layer.HARDWARE, NOTE_ARGS[0], after, NOTE_ARGS[1], NOTE_ARGS[2])
    assert v.kept and "guard kl_mean unknown (only a lower bound" in v.reason and "accepted (accept_unknown)" in v.reason


def test_accept_unknown_must_be_a_boolean():
    """accept_unknown: 'yes' is refused naming the field and what is allowed."""
    with pytest.raises(RecipeError, match=r"policy.guards.kl_mean.accept_unknown: got 'yes', expected true or false"):
        Policy(guards={"kl_mean": {"accept_unknown": "yes"}})


# ---------------------------------------------------------------------------- coherent reasons

PAIRED = re.compile(r"paired estimate ([+-]\d+\.\d)% \[95%: ([+-]\d+\.\d)%, ([+-]\d+\.\d)%\], medians (\S+) -> (\S+?)(?=[,;]|$)")
CENSUS = re.compile(r"([+-]\d+\.\d)% \((\d+\.?\d*) -> (\d+\.?\d*)\)")
LABELLED = re.compile(r"threshold ±\d+\.\d% \(interval half-width, at least min_effect\)|max_regression \d+%")

# Medians that do not agree with the paired estimates, as on a noisy machine (a reason once read "-29.3% (13.1 -> 13.7)").
MEDIANS_BEFORE = {"decode_tokens_per_s": 13.1, "ttft_ms": 455.0, "e2e_ms": 2300.0, "throughput_tokens_per_s": 14.2, "peak_memory_mb": 900.0,
                  "ttft_ms_p90": 900.0, "itl_ms_p90": 64.0, "weight_mb": 513.0, "kl_mean": 0.0}
MEDIANS_AFTER = {"decode_tokens_per_s": 13.7, "ttft_ms": 420.0, "e2e_ms": 2500.0, "throughput_tokens_per_s": 29.1, "peak_memory_mb": 1300.0,
                 "ttft_ms_p90": 2700.0, "itl_ms_p90": 456.0, "weight_mb": 621.0, "kl_mean": 0.0}
SCENARIOS = {  # name: (layer, paired changes); weight_mb's change is the census ratio, as the runner computes it
    "worse, with a gain on the side": (Layer.HARDWARE, {"decode_tokens_per_s": -0.293, "ttft_ms": -0.20}),
    "no change": (Layer.HARDWARE, {"decode_tokens_per_s": 0.02}),
    "kept at a cost": (Layer.MODEL, {"decode_tokens_per_s": 0.40, "ttft_ms": 0.08, "throughput_tokens_per_s": -0.07}),
    "regression guard": (Layer.HARDWARE, {"decode_tokens_per_s": 0.30, "ttft_ms": 0.55}),
    "census guard": (Layer.HARDWARE, {"decode_tokens_per_s": 0.06, "weight_mb": 621 / 513 - 1}),
    "scheduling latency guard": (Layer.SCHEDULING, {"throughput_tokens_per_s": 0.36, "ttft_ms_p90": 14.65, "itl_ms_p90": 0.4}),
    "scheduling kept": (Layer.SCHEDULING, {"throughput_tokens_per_s": 1.05, "ttft_ms_p90": -0.8, "itl_ms_p90": 1.2}),
}


def _interval(change: float) -> list[float]:
    return [round(change - 0.04, 4), round(change + 0.05, 4)]


def _close(printed: float, exact: float, *numbers: str) -> bool:
    """The printed percentage equals the exact one, up to the rounding of the printed figures."""
    slack = 0.05 + 100 * sum(0.05 / float(n) for n in numbers)  # one digit of each number, in percentage points
    return abs(printed - exact) <= slack


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_percentage_in_a_reason_is_the_ratio_of_its_numbers_or_says_what_it_is(name):
    """Parse each reason: a paired estimate is named as one, with its interval, and the medians next
    to it are labelled medians; a bare "x% (a -> b)" is exactly b / a - 1; no other percentage but a
    band or a limit appears."""
    layer, changes = SCENARIOS[name]
    changes = {**dict.fromkeys(BANDS, 0.0), **changes}
    intervals = {m: _interval(c) for m, c in changes.items() if m != "weight_mb"}
    bands = {**BANDS, "ttft_ms_p90": 0.1, "itl_ms_p90": 0.1}
    verdict = Policy().judge(layer, MEDIANS_BEFORE, MEDIANS_AFTER, changes, bands, intervals=intervals)
    reason = verdict.reason
    quoted = 0
    for match in PAIRED.finditer(reason):
        estimate, low, high, b, a = match.groups()
        metric = next(w for w in reversed(reason[: match.start()].replace(";", " ").split()) if w in changes)  # the metric it belongs to
        assert float(estimate) == pytest.approx(100 * changes[metric], abs=0.051), (metric, reason)
        assert float(low) == pytest.approx(100 * intervals[metric][0], abs=0.051) and float(high) == pytest.approx(100 * intervals[metric][1], abs=0.051)
        assert float(b) == pytest.approx(MEDIANS_BEFORE[metric], rel=1e-3) and float(a) == pytest.approx(MEDIANS_AFTER[metric], rel=1e-3)
        quoted += 1
    rest = PAIRED.sub("", reason)
    for match in CENSUS.finditer(rest):
        pct, b, a = match.groups()
        assert _close(float(pct), 100 * (float(a) / float(b) - 1), b, a), (match.group(0), reason)
        quoted += 1
    rest = LABELLED.sub("", CENSUS.sub("", rest))
    assert quoted >= 1, reason
    assert "%" not in rest and "->" not in rest, f"an unlabelled number in: {reason}"


def test_the_issue_example_reads_as_a_paired_estimate_with_its_medians():
    """-29.3% beside medians 13.1 -> 13.7 (+4.6%) is spelled as what it is."""
    changes = {**dict.fromkeys(BANDS, 0.0), "decode_tokens_per_s": -0.293}
    verdict = Policy().judge(Layer.HARDWARE, MEDIANS_BEFORE, MEDIANS_AFTER, changes, BANDS, intervals={"decode_tokens_per_s": [-0.70, 0.12]})
    assert "decode_tokens_per_s paired estimate -29.3% [95%: -70.0%, +12.0%], medians 13.1 -> 13.7, threshold ±5.0%" in verdict.reason


# ---------------------------------------------------------------------------- numbers that are not finite

@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_kl_that_is_not_finite_trips_its_guard(bad):
    """A float16 step with KL NaN is rolled back by kl_mean's guard, and the reason says "not finite"."""
    verdict = _judge(Policy(), Layer.MODEL, {"decode_tokens_per_s": 1.0}, kl=bad)
    assert not verdict.kept and verdict.outcome == "guard"
    assert "guard kl_mean max 0.05 tripped: kl_mean is not finite" in verdict.reason


def test_a_probe_returning_nan_trips_a_min_guard():
    """A custom probe's NaN with a ``min`` guard was kept before (NaN < 0.5 is False); now it trips."""
    policy = Policy(guards={"probe.score": {"min": 0.5}})
    after = {**BEFORE, "decode_tokens_per_s": 150.0, "probe.score": math.nan}
    verdict = policy.judge(Layer.MODEL, BEFORE, after, {"decode_tokens_per_s": 0.5}, BANDS)
    assert not verdict.kept and "guard probe.score min 0.5 tripped: probe.score is not finite (nan)" in verdict.reason


def test_a_regression_guard_trips_on_a_change_that_is_not_finite():
    """A finite median with a NaN paired change (no valid pair) trips the max_regression guard."""
    changes = {**dict.fromkeys(BANDS, 0.0), "decode_tokens_per_s": 0.3, "ttft_ms": math.nan}
    verdict = Policy().judge(Layer.HARDWARE, BEFORE, {**BEFORE, "decode_tokens_per_s": 130.0}, changes, BANDS)
    assert not verdict.kept and "guard ttft_ms max_regression 10% tripped: its change is not finite (nan)" in verdict.reason


def test_a_max_drop_guard_trips_when_the_baseline_number_is_not_finite():
    policy = Policy(guards={"accuracy": {"max_drop": 0.1}})
    after = {**BEFORE, "decode_tokens_per_s": 150.0, "accuracy": 0.9}
    verdict = policy.judge(Layer.MODEL, BEFORE, after, {"decode_tokens_per_s": 0.5}, BANDS, baseline={"accuracy": math.nan})
    assert not verdict.kept and "the baseline's accuracy is not finite" in verdict.reason


@pytest.mark.parametrize("where", ["change", "value"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_an_objective_that_is_not_finite_is_never_kept(where, bad):
    """A NaN change would pass ``better <= band`` (False) and be kept; it is "unmeasured" instead,
    and the verdict's changes hold only finite numbers (trace.json is strict JSON)."""
    changes = {**dict.fromkeys(BANDS, 0.0), "decode_tokens_per_s": bad if where == "change" else 0.5}
    after = {**BEFORE, "decode_tokens_per_s": bad if where == "value" else 150.0}
    verdict = Policy().judge(Layer.HARDWARE, BEFORE, after, changes, BANDS)
    assert not verdict.kept and verdict.outcome == "unmeasured"
    assert f"objective decode_tokens_per_s is not finite ({where}" in verdict.reason
    json.dumps(verdict.changes, allow_nan=False)


# ---------------------------------------------------------------------------- default latency guards for scheduling

def test_scheduling_passes_are_guarded_on_ttft_and_itl_percentiles_by_default():
    guards = {g.metric: g for g in Policy().guards_for(Layer.SCHEDULING)}
    assert guards["ttft_ms_p90"].max_regression == 0.5 and guards["itl_ms_p90"].max_regression == 1.5
    assert "ttft_ms_p90" not in {g.metric for g in Policy().guards_for(Layer.HARDWARE)}


def _schedule(policy: Policy, changes: dict[str, float]):
    before = {"throughput_tokens_per_s": 14.2, "ttft_ms_p90": 900.0, "itl_ms_p90": 64.0, "agreement": 1.0, "path_agreement": 1.0}
    after = {m: v * (1 + changes.get(m, 0.0)) for m, v in before.items()}
    return policy.judge(Layer.SCHEDULING, before, after, changes, {m: 0.05 for m in changes})


def test_batching_that_makes_every_user_wait_much_longer_is_not_kept():
    """The quickstart's static batch: throughput +36% with TTFT +1465% is rolled back by default."""
    verdict = _schedule(Policy(), {"throughput_tokens_per_s": 0.36, "ttft_ms_p90": 14.65, "itl_ms_p90": 0.3})
    assert not verdict.kept and verdict.outcome == "guard"
    assert "guard ttft_ms_p90 max_regression 50% tripped" in verdict.reason
    assert verdict.guards == ["agreement min 0.5", "ttft_ms_p90 max_regression 50%", "itl_ms_p90 max_regression 150%"]


# ---------------------------------------------------------------------------- determinism: path agreement

def _batched(policy: Policy, *, identical: float, agreement: float = 0.78, kl: float = 0.01):
    """A batching step: throughput +35%, ``identical`` of its answers token-identical to one at a time."""
    before = {"throughput_tokens_per_s": 100.0, "agreement": 0.72, "kl_mean": 0.01}
    after = {"throughput_tokens_per_s": 135.0, "agreement": agreement, "kl_mean": kl, "path_agreement": identical}
    return policy.judge(Layer.SCHEDULING, before, after, {"throughput_tokens_per_s": 0.35}, {"throughput_tokens_per_s": 0.05})


def test_determinism_required_rolls_back_a_batching_that_changes_a_token():
    """With policy.determinism: required, 0.75 of the answers identical trips the path_agreement guard."""
    verdict = _batched(Policy(determinism="required"), identical=0.75)
    assert not verdict.kept and verdict.outcome == "guard"
    assert "guard path_agreement min 1 tripped: 0.75" in verdict.reason
    assert "path_agreement min 1" in verdict.guards


def test_determinism_off_keeps_a_batching_whose_quality_holds_and_quotes_the_identical_fraction():
    """By default (off) 0.75 identical is no guard: the quality guards hold, the step is kept, and its reason gives 0.75."""
    verdict = _batched(Policy(), identical=0.75)
    assert verdict.kept, verdict.reason
    assert "path_agreement 0.75: the share of answers token-identical to the previous plan's, reported, not guarded" in verdict.reason
    assert not any(g.startswith("path_agreement") for g in verdict.guards)


def test_determinism_off_still_rolls_back_a_batching_that_loses_the_baseline_answers():
    """With determinism off the batched answers are judged against the baseline: agreement 0.3 trips."""
    verdict = _batched(Policy(), identical=0.1, agreement=0.3)
    assert not verdict.kept and "guard agreement min 0.5 tripped: 0.3" in verdict.reason


def test_determinism_takes_off_or_required_and_names_them_otherwise():
    """A misspelt determinism is refused with the key, the value, the allowed values and the closest one."""
    with pytest.raises(RecipeError, match=r"determinism.*'requird'.*'off' \| 'required'.*Did you mean 'required'"):
        load_recipe({"model": "x/y", "policy": {"determinism": "requird"}}, check_model=False)
    with pytest.raises(RecipeError, match="determinism"):
        Policy(determinism="always")  # type: ignore[arg-type]


def test_unquoted_off_in_yaml_means_determinism_off(tmp_path):
    """YAML reads `determinism: off` as false; the recipe loads with determinism off, not an error."""
    path = tmp_path / "r.yaml"
    path.write_text("model: x/y\npolicy: {determinism: off}\n")
    assert load_recipe(path, check_model=False).policy.determinism == "off"


def test_batching_that_trades_inter_token_latency_for_throughput_is_kept():
    """Continuous batching as measured on this CPU (docs/passes.md): throughput 2x, TTFT p90 -80%,
    ITL p90 +133%: kept, and the reason names the ITL it costs."""
    verdict = _schedule(Policy(), {"throughput_tokens_per_s": 1.0, "ttft_ms_p90": -0.8, "itl_ms_p90": 1.33})
    assert verdict.kept, verdict.reason
    assert "at a cost no guard forbids: itl_ms_p90 paired estimate +133.0%" in verdict.reason


def test_a_recipe_slo_replaces_the_default_latency_guard():
    """``ttft_ms_p90: {max: 4000}`` in the recipe replaces the relative default on that metric."""
    policy = Policy(guards={"ttft_ms_p90": {"max": 4000}})
    guards = {g.metric: g for g in policy.guards_for(Layer.SCHEDULING)}
    assert guards["ttft_ms_p90"].max == 4000 and guards["ttft_ms_p90"].max_regression is None
    assert _schedule(policy, {"throughput_tokens_per_s": 0.5, "ttft_ms_p90": 2.0}).kept  # 2700 ms: under the SLO


@pytest.mark.parametrize("limit", [math.nan, math.inf])
def test_a_guard_limit_must_be_finite(limit):
    """``kl_mean: {max: .nan}`` would make the guard unable to trip: refused with the field named."""
    with pytest.raises(RecipeError, match=r"policy.guards.kl_mean.max: got (nan|inf), expected a finite number"):
        Policy(guards={"kl_mean": {"max": limit}})


def test_an_slo_the_previous_plan_already_breaks_trips_only_when_the_step_is_further_from_it():
    """TTFT p90 under load before batching: 11 s -> 5 s with max 4000 is not a reason to
    refuse a faster runtime; 11 s -> 12 s is. A quality limit trips whatever the previous plan had."""
    policy = Policy(guards={"ttft_ms_p90": {"max": 4000}, "kl_mean": {"max": 0.05}})
    before = {**BEFORE, "ttft_ms_p90": 11000.0, "kl_mean": 0.2}
    changes = {m: 0.0 for m in BANDS} | {"decode_tokens_per_s": 5.0}
    closer = policy.judge(Layer.HARDWARE, before, {**before, "decode_tokens_per_s": 600.0, "ttft_ms_p90": 5000.0, "kl_mean": 0.0}, changes, BANDS)
    assert closer.kept, closer.reason
    assert "ttft_ms_p90 max 4000 not met before or after (11000.0 -> 5000.0)" in closer.reason
    further = policy.judge(Layer.HARDWARE, before, {**before, "decode_tokens_per_s": 600.0, "ttft_ms_p90": 12000.0, "kl_mean": 0.0}, changes, BANDS)
    assert not further.kept and "guard ttft_ms_p90 max 4000 tripped" in further.reason
    worse_quality = policy.judge(Layer.HARDWARE, before, {**before, "decode_tokens_per_s": 600.0, "ttft_ms_p90": 3000.0, "kl_mean": 0.1}, changes, BANDS)
    assert not worse_quality.kept and "guard kl_mean max 0.05 tripped" in worse_quality.reason
