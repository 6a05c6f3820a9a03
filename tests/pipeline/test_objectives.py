"""Which kept objectives the final confirmation requires, and which a later step traded away."""

from types import SimpleNamespace

from fractal_opt.pipeline.confirm import record
from fractal_opt.report.confirmation import traded_lines
from fractal_opt.pipeline.objectives import annotate, split_objectives

OBJECTIVE = {"hardware": "decode_tokens_per_s", "model": "decode_tokens_per_s", "scheduling": "throughput_tokens_per_s",
             "application": "e2e_ms"}.get


def step(layer, name, changes, bands, metrics=None):
    return SimpleNamespace(layer=layer, pass_name=name, changes=changes, bands=bands, metrics=metrics or {})


RUNTIME = step("hardware", "runtime", {"decode_tokens_per_s": 1.59}, {"decode_tokens_per_s": 0.72})


def test_batching_that_costs_decode_beyond_its_threshold_trades_the_hardware_objective():
    batching = step("scheduling", "batching", {"decode_tokens_per_s": -0.64, "throughput_tokens_per_s": 0.489},
                    {"decode_tokens_per_s": 0.10, "throughput_tokens_per_s": 0.055})
    required, traded = split_objectives([RUNTIME, batching], OBJECTIVE)
    assert required == ["throughput_tokens_per_s"]
    assert traded == {"decode_tokens_per_s": {"by": "scheduling/batching", "change": -0.64, "band": 0.1, "for": "throughput_tokens_per_s"}}
    assert traded_lines({"traded": traded})[0].startswith(
        "Traded: decode_tokens_per_s by scheduling/batching for throughput_tokens_per_s (-64.0% in that step, beyond its threshold ±10.0%")


def test_a_cost_within_the_later_steps_threshold_is_no_trade():
    batching = step("scheduling", "batching", {"decode_tokens_per_s": -0.08, "throughput_tokens_per_s": 0.2},
                    {"decode_tokens_per_s": 0.10, "throughput_tokens_per_s": 0.05})
    assert split_objectives([RUNTIME, batching], OBJECTIVE) == (["decode_tokens_per_s", "throughput_tokens_per_s"], {})


def test_a_later_step_on_the_same_objective_never_trades_it():
    quant = step("model", "quantize", {"decode_tokens_per_s": -0.5}, {"decode_tokens_per_s": 0.05})
    required, traded = split_objectives([RUNTIME, quant], OBJECTIVE)
    assert (required, traded) == (["decode_tokens_per_s"], {})


def test_lower_is_better_objectives_are_traded_when_they_rise():
    cap = step("application", "max_new_tokens", {"e2e_ms": -0.3}, {"e2e_ms": 0.05})
    batching = step("scheduling", "batching", {"e2e_ms": 0.4, "throughput_tokens_per_s": 0.5}, {"e2e_ms": 0.1, "throughput_tokens_per_s": 0.05})
    required, traded = split_objectives([cap, batching], OBJECTIVE)
    assert required == ["throughput_tokens_per_s"] and traded["e2e_ms"]["change"] == 0.4


def test_annotate_records_the_trade_and_the_drift_against_the_last_kept_step():
    from fractal_opt.measure.metrics import Measurement, Sample

    def measurement(tps):
        samples = [Sample(request_id="a", prompt_tokens=10, new_tokens=8, ttft_ms=100.0, prefill_ms=90.0, e2e_ms=180.0,
                          decode_tokens_per_s=90.0, hit_cap=True, repeat=r) for r in range(3)]
        return Measurement(samples=samples, repeats=[{"throughput_tokens_per_s": tps * (1 + 0.01 * r)} for r in range(3)], outputs={}, texts={})

    fields = record(measurement(16.0), measurement(37.0), mode="interleaved", note="n", objectives=["throughput_tokens_per_s"], min_effect=0.05)
    batching = step("scheduling", "batching", {"decode_tokens_per_s": -0.64}, {"decode_tokens_per_s": 0.1},
                    metrics={"throughput_tokens_per_s": 44.0})
    _, traded = split_objectives([RUNTIME, batching], OBJECTIVE)
    annotate(fields, kept=[RUNTIME, batching], traded=traded, objective_of=OBJECTIVE, calibration={"resolution": {}}, min_effect=0.05)
    assert fields["confirmation"]["traded"]["decode_tokens_per_s"]["by"] == "scheduling/batching"
    drift = fields["confirmation"]["drift"]
    assert drift["in_step"] == 44.0 and drift["agrees"] is False and round(drift["change"], 3) == round(37.0 * 1.01 / 44.0 - 1, 3)  # the final median: 37.0 x 1.01


def test_a_traded_objective_measured_alone_carries_its_numbers_and_its_drift():
    """With a one-request comparison in the confirmation, the trade records the objective there
    (medians, interval, verdict) and its drift against the step that kept it; the Traded line says both."""
    entry = {"clients": 1, "label": "at 1 client", "headline": False, "status": "confirmed",
             "metrics": {"decode_tokens_per_s": {"change": 2.07, "interval": [1.9, 2.2], "band": 0.08, "verdict": "better",
                                                 "baseline_median": 17.8, "final_median": 54.8}}}
    fields = {"status": "confirmed", "confirmation": {"metrics": {}, "at_loads": [{"clients": 4, "headline": True, "metrics": {}}, entry]}}
    runtime = step("hardware", "runtime", {"decode_tokens_per_s": 2.0}, {"decode_tokens_per_s": 0.1}, metrics={"decode_tokens_per_s": 55.3})
    batching = step("scheduling", "batching", {"decode_tokens_per_s": -0.64}, {"decode_tokens_per_s": 0.1})
    _, traded = split_objectives([runtime, batching], OBJECTIVE)
    annotate(fields, kept=[runtime, batching], traded=traded, objective_of=OBJECTIVE, calibration={"resolution": {"decode_tokens_per_s": 0.03}}, min_effect=0.05)
    alone = fields["confirmation"]["traded"]["decode_tokens_per_s"]["alone"]
    assert (alone["final_median"], alone["verdict"]) == (54.8, "better")
    assert alone["drift"]["step"] == "hardware/runtime" and alone["drift"]["in_step"] == 55.3 and alone["drift"]["agrees"]
    line = traded_lines(fields["confirmation"])[0]
    assert "not required to beat the baseline at this load; one request at a time, medians 17.8 -> 54.8, paired estimate +207.0% [95%: +190.0%, +220.0%]: better" in line
    assert line.endswith("; -0.9% against its own step (hardware/runtime: 55.3), within the calibrated noise ±5.0%."), line


def test_only_objectives_measured_one_at_a_time_in_their_step_are_measured_again_alone():
    """Decode kept on a one-slot plan is held to one request at a time; throughput kept with 4 in flight
    (continuous batching) and traded by a later cap is only reported: there is no one-at-a-time figure to hold it to."""
    from fractal_opt.pipeline.objectives import measured_alone
    from fractal_opt.tower.plan import Plan

    one_slot = Plan(source="m").replace_section("hardware", runtime="llama_cpp")
    batched = one_slot.replace_section("scheduling", batching="continuous", max_concurrency=4)
    runtime = step("hardware", "runtime", {"decode_tokens_per_s": 5.0}, {"decode_tokens_per_s": 0.2})
    runtime.plan = one_slot.to_dict()
    batching = step("scheduling", "batching", {"decode_tokens_per_s": -0.7, "throughput_tokens_per_s": 0.13},
                    {"decode_tokens_per_s": 0.05, "throughput_tokens_per_s": 0.1})
    batching.plan = batched.to_dict()
    cap = step("application", "max_new_tokens", {"throughput_tokens_per_s": -0.17, "e2e_ms": -0.06}, {"throughput_tokens_per_s": 0.05, "e2e_ms": 0.05})
    cap.plan = batched.to_dict()
    _, traded = split_objectives([runtime, batching, cap], OBJECTIVE)
    assert set(traded) == {"decode_tokens_per_s", "throughput_tokens_per_s"}
    assert measured_alone([runtime, batching, cap], traded, OBJECTIVE) == ["decode_tokens_per_s"]
    entry = {"clients": 1, "headline": False, "status": "confirmed",
             "metrics": {m: {"change": 1.0, "interval": [0.9, 1.1], "band": 0.05, "verdict": "better", "baseline_median": 10.0, "final_median": 20.0}
                         for m in ("decode_tokens_per_s", "throughput_tokens_per_s")}}
    fields = {"status": "confirmed", "confirmation": {"metrics": {}, "at_loads": [{"clients": 4, "headline": True, "metrics": {}}, entry]}}
    annotate(fields, kept=[runtime, batching, cap], traded=traded, objective_of=OBJECTIVE, calibration={"resolution": {}}, min_effect=0.05,
             alone=["decode_tokens_per_s"])
    assert "alone" in fields["confirmation"]["traded"]["decode_tokens_per_s"] and "alone" not in fields["confirmation"]["traded"]["throughput_tokens_per_s"]
