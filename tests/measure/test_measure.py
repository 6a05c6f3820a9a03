"""Measurement rules: per-request math, paired comparison, noise bands, the token clock."""

from __future__ import annotations

import math

import pytest

from fractal_opt.engine.protocol import Generation
from fractal_opt.measure.clock import TokenClock
from fractal_opt.measure.metrics import Measurement, Sample
from fractal_opt.measure.runner import paired_changes


def _gen(*, rid="r", t_submit=10.0, t_prefill=10.1, times=(10.5, 10.6, 10.7, 10.9), hit_cap=True) -> Generation:
    return Generation(request_id=rid, text="x", token_ids=list(range(len(times))), prompt_tokens=20, t_submit=t_submit,
                      t_prefill_start=t_prefill, token_times=list(times), hit_cap=hit_cap)


def _sample(rid: str, **values) -> Sample:
    base = dict(request_id=rid, prompt_tokens=10, new_tokens=8, ttft_ms=50.0, prefill_ms=40.0, e2e_ms=500.0, decode_tokens_per_s=20.0, hit_cap=True)
    base.update(values)
    return Sample(**base)


def _change(before: Measurement, after: Measurement, metric: str) -> float | None:
    """The paired change of ``metric`` (None when no request has a value on both sides)."""
    interval = paired_changes(before, after, [metric]).get(metric)
    return None if interval is None else interval.change


def _measurement(samples: list[Sample], repeats: list[dict] | None = None) -> Measurement:
    return Measurement(samples=samples, repeats=repeats or [{"throughput_tokens_per_s": 10.0, "peak_memory_mb": 100.0, "cpu_utilization": 0.5}], outputs={}, texts={})


def test_sample_from_generation_math():
    """TTFT is submit -> first token, prefill is prompt handed over -> first token, e2e is submit -> last token."""
    s = Sample.from_generation(_gen())
    assert s.ttft_ms == pytest.approx(500.0)
    assert s.prefill_ms == pytest.approx(400.0)
    assert s.e2e_ms == pytest.approx(900.0)
    assert s.new_tokens == 4 and s.prompt_tokens == 20 and s.hit_cap


def test_decode_rate_excludes_first_token():
    """Decode tokens/s is (n - 1) / (t_last - t_first): 3 intervals over 0.4 s = 7.5 tokens/s, not 4 / 0.4."""
    s = Sample.from_generation(_gen())
    assert s.decode_tokens_per_s == pytest.approx(7.5)
    assert s.decode_ms_per_token == pytest.approx(1000 / 7.5)


def test_single_token_has_no_decode_rate():
    """One generated token has a TTFT but no decode rate (None, not a division by zero)."""
    s = Sample.from_generation(_gen(times=(10.5,)))
    assert s.decode_tokens_per_s is None and s.decode_ms_per_token is None
    assert s.ttft_ms == pytest.approx(500.0) and s.e2e_ms == pytest.approx(500.0)


def test_change_is_geometric_mean_of_per_request_ratios():
    """paired_changes() pairs requests: ratios 2x and 0.5x cancel out to 0, whatever the requests' sizes."""
    before = _measurement([_sample("short", e2e_ms=10.0), _sample("long", e2e_ms=1000.0)])
    after = _measurement([_sample("short", e2e_ms=20.0), _sample("long", e2e_ms=500.0)])
    assert _change(before, after, "e2e_ms") == pytest.approx(0.0, abs=1e-12)
    after2 = _measurement([_sample("short", e2e_ms=20.0), _sample("long", e2e_ms=8000.0)])
    assert _change(before, after2, "e2e_ms") == pytest.approx(math.sqrt(2 * 8) - 1)


def test_an_outlier_round_widens_the_interval_instead_of_deciding():
    """Rounds are averaged (geometric mean over rounds), so one stalled round moves the estimate,
    and it widens the t interval with it: 2x, 2x, 50x gives +484% with an interval that reaches
    below zero, so the band covers it and no verdict is drawn from that round."""
    from fractal_opt.measure.noise import band

    before = _measurement([_sample("a", ttft_ms=v, repeat=r) for r, v in enumerate((10.0, 10.0, 10.0))])
    after = _measurement([_sample("a", ttft_ms=v, repeat=r) for r, v in enumerate((20.0, 20.0, 500.0))])
    iv = paired_changes(before, after, ["ttft_ms"])["ttft_ms"]
    assert iv.change == pytest.approx((2 * 2 * 50) ** (1 / 3) - 1) and iv.low < 0
    assert abs(iv.change) <= band(iv, min_effect=0.05)


def test_change_ignores_requests_missing_on_one_side():
    """Requests measured on one side only are left out of the pairing."""
    before = _measurement([_sample("a", e2e_ms=10.0), _sample("b", e2e_ms=10.0)])
    after = _measurement([_sample("a", e2e_ms=15.0)])
    assert _change(before, after, "e2e_ms") == pytest.approx(0.5)


def test_per_repeat_metric_median_is_over_repeats():
    """Throughput (a per-repeat number) has the median of the repeats as its value."""
    before = _measurement([_sample("a")], [{"throughput_tokens_per_s": v, "peak_memory_mb": 1.0, "cpu_utilization": 1.0} for v in (10.0, 12.0, 11.0)])
    after = _measurement([_sample("a")], [{"throughput_tokens_per_s": v, "peak_memory_mb": 1.0, "cpu_utilization": 1.0} for v in (22.0, 20.0, 99.0)])
    assert after.median("throughput_tokens_per_s") / before.median("throughput_tokens_per_s") - 1 == pytest.approx(22.0 / 11.0 - 1)


def test_change_without_values_is_none():
    """A metric that was not measured (no decode rate anywhere) has no change (None), not 0."""
    before = _measurement([_sample("a", decode_tokens_per_s=None)])
    assert _change(before, before, "decode_tokens_per_s") is None


def test_summary_reports_medians_and_cap_share():
    """summary() holds the median of each metric over requests and the share of requests that hit the cap."""
    m = _measurement([_sample("a", ttft_ms=10.0, hit_cap=True), _sample("b", ttft_ms=30.0, hit_cap=False), _sample("c", ttft_ms=20.0, hit_cap=False)])
    summary = m.summary()
    assert summary["ttft_ms"] == pytest.approx(20.0)
    assert summary["hit_cap"] == pytest.approx(1 / 3)


def test_token_clock_records_prompt_then_tokens():
    """TokenClock takes the first put() as the prompt and each later put() as one token, syncing before every read."""
    syncs = []
    clock = TokenClock(sync=lambda: syncs.append(1))
    clock.put("prompt ids")
    assert clock.prompt_time is not None and clock.token_times == []
    for _ in range(3):
        clock.put("token")
    clock.end()
    assert len(clock.token_times) == 3
    assert clock.prompt_time <= clock.token_times[0] <= clock.token_times[1] <= clock.token_times[2]
    assert len(syncs) == 4
