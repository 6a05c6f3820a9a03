"""Each guard checks one thing, and a quality number that is not exact is unknown, never a pass."""

from __future__ import annotations

import math

from fractal_opt.language.guards import Evidence, Guard


def test_an_exact_kl_above_its_max_trips():
    """kl_mean 0.2 against max 0.05 trips, quoting the value."""
    found = Guard(metric="kl_mean", max=0.05).check(Evidence(after={"kl_mean": 0.2, "kl_method": "full"}))
    assert found.trips == ["guard kl_mean max 0.05 tripped: 0.2"] and found.in_force


def test_an_exact_kl_below_its_max_passes():
    """kl_mean 0.001 measured exactly passes the guard, which is in force."""
    found = Guard(metric="kl_mean", max=0.05).check(Evidence(after={"kl_mean": 0.001, "kl_method": "exact (the baseline's top-256 tokens)"}))
    assert found.trips == [] and found.in_force


def test_a_lower_bound_under_the_limit_is_unknown_and_trips():
    """A top-k lower bound far under the limit still trips: the true value could be anywhere above it."""
    found = Guard(metric="kl_mean", max=0.05).check(Evidence(after={"kl_mean": 0.001, "kl_method": "top-k lower bound (k=20)"}))
    assert len(found.trips) == 1 and found.trips[0].startswith("guard kl_mean unknown: only a lower bound (top-k lower bound (k=20))")


def test_a_missing_quality_number_is_unknown_and_trips():
    """An agreement the runtime could not give (None) trips as unknown."""
    found = Guard(metric="agreement", min=0.6).check(Evidence(after={"agreement": None}))
    assert found.trips and "unknown: not measurable" in found.trips[0]


def test_a_metric_the_step_did_not_measure_is_not_in_force():
    """No eval set configured: the accuracy guard neither trips nor counts as in force."""
    found = Guard(metric="accuracy", max_drop=0.05).check(Evidence(after={"decode_tokens_per_s": 10.0}))
    assert found.trips == [] and not found.in_force


def test_accept_unknown_notes_instead_of_tripping():
    """accept_unknown turns an unknown into a note, unless the lower bound is already above the limit."""
    guard = Guard(metric="kl_mean", max=0.05, accept_unknown=True)
    low = guard.check(Evidence(after={"kl_mean": 0.001, "kl_method": "top-k lower bound (k=20)"}))
    high = guard.check(Evidence(after={"kl_mean": 0.3, "kl_method": "top-k lower bound (k=20)"}))
    assert low.trips == [] and "accepted (accept_unknown)" in low.notes[0]
    assert high.trips == ["guard kl_mean max 0.05 tripped: its lower bound 0.3 is already above"]


def test_a_nan_trips():
    """NaN > 0.05 is False; the guard trips on a number that is not finite."""
    found = Guard(metric="kl_mean", max=0.05).check(Evidence(after={"kl_mean": math.nan, "kl_method": "full"}))
    assert found.trips and "not finite" in found.trips[0]


def test_max_drop_against_the_baseline():
    """accuracy 0.6 against a baseline 0.75 with max_drop 0.1 trips, naming both."""
    found = Guard(metric="accuracy", max_drop=0.1).check(Evidence(after={"accuracy": 0.6}, baseline={"accuracy": 0.75}))
    assert found.trips == ["guard accuracy max_drop 0.1 tripped: 0.75 at baseline -> 0.6"]


def test_max_regression_beyond_noise():
    """A 20% slower TTFT trips a 10% max_regression with a 5% band; 12% does not."""
    guard = Guard(metric="ttft_ms", max_regression=0.10)
    ev = dict(before={"ttft_ms": 100.0}, bands={"ttft_ms": 0.05})
    assert guard.check(Evidence(after={"ttft_ms": 120.0}, changes={"ttft_ms": 0.20}, **ev)).trips
    assert not guard.check(Evidence(after={"ttft_ms": 112.0}, changes={"ttft_ms": 0.12}, **ev)).trips


def test_accuracy_drop_without_significance_counts_when_large():
    """3 lost of 3 (p 0.125, no significance possible) still trips; 2 lost of 40 (drop 0.05, p 0.25) does not."""
    guard = Guard(metric="accuracy", max_drop=0.0)
    small = guard.check(Evidence(after={"accuracy": 0.0, "eval_lost": 3, "eval_gained": 0, "eval_total": 3, "eval_worse_p": 0.125}, baseline={"accuracy": 1.0}))
    noise = guard.check(Evidence(after={"accuracy": 0.7, "eval_lost": 2, "eval_gained": 0, "eval_total": 40, "eval_worse_p": 0.25}, baseline={"accuracy": 0.75}))
    assert small.trips and "a drop over 0.1 counts without the sign test" in small.trips[0]
    assert noise.trips == [] and noise.in_force


def test_agreement_under_its_floor_defers_to_a_scored_eval():
    """The default agreement guard (min 0.5, judged_by accuracy) trips without an eval; with the
    paired eval scored, the eval decides: no net loss against the baseline makes the low agreement a
    note (reworded), a net loss however small keeps it a trip (wrong), each naming the counts."""
    from fractal_opt.language.policy import Policy
    from fractal_opt.tower.passes import Layer

    [agreement] = [g for g in Policy().guards_for(Layer.MODEL) if g.metric == "agreement"]
    assert (agreement.min, agreement.judged_by) == (0.5, "accuracy")
    alone = agreement.check(Evidence(after={"agreement": 0.37}))
    assert alone.trips == ["guard agreement min 0.5 tripped: 0.37"]
    with_eval = agreement.check(Evidence(after={"agreement": 0.37, "accuracy": 0.78, "eval_lost": 0, "eval_gained": 1, "eval_total": 45},
                                         baseline={"accuracy": 0.7556}))
    assert with_eval.trips == [] and with_eval.in_force
    assert "reworded, not wrong" in with_eval.notes[0] and "lost 0, gained 1 of 45" in with_eval.notes[0]
    net_loss = agreement.check(Evidence(after={"agreement": 0.27, "accuracy": 0.7556, "eval_lost": 4, "eval_gained": 3, "eval_total": 45},
                                        baseline={"accuracy": 0.7778}))
    assert "wrong, not reworded" in net_loss.trips[0] and "lost 4, gained 3 of 45" in net_loss.trips[0]
    assert agreement.check(Evidence(after={"agreement": 0.9, "accuracy": 0.78})).notes == []


def test_a_recipe_can_make_agreement_strict_again():
    """policy.guards.agreement.judged_by: null keeps the floor as a trip even with an eval; a wrong name is refused with the closest one."""
    import pytest

    from fractal_opt.core.errors import RecipeError
    from fractal_opt.language.policy import Policy
    from fractal_opt.tower.passes import Layer

    [strict] = [g for g in Policy(guards={"agreement": {"judged_by": None}}).guards_for(Layer.MODEL) if g.metric == "agreement"]
    assert strict.min == 0.5 and strict.check(Evidence(after={"agreement": 0.3, "accuracy": 0.8})).trips
    with pytest.raises(RecipeError, match="Did you mean 'accuracy'"):
        Policy(guards={"agreement": {"judged_by": "acuracy"}})
