"""Capacity under SLOs: the bracketing search finds the highest load meeting every SLO at its
percentile, to the resolution asked, says when the answer is indeterminate, and keeps every probe."""

from __future__ import annotations

import pytest

from fractal_opt.measure.capacity import CapacitySearch, judge_probe, quantile_interval
from fractal_opt.measure.load import LoadRecord, LoadResult
from fractal_opt.workloads.workload import LoadProfile


def _result(ttfts_ms, *, rejected=0) -> LoadResult:
    """A load whose finished requests saw these TTFTs, plus ``rejected`` refused ones."""
    records = [LoadRecord(id=f"r{i}", status="done", max_new_tokens=4, prompt_tokens=10, t_submit=0.0, t_end=1.0,
                          delivered_times=[t / 1000], token_ids=[1, 2], token_times=[t / 1000, t / 1000 + 0.01]) for i, t in enumerate(ttfts_ms)]
    records += [LoadRecord(id=f"x{i}", status="rejected", max_new_tokens=4, prompt_tokens=0, t_submit=0.0, t_end=0.0) for i in range(rejected)]
    return LoadResult(records=records, wall_s=1.0)


def _linear(profile: LoadProfile) -> LoadResult:
    """TTFT grows 100 ms per user, the same for every request (a sharp limit)."""
    return _result([100.0 * profile.users] * 20)


def test_search_brackets_then_bisects_to_the_highest_load_meeting_the_slo():
    """From 8 users with TTFT p90 <= 650 ms and TTFT = 100 ms x users: 8 breaks, 4 holds, then 6 holds and 7 breaks."""
    profile = LoadProfile(mode="conversations", users=8, slo_ttft_ms=650, capacity=True)
    answer = CapacitySearch(profile, run=_linear).run()
    assert answer["capacity"] == 6 and answer["interval"] == [6, 7] and answer["status"] == "found"
    assert [p["load"] for p in answer["probes"]] == [8, 4, 6, 7]
    assert answer["probes"][0]["slos"]["ttft_ms"]["value"] == 800 and answer["unit"] == "users"


def test_search_grows_until_an_slo_breaks_and_stops_within_the_resolution():
    """A Poisson rate doubles from its start while held, then bisects until within 10% of the top."""
    profile = LoadProfile(mode="poisson", rate=1.0, slo_ttft_ms=1000, capacity=True, capacity_resolution=0.1)
    answer = CapacitySearch(profile, run=lambda p: _result([100.0 * p.rate] * 20)).run()
    low, high = answer["interval"]
    assert low <= 10 < high and (high - low) <= 0.1 * high and answer["status"] == "found"
    assert [p["load"] for p in answer["probes"]][:5] == [1.0, 2.0, 4.0, 8.0, 16.0]


def test_an_interval_straddling_the_slo_is_indeterminate():
    """When the probe above the answer cannot tell whether its p90 is over the limit, the answer says indeterminate."""
    def run(p):
        if p.users <= 2:
            return _result([100.0] * 20)
        if p.users == 3:
            return _result([100.0] * 17 + [900.0] * 3)  # p90 near the 500 ms limit: its interval spans it
        return _result([900.0] * 20)

    answer = CapacitySearch(LoadProfile(mode="conversations", users=2, slo_ttft_ms=500, capacity=True), run=run).run()
    assert answer["capacity"] == 2 and answer["status"] == "indeterminate" and "indeterminate" in answer["answer"]


def test_failed_requests_over_one_percent_break_a_probe_whatever_the_latency():
    """A probe where 2 of 100 requests were refused is over capacity even with every TTFT fast."""
    profile = LoadProfile(mode="closed", concurrency=4, slo_ttft_ms=1000, capacity=True)
    assert judge_probe(_result([10.0] * 98, rejected=2), profile)["verdict"] == "broken"
    assert judge_probe(_result([10.0] * 100), profile)["verdict"] == "met"


def test_no_load_meeting_the_slo_is_none_not_a_number():
    """When even the smallest load breaks the SLO the capacity is None and the answer says so."""
    answer = CapacitySearch(LoadProfile(mode="conversations", users=4, slo_ttft_ms=50, capacity=True), run=_linear).run()
    assert answer["capacity"] is None and answer["status"] == "none" and [p["load"] for p in answer["probes"]] == [4, 2, 1]


def test_quantile_interval_brackets_the_percentile():
    """The 95% interval of a p90 over 100 values holds the sample p90 and widens with fewer values."""
    values = list(range(100))
    lo, hi = quantile_interval(values, 90)
    assert lo <= 89.1 <= hi and hi - lo < 20
    lo5, hi5 = quantile_interval(values[:10], 90)
    assert (hi5 - lo5) >= 1 and hi5 == 9


def test_judging_on_capacity_needs_a_capacity_load():
    """A recipe whose objective or target is capacity, without load capacity: true, is refused before any model loads."""
    from fractal_opt.core.errors import RecipeError
    from fractal_opt.language.recipe import parse_recipe

    with pytest.raises(RecipeError, match="judges on 'capacity'"):
        parse_recipe({"model": "smollm2-135m-instruct", "targets": {"capacity": 8}})
    ok = parse_recipe({"model": "smollm2-135m-instruct", "policy": {"objective": "capacity"},
                       "workload": {"suite": "conversations", "load": {"mode": "conversations", "capacity": True, "slo_ttft_ms": 2000}}})
    assert ok.policy.objective == "capacity"
