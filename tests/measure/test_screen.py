"""The screen's interval: one round's change, as wide as the calibration says one round strays."""

from __future__ import annotations

import math

from fractal_opt.measure.metrics import Measurement, Sample
from fractal_opt.measure.noise import Interval
from fractal_opt.measure.screen import can_still_beat, round_noise, screen_interval, screen_record


def _round(decode: dict[str, float]) -> Measurement:
    samples = [Sample(request_id=rid, repeat=0, prompt_tokens=10, new_tokens=8, prefill_ms=10.0, ttft_ms=10.0, decode_tokens_per_s=v, e2e_ms=100.0, hit_cap=False)
               for rid, v in decode.items()]
    return Measurement(samples=samples, repeats=[{}], outputs={}, texts={})


def test_one_round_strays_by_the_calibrations_noise_not_its_mean():
    """An A/A interval of ±4% over 6 rounds says one round strays about ±10%: the screen's interval
    is that wide around one round's change, even when the round's requests agree exactly."""
    calibration = {"intervals": {"decode_tokens_per_s": [-0.04, 0.04]}, "rounds": 6}
    half, df = round_noise(calibration, "decode_tokens_per_s")
    assert df == 5 and 0.09 < half < 0.11
    interval = screen_interval(_round({"a": 100, "b": 50}), _round({"a": 97, "b": 48.5}), "decode_tokens_per_s", calibration=calibration)
    assert math.isclose(interval.change, -0.03, abs_tol=1e-9)
    assert interval.low < -0.1 and interval.high > 0.05
    assert round_noise({}, "decode_tokens_per_s") is None and round_noise({"intervals": {}, "rounds": 1}, "x") is None


def test_the_requests_spread_widens_it_when_the_calibration_is_quiet():
    """With a quiet calibration, the round's own requests disagreeing (+20% and -20%) set the width."""
    quiet = {"intervals": {"decode_tokens_per_s": [-0.001, 0.001]}, "rounds": 4}
    interval = screen_interval(_round({"a": 100, "b": 100}), _round({"a": 120, "b": 80}), "decode_tokens_per_s", calibration=quiet)
    assert interval.high > 0.5 and interval.low < -0.5


def test_can_still_beat_reads_the_metrics_direction():
    """Tokens/s must reach above +min_effect, a latency below -min_effect; no interval: the full rounds decide."""
    assert can_still_beat(Interval(-0.02, -0.1, 0.06, 4), "decode_tokens_per_s", min_effect=0.05)
    assert not can_still_beat(Interval(-0.02, -0.1, 0.04, 4), "decode_tokens_per_s", min_effect=0.05)
    assert can_still_beat(Interval(0.02, -0.06, 0.1, 4), "e2e_ms", min_effect=0.05)
    assert not can_still_beat(Interval(0.02, -0.04, 0.1, 4), "e2e_ms", min_effect=0.05)
    assert can_still_beat(None, "e2e_ms", min_effect=0.05)
    record = screen_record(Interval(-0.3, -0.4, -0.2, 2), "decode_tokens_per_s", min_effect=0.05, before=_round({"a": 100}), after=_round({"a": 70}))
    assert record["passed"] is False and record["interval"] == [-0.4, -0.2] and record["before"] == 100 and record["after"] == 70


def test_the_kept_plans_own_comparisons_replace_the_calibrations_noise_once_they_have_enough_rounds():
    """The A/A calibration says one round strays ±10% (the float32 baseline); two full comparisons
    against the kept plan stray ±2% over 3 rounds each. Once pooled (4 degrees of freedom) their
    noise replaces the calibration's, so a candidate at -4% in one round is screened out; with the
    calibration's noise it would have gone on. A kept candidate starts the count again."""
    from fractal_opt.measure.screen import KeptNoise, can_still_beat

    calibration = {"intervals": {"decode_tokens_per_s": [-0.05, 0.05]}, "rounds": 4}
    kept = KeptNoise()
    kept.learn({"decode_tokens_per_s": [-0.02, 0.02]}, rounds=3)
    assert kept.noise("decode_tokens_per_s") is None  # 2 degrees of freedom: the calibration still decides
    kept.learn({"decode_tokens_per_s": [-0.02, 0.02]}, rounds=3)
    half, df = kept.noise("decode_tokens_per_s")
    assert df == 4 and half < 0.03
    before, after = _round({"a": 100, "b": 50, "c": 20}), _round({"a": 96, "b": 48, "c": 19.2})  # -4% on every request
    wide = screen_interval(before, after, "decode_tokens_per_s", calibration=calibration)
    narrow = screen_interval(before, after, "decode_tokens_per_s", calibration=calibration, noise=kept.noise("decode_tokens_per_s"))
    assert can_still_beat(wide, "decode_tokens_per_s", min_effect=0.05)
    assert not can_still_beat(narrow, "decode_tokens_per_s", min_effect=0.05)
    kept.reset()
    assert kept.noise("decode_tokens_per_s") is None
