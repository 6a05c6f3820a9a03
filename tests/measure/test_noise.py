"""Noise-aware comparison: paired t intervals over rounds, bands, adaptive rounds, percentiles, memory, GPU telemetry, pre-flight."""

from __future__ import annotations

import json
import math
import mmap
import random
import statistics

import pytest

from fractal_opt.measure.memory import GpuMonitor, MemoryWindow
from fractal_opt.measure.metrics import PERCENTILE_METRICS, Measurement, Sample, percentile
from fractal_opt.measure.noise import band, paired_interval, settled, t_quantile
from fractal_opt.measure.runner import paired_changes


def _sample(rid: str, repeat: int, **values) -> Sample:
    base = dict(request_id=rid, prompt_tokens=10, new_tokens=8, ttft_ms=50.0, prefill_ms=40.0, e2e_ms=500.0, decode_tokens_per_s=20.0, hit_cap=True, repeat=repeat)
    base.update(values)
    return Sample(**base)


def _measurement(decode: dict[tuple[str, int], float]) -> Measurement:
    samples = [_sample(rid, r, decode_tokens_per_s=v) for (rid, r), v in decode.items()]
    rounds = sorted({r for _, r in decode})
    return Measurement(samples=samples, repeats=[{"throughput_tokens_per_s": 10.0} for _ in rounds], outputs={}, texts={})


def test_interval_of_identical_ratios_is_a_point():
    """Every pair 10% faster: the change is +10% and the interval has no width."""
    ci = paired_interval({0: [math.log(1.1)] * 2, 1: [math.log(1.1)] * 2, 2: [math.log(1.1)] * 2})
    assert ci.change == pytest.approx(0.1) and ci.low == pytest.approx(0.1) and ci.high == pytest.approx(0.1)


def test_the_interval_is_a_t_interval_over_round_means():
    """Rounds are the unit: each round's requests are averaged first, then a Student t interval
    (n - 1 degrees of freedom) is taken over the rounds, symmetric in log space."""
    logs = {0: [0.10, 0.00], 1: [0.02, 0.02], 2: [-0.03, 0.01]}  # round means 0.05, 0.02, -0.01
    ci = paired_interval(logs)
    half = t_quantile(0.975, 2) * statistics.stdev([0.05, 0.02, -0.01]) / math.sqrt(3)
    assert ci.change == pytest.approx(math.exp(0.02) - 1) and ci.pairs == 6
    assert (ci.low, ci.high) == (pytest.approx(math.exp(0.02 - half) - 1), pytest.approx(math.exp(0.02 + half) - 1))
    assert t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3) and t_quantile(0.975, 3) == pytest.approx(3.182, abs=5e-3)
    assert t_quantile(0.975, 30) == pytest.approx(2.042, abs=1e-3)


def test_three_rounds_cover_the_truth_95_percent_of_the_time():
    """The reason for the t interval: over 2000 simulated A/A comparisons of three noisy rounds
    (two requests each, a shared per-round luck), the interval misses zero in about 5% of them;
    a percentile bootstrap of three rounds cannot (it stays inside the observed values)."""
    rng = random.Random(0)
    misses = 0
    for _ in range(2000):
        logs = {}
        for r in range(3):
            luck = rng.gauss(0.0, 0.05)
            logs[r] = [luck + rng.gauss(0.0, 0.02) for _ in range(2)]
        ci = paired_interval(logs)
        misses += not (ci.low <= 0.0 <= ci.high)
    assert 0.03 <= misses / 2000 <= 0.07, misses


def test_one_round_uses_its_requests_spread():
    """With one round the requests' log-ratios are the sample (the only spread there is); one pair is a point."""
    ci = paired_interval({0: [0.1, -0.1, 0.0]})
    assert ci.low < 0 < ci.high and ci.change == pytest.approx(0.0)
    point = paired_interval({0: [0.1]})
    assert point.low == point.change == point.high


def test_band_counts_a_change_only_when_interval_excludes_zero():
    """A +5% change whose interval reaches below zero stays inside its band; one whose interval is clear of zero exceeds it."""
    noisy = paired_interval({0: [0.15, 0.10], 1: [-0.05, -0.04], 2: [0.05, 0.06]})
    assert noisy.low < 0 < noisy.change
    assert noisy.change <= band(noisy, min_effect=0.03)
    clear = paired_interval({0: [0.09, 0.10], 1: [0.10, 0.09], 2: [0.11, 0.10]})
    assert clear.low > 0.03 and clear.change > band(clear, min_effect=0.03)
    assert band(clear, min_effect=0.2) == 0.2  # min_effect is the floor
    assert band(clear, min_effect=0.03, drift=0.15) == pytest.approx(0.30)  # back to back: 2 x the A/A drift


def test_settled_rules():
    """More rounds are needed while the interval is wider than min_effect and still straddles a threshold."""
    assert settled(paired_interval({0: [0.0], 1: [0.001], 2: [-0.001]}), min_effect=0.03)
    assert not settled(paired_interval({0: [0.2, 0.1], 1: [-0.2, -0.1], 2: [0.0, 0.0]}), min_effect=0.03)
    assert settled(paired_interval({0: [0.3, 0.35], 1: [0.5, 0.45], 2: [0.4, 0.4]}), min_effect=0.03)  # clearly better


def test_paired_changes_pairs_request_and_round():
    """Pairs are (request, round), grouped by round: a request 2x faster in round 0 only and
    unchanged in rounds 1 and 2 gives a mean of +26% whose interval reaches below zero, so no
    verdict is drawn from one stalled round."""
    before = _measurement({("a", 0): 10.0, ("a", 1): 10.0, ("a", 2): 10.0})
    after = _measurement({("a", 0): 20.0, ("a", 1): 10.0, ("a", 2): 10.0})
    ci = paired_changes(before, after, ["decode_tokens_per_s"])["decode_tokens_per_s"]
    assert ci.change == pytest.approx(2 ** (1 / 3) - 1) and ci.pairs == 3 and ci.low < 0


def test_percentile_and_itl_pooling():
    """Percentiles interpolate between ranks; ITL pools every token gap of every request and round."""
    assert percentile([1, 2, 3, 4, 5], 50) == 3 and percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6) and percentile([], 50) is None
    m = Measurement(samples=[_sample("a", 0, itl_ms=(10.0, 10.0, 40.0)), _sample("b", 1, itl_ms=(20.0,))], repeats=[], outputs={}, texts={})
    assert m.pooled("itl_ms_p50") == pytest.approx(15.0)
    assert m.pooled("itl_ms_p99") == pytest.approx(39.4)
    assert set(PERCENTILE_METRICS) <= set(m.summary())


def test_sample_itl_and_prefill_rate_from_a_generation():
    """A generation's token times give its inter-token gaps (first token excluded) and prompt tokens / prefill time."""
    from fractal_opt.engine.protocol import Generation

    g = Generation(request_id="r", text="x", token_ids=[1, 2, 3], prompt_tokens=40, t_submit=0.0, t_prefill_start=0.1, token_times=[0.3, 0.35, 0.45])
    s = Sample.from_generation(g, repeat=2)
    assert s.itl_ms == pytest.approx((50.0, 100.0)) and s.repeat == 2
    assert s.prefill_tokens_per_s == pytest.approx(200.0)  # 40 tokens in 0.2 s


@pytest.mark.parametrize("method", ["vmhwm", "sampler"])
def test_memory_window_sees_a_peak_inside_the_block(method):
    """Both methods see a 64 MiB allocation that is freed before the block ends (the peak, not the end state)."""
    import time

    with MemoryWindow("cpu", method=method) as idle:
        time.sleep(0.05)
    with MemoryWindow("cpu", method=method) as busy:
        # A fresh anonymous mapping: heap memory could reuse pages an earlier test freed but the
        # allocator kept resident (then RSS would not grow at all), a new mapping always does.
        block = mmap.mmap(-1, 64 * 2**20)
        for i in range(0, len(block), 4096):  # touch every page so it is resident
            block[i] = 1
        time.sleep(0.15)  # the sampler reads every 50 ms (memory.SAMPLE_S): three readings at least
        block.close()
    assert busy.source == method
    assert busy.peak_mb - idle.peak_mb > 48


def test_gpu_telemetry_is_marked_unavailable_on_cpu():
    """On a CPU (or without nvidia-ml-py) every GPU number is None with the reason, never a made-up zero."""
    with GpuMonitor("cpu") as g:
        pass
    r = g.result()
    assert r["status"].startswith("unavailable") and "not a CUDA GPU" in r["status"]
    assert r["sm_utilization"] is None and r["power_w"] is None and r["energy_j"] is None
    pytest.importorskip("torch")
    try:
        import pynvml  # noqa: F401
    except ImportError:
        with GpuMonitor("cuda:0") as g2:
            pass
        assert "nvidia-ml-py is not installed" in g2.result()["status"]


def test_machine_limits_cached_per_fingerprint(tmp_path, monkeypatch, machine):
    """The probe measures positive ceilings once and the second call reads the cache file."""
    from fractal_opt.measure import machine_limits

    monkeypatch.setenv("FRACTAL_OPT_CACHE", str(tmp_path))
    monkeypatch.setattr(machine_limits, "_CPU_BYTES", 16 * 2**20)  # keep the test short; the real probe uses 256 MiB
    monkeypatch.setattr(machine_limits, "_MATMUL_N", {"float32": 128, "bfloat16": 64})
    monkeypatch.setattr(machine_limits, "_load_average", lambda: 0.1)  # a quiet machine: the cache is trusted
    first = machine_limits.probe_limits("cpu", machine=machine, threads=1)
    assert not first.cached and first.bandwidth_bytes_per_s > 0 and first.peak_flops["float32"] > 0
    files = list(tmp_path.glob("machine-*.json"))
    assert [f.name for f in files] == [f"machine-{first.fingerprint}.json"]
    second = machine_limits.probe_limits("cpu", machine=machine, threads=1)
    assert second.cached and second.bandwidth_bytes_per_s == first.bandwidth_bytes_per_s
    other = machine_limits.fingerprint(machine, "cpu", 2, "x")
    assert other != first.fingerprint


def test_preflight_refuses_with_the_numbers():
    """A plan whose weights + KV exceed the device is refused with GB figures; the same plan fits a bigger device."""
    from fractal_opt.measure.budget import shape_from_config
    from fractal_opt.measure.preflight import preflight
    from fractal_opt.tower.plan import Plan, SchedulingPlan

    shape = shape_from_config({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000})
    plan = Plan(source="x", scheduling=SchedulingPlan(batching="static", batch_size=8))
    reason, numbers = preflight(plan, shape, context=4096, n_requests=8, capacity_bytes=16 * 10**9)
    assert reason is not None and "exceed the device's 16.000 GB" in reason and "batch 8" in reason
    assert numbers["weight_bytes"] == 6_738_415_616 * 4 and numbers["kv_bytes"] == 2 * 32 * 32 * 128 * 4 * 4096 * 8
    assert preflight(plan, shape, context=4096, n_requests=8, capacity_bytes=200 * 10**9)[0] is None


def test_pipeline_refuses_a_baseline_that_cannot_fit(tiny_dir, small_recipe, machine):
    """The pre-flight runs before any model loads: a 1 MB device refuses the baseline with the numbers."""
    import dataclasses

    from fractal_opt.core.errors import EngineError
    from fractal_opt.pipeline.runner import Pipeline

    tiny_machine = dataclasses.replace(machine, memory_bytes=10**6)
    with pytest.raises(EngineError, match="pre-flight: weights .* GB .* exceed the device's 0.001 GB"):
        Pipeline(small_recipe(tiny_dir), progress=False, machine=tiny_machine).run()


def test_measure_pair_extends_rounds_until_settled(tiny_dir, monkeypatch):
    """Rounds grow to max_repeats, two at a time, while the objective's interval is unsettled and stop at repeats once it is; orders alternate."""
    from fractal_opt.measure import noise
    from fractal_opt.measure.runner import measure_pair
    from fractal_opt.runtimes import Engine
    from fractal_opt.tower.plan import Plan
    from fractal_opt.workloads.workload import Workload

    engine = Engine.build(Plan(source=str(tiny_dir)), progress=lambda m: None)
    wl = Workload(suite="default", limit=2, max_new_tokens=4, repeats=1, max_repeats=3, warmup=0)
    seen = []
    monkeypatch.setattr(noise, "settled", lambda interval, *, min_effect: seen.append(interval) or False)
    a, b = measure_pair(engine, engine, wl, min_effect=0.03)
    assert len(a.repeats) == len(b.repeats) == 3
    assert {s.repeat for s in b.samples} == {0, 1, 2}
    assert len(seen) == 1 and seen[0] is not None  # asked after round 1; rounds 2 and 3 are added as one A B / B A pair
    monkeypatch.setattr(noise, "settled", lambda interval, *, min_effect: True)
    a, b = measure_pair(engine, engine, wl, min_effect=0.03)
    assert len(b.repeats) == 1


@pytest.mark.integration  # a whole pipeline on the tiny model: ~7 s a case
@pytest.mark.parametrize(("memory_bytes", "mode"), [(16 * 2**30, "interleaved"), (15 * 10**6, "back_to_back")])
def test_pipeline_records_comparison_intervals_and_roofline(tiny_dir, small_recipe, machine, tmp_path, memory_bytes, mode):
    """Each step stores how it was compared (interleaved when both plans fit, else back to back with a note),
    its 95% intervals and roofline numbers; the report shows the calibration intervals and the roofline table."""
    import dataclasses
    import json

    from fractal_opt.pipeline.runner import Pipeline

    # 15 MB: the ~10 MB tiny model fits alone but not next to a second copy (80% rule) -> back to back.
    recipe = small_recipe(tiny_dir, max_new_tokens=4, passes={"application": [{"max_new_tokens": {"limit": 2}}]})
    Pipeline(recipe, out_dir=tmp_path, progress=False, machine=dataclasses.replace(machine, memory_bytes=memory_bytes)).run()
    trace = json.loads((tmp_path / "trace.json").read_text())
    (step,) = trace["steps"]
    assert step["metrics"]["comparison"]["mode"] == mode
    assert ("note" in step["metrics"]["comparison"]) == (mode == "back_to_back")
    low, high = step["metrics"]["intervals"]["e2e_ms"]
    assert low <= step["changes"]["e2e_ms"] <= high
    for s in (trace["baseline"], step):
        roof = s["metrics"]["roofline"]
        assert roof["bytes_per_decode_step"] > 0 and roof["achieved_bandwidth_gbs"] > 0 and roof["bound"] in ("bandwidth-bound", "compute-bound", "overhead-bound", "capacity-bound")
        assert s["metrics"]["itl_ms_p99"] >= s["metrics"]["itl_ms_p50"] > 0
        assert s["metrics"]["gpu"]["status"].startswith("unavailable")
    assert "intervals" in trace["calibration"] and trace["calibration"]["rounds"] >= 2
    assert "limits" in trace["machine"] and trace["machine"]["limits"]["bandwidth_bytes_per_s"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "Noise calibration (baseline against itself, interleaved" in report and "Latency, memory and roofline" in report
    assert mode.replace("_", " ") in report
    if mode == "back_to_back":
        assert trace["baseline"]["metrics"]["roofline"]["bound"] == "capacity-bound"  # 500 MB RSS on a "15 MB" device


def test_a_probe_taken_on_a_busy_machine_is_redone_and_keeps_the_best(tmp_path, monkeypatch, machine):
    """A cached probe taken under load is re-measured next time, and each ceiling keeps its best reading."""
    from fractal_opt.measure import machine_limits

    monkeypatch.setenv("FRACTAL_OPT_CACHE", str(tmp_path))
    monkeypatch.setattr(machine_limits, "_CPU_BYTES", 16 * 2**20)
    monkeypatch.setattr(machine_limits, "_MATMUL_N", {"float32": 128, "bfloat16": 64})
    monkeypatch.setattr(machine_limits, "_load_average", lambda: 9.0)  # busier than the 2 cores
    first = machine_limits.probe_limits("cpu", machine=machine, threads=1)
    path = tmp_path / f"machine-{first.fingerprint}.json"
    inflated = {**json.loads(path.read_text()), "bandwidth_bytes_per_s": 1e15}
    path.write_text(json.dumps(inflated))
    second = machine_limits.probe_limits("cpu", machine=machine, threads=1)
    assert not second.cached  # re-measured, because the cached one was taken on a busy machine
    assert second.bandwidth_bytes_per_s == 1e15  # the best reading of the two is kept


def test_a_plan_with_smaller_weights_shows_its_own_peak_memory(monkeypatch):
    """Interleaved rounds hold both models; a solo round of the candidate (previous model released) gives its own peak,
    so a plan whose weights are half the size shows a lower peak_memory_mb than the previous plan's own peak."""
    from fractal_opt.measure.busy import BusySnapshot
    from fractal_opt.pipeline.step_measurement import StepMeasurer
    from fractal_opt.testing import FakeEngine, cpu_machine
    from fractal_opt.tower.plan import Plan
    from fractal_opt.workloads.workload import Workload

    class ResidentEngine(FakeEngine):
        """A fake whose 'weights' are resident memory (weight_bytes of touched pages) until it is closed."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.block = mmap.mmap(-1, self.weight_bytes)
            for i in range(0, len(self.block), 4096):
                self.block[i] = 1

        def close(self):
            super().close()
            self.block.close()

    build = ResidentEngine.factory(weight_bytes=128 * 2**20)  # float32: 128 MiB; bfloat16: 64 MiB
    wl = Workload(suite="default", limit=2, max_new_tokens=4, repeats=2, warmup=0)
    quiet = BusySnapshot(load_average=None, cores=2, others_cores=0.0)
    sm = StepMeasurer(machine=cpu_machine(), workload=wl, requests=wl.requests(), min_effect=0.05, build=build, busy=lambda: quiet)
    base_plan = Plan(source="fake")
    base = build(base_plan)
    current, _ = sm.calibrate(base, "baseline")
    candidate_plan = base_plan.replace_section("hardware", dtype="bfloat16")
    assert candidate_plan.weights_key() != base_plan.weights_key()
    mode = sm.before_build(candidate_plan, base_plan)
    candidate = build(candidate_plan)
    cmp = sm.compare(candidate, current, mode=mode, objective="decode_tokens_per_s", label="dtype")
    assert mode == "interleaved" and cmp.info["memory"].startswith("peak_memory_mb from one round of each plan alone")
    assert base.model is None  # the previous model was released for the solo round
    solo, both = cmp.after.median("peak_memory_mb"), cmp.after.extra["interleaved_peak_memory_mb"]
    assert both - solo > 100  # the interleaved rounds held the 128 MiB previous model as well
    assert cmp.before.median("peak_memory_mb") - solo > 48  # 128 MiB -> 64 MiB of weights
    assert cmp.changes["peak_memory_mb"] < 0 and all(r["peak_memory_mb"] == solo for r in cmp.after.repeats)
    # Rolled back: the previous plan is loaded again for the next interleaved step, its own peak unchanged.
    sm.after_verdict(False, candidate, base_plan, mode)
    assert sm.previous is not None and sm.previous.plan == base_plan and sm.previous_solo_peak_mb == cmp.before.median("peak_memory_mb")


def test_a_step_that_shares_the_weights_adds_no_solo_round():
    """Same weights (a scheduling or decoding pass): one model is resident either way, so no round is added."""
    from fractal_opt.measure.busy import BusySnapshot
    from fractal_opt.pipeline.step_measurement import StepMeasurer
    from fractal_opt.testing import FakeEngine, cpu_machine
    from fractal_opt.tower.plan import Plan
    from fractal_opt.workloads.workload import Workload

    build = FakeEngine.factory()
    wl = Workload(suite="default", limit=2, max_new_tokens=4, repeats=2, warmup=0)
    quiet = BusySnapshot(load_average=None, cores=2, others_cores=0.0)
    sm = StepMeasurer(machine=cpu_machine(), workload=wl, requests=wl.requests(), min_effect=0.05, build=build, busy=lambda: quiet)
    base = build(Plan(source="fake"))
    current, _ = sm.calibrate(base, "baseline")
    candidate_plan = Plan(source="fake").replace_section("application", max_new_tokens=2)
    assert candidate_plan.weights_key() == base.plan.weights_key()
    candidate = build(candidate_plan)
    served = base.served + candidate.served
    cmp = sm.compare(candidate, current, mode=sm.before_build(candidate_plan, base.plan), objective="e2e_ms", label="cap")
    assert "memory" not in cmp.info and base.model is not None
    assert base.served + candidate.served - served == 2 * 2 * len(cmp.after.repeats)  # interleaved rounds only
