"""Roofline arithmetic and the bottleneck label of a measured step."""

from __future__ import annotations

import pytest

from fractal_opt.measure.roofline import BOUND_FRACTION, ModelShape, bound_label, decode_ceiling_tokens_per_s, prefill_flops, step_roofline, unreliable_shares


def test_decode_ceiling_is_bandwidth_over_bytes_per_step():
    """1 GB of weights at 20 GB/s decode at most 20 tokens/s; a batch of 4 shares the weight read (KV 0)."""
    assert decode_ceiling_tokens_per_s(weight_read_bytes=1e9, kv_bytes_per_token=0, context=100, batch=1, bandwidth_bytes_per_s=20e9) == pytest.approx(20.0)
    assert decode_ceiling_tokens_per_s(weight_read_bytes=1e9, kv_bytes_per_token=0, context=100, batch=4, bandwidth_bytes_per_s=20e9) == pytest.approx(80.0)
    # KV of 1,000 tokens x 1 MB per token doubles the bytes of a step: half the ceiling.
    assert decode_ceiling_tokens_per_s(weight_read_bytes=1e9, kv_bytes_per_token=1e6, context=1000, batch=1, bandwidth_bytes_per_s=20e9) == pytest.approx(10.0)


def test_prefill_flops_two_per_parameter_per_token():
    """A 100M-parameter model pre-filling 50 tokens costs 2 x 100M x 50 = 1e10 FLOPs."""
    assert prefill_flops(100_000_000, 50) == pytest.approx(1e10)


@pytest.mark.parametrize(
    ("bw", "fl", "cap", "label"),
    [
        (0.8, 0.1, 0.5, "bandwidth-bound"),
        (0.1, 0.7, 0.5, "compute-bound"),
        (0.2, 0.1, 0.5, "overhead-bound"),
        (0.8, 0.9, 0.95, "capacity-bound"),
        (None, None, None, "unknown"),
        (BOUND_FRACTION, None, None, "bandwidth-bound"),
    ],
)
def test_bound_label(bw, fl, cap, label):
    """Capacity first, then the larger speed fraction if it reaches half its ceiling, else overhead."""
    assert bound_label(bandwidth_fraction=bw, compute_fraction=fl, capacity_fraction=cap) == label


def test_step_roofline_numbers():
    """A step at 10 tokens/s reading 1 GB of weights + 100 KB x 150 tokens of KV achieves 10.15 GB/s, 50.75% of 20 GB/s."""
    r = step_roofline(weight_read_bytes=1e9, kv_bytes_per_token=1e5, params=500_000_000, prompt_tokens=100, new_tokens=100, batch=1,
                      decode_tokens_per_s=10.0, prefill_ms=1000.0, peak_memory_bytes=2e9, capacity_bytes=16e9,
                      bandwidth_bytes_per_s=20e9, peak_flops=1e12)
    assert r["mean_context_tokens"] == 150  # prompt + half the new tokens
    assert r["bytes_per_decode_step"] == 1e9 + 1e5 * 150
    assert r["achieved_bandwidth_gbs"] == pytest.approx(10.15)
    assert r["bandwidth_fraction"] == pytest.approx(0.5075)
    assert r["decode_ceiling_tokens_per_s"] == pytest.approx(20e9 / 1.015e9, rel=1e-3)
    assert r["achieved_gflops"] == pytest.approx(100.0)  # 2 x 5e8 x 100 FLOPs in 1 s
    assert r["compute_fraction"] == pytest.approx(0.1)
    assert r["capacity_fraction"] == pytest.approx(0.125)
    assert r["decode_bound"] == "bandwidth-bound" and r["prefill_bound"] == "overhead-bound" and r["bound"] == "bandwidth-bound"


def test_step_roofline_without_ceilings_still_reports_achieved():
    """Without a probe the achieved numbers are there and the label says unknown rather than guessing."""
    r = step_roofline(weight_read_bytes=1e9, kv_bytes_per_token=0, params=1, prompt_tokens=None, new_tokens=None, batch=1,
                      decode_tokens_per_s=5.0, prefill_ms=None, peak_memory_bytes=None, capacity_bytes=None,
                      bandwidth_bytes_per_s=None, peak_flops=None)
    assert r["achieved_bandwidth_gbs"] == pytest.approx(5.0) and r["bound"] == "unknown"
    assert "bandwidth_fraction" not in r


def test_a_share_above_the_ceiling_is_never_reported():
    """A prefill at 13x the probed compute ceiling: no compute share, no compute-bound label, the reading kept as unreliable."""
    r = step_roofline(weight_read_bytes=1e9, kv_bytes_per_token=0, params=500_000_000, prompt_tokens=100, new_tokens=10, batch=1,
                      decode_tokens_per_s=30.0, prefill_ms=1000.0, peak_memory_bytes=None, capacity_bytes=None,
                      bandwidth_bytes_per_s=20e9, peak_flops=1e11 / 13.17)  # achieved: 2 x 5e8 x 100 FLOPs in 1 s = 1e11
    assert "compute_fraction" not in r and r["unreliable"] == {"bandwidth_fraction": pytest.approx(1.5), "compute_fraction": pytest.approx(13.17)}
    assert "bandwidth_fraction" not in r  # 30 GB/s achieved of a 20 GB/s ceiling: unreliable too
    assert r["prefill_bound"] == "unknown" and r["decode_bound"] == "unknown"
    assert all(0.0 <= v <= 1.0 for k, v in r.items() if k.endswith("_fraction"))
    assert unreliable_shares(r) == r["unreliable"] and unreliable_shares({"bandwidth_fraction": 0.4}) == {}


def _roofline_fixture(monkeypatch, reprobed_flops: float):
    """A StepMeasurer over a fake engine whose 'model' has SmolLM2's shape, and a measurement of it;
    the machine probe is replaced by one returning ``reprobed_flops``."""
    from fractal_opt.measure import busy
    from fractal_opt.measure.machine_limits import MachineLimits
    from fractal_opt.pipeline import step_measurement
    from fractal_opt.testing import FakeEngine, cpu_machine
    from fractal_opt.tower.plan import Plan
    from fractal_opt.workloads.workload import Workload

    shape = ModelShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, tied_embeddings=True)
    monkeypatch.setattr(step_measurement, "read_shape", lambda source: shape)
    probes = []

    def probe(device, **kwargs):
        probes.append(kwargs)
        return MachineLimits(device="cpu", bandwidth_bytes_per_s=1e12, copy_bandwidth_bytes_per_s=1e12, peak_flops={"float32": reprobed_flops})

    monkeypatch.setattr(step_measurement, "probe_limits", probe)
    low = MachineLimits(device="cpu", bandwidth_bytes_per_s=1e12, copy_bandwidth_bytes_per_s=1e12, peak_flops={"float32": 1e9})
    wl = Workload(suite="default", limit=2, max_new_tokens=4, repeats=1, warmup=0)
    quiet = busy.BusySnapshot(load_average=None, cores=2, others_cores=0.0)
    sm = step_measurement.StepMeasurer(machine=cpu_machine(), workload=wl, requests=wl.requests(), min_effect=0.05, limits=low,
                                       reprobe=True, busy=lambda: quiet)
    engine = FakeEngine.factory()(Plan(source="fake"))
    m, _ = sm.calibrate(engine, "baseline")
    return sm, engine, m, probes


def test_an_impossible_share_reprobes_once_and_then_reports_the_new_ceiling(monkeypatch):
    """The fake prefills 135M parameters x ~1000 tokens in 1 ms (far above a 1 GFLOP/s probe): the ceilings are probed
    again (refresh, at the model's shape) and the share against the new ceiling is reported."""
    sm, engine, m, probes = _roofline_fixture(monkeypatch, reprobed_flops=1e16)
    r = sm.roofline(engine, m)
    assert len(probes) == 1 and probes[0]["refresh"] is True and probes[0]["shape"].hidden == 576
    assert "unreliable" not in r and 0 < r["compute_fraction"] <= 1 and r["reprobed"]["peak_flops"] == 1e16
    sm.roofline(engine, m)
    assert len(probes) == 1  # once per run


def test_a_share_still_impossible_after_the_reprobe_says_probe_unreliable(monkeypatch):
    """A compute share still above the ceiling after one reprobe is not reported: the note says the probe is unreliable."""
    sm, engine, m, probes = _roofline_fixture(monkeypatch, reprobed_flops=1e9)
    r = sm.roofline(engine, m)
    assert len(probes) == 1 and "compute_fraction" not in r and r["prefill_bound"] == "unknown"
    assert r["note"].startswith("probe unreliable: compute ") and "of the probed ceiling" in r["note"]


def test_compute_probe_runs_f_linear_at_the_models_shapes_and_dtypes(monkeypatch):
    """The compute ceiling is F.linear of a prompt's worth of tokens through the model's own widths, in each dtype."""
    import torch
    import torch.nn.functional as F

    from fractal_opt.measure import machine_limits

    seen = []
    real = F.linear

    def spy(x, w, *args, **kwargs):
        seen.append((tuple(x.shape), tuple(w.shape), x.dtype, w.dtype))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    monkeypatch.setattr(machine_limits, "_CPU_BYTES", 4 * 2**20)
    monkeypatch.setattr(machine_limits, "_PROBE_TOKENS", 32)
    shape = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=160, vocab=100)
    assert machine_limits.linear_shapes(shape) == [(64, 64), (64, 160)] and machine_limits.linear_shapes(None) == []
    limits = machine_limits._measure("cpu", machine_limits.linear_shapes(shape))
    assert {(x, w, d) for x, w, d, _ in seen} == {((32, 64), (64, 64), torch.float32), ((32, 64), (160, 64), torch.float32),
                                                  ((32, 64), (64, 64), torch.bfloat16), ((32, 64), (160, 64), torch.bfloat16)}
    assert all(xd == wd for _, _, xd, wd in seen)
    assert limits.flops_shapes["bfloat16"] == [[32, 64, 64], [32, 64, 160]]
    assert set(limits.peak_flops) == {"float32", "bfloat16"} and all(v > 0 for v in limits.peak_flops.values())
    assert set(limits.bandwidth_by_dtype) == {"float32", "bfloat16"} and limits.bandwidth_for("bfloat16") == limits.bandwidth_by_dtype["bfloat16"]
    assert limits.bandwidth_for("int8") == limits.bandwidth_bytes_per_s  # not probed: the float32 reading


def test_compute_probe_keeps_a_cpu_call_short_for_wide_models():
    """A 7B model's 4096 x 11008 MLP at 512 tokens is 46 GFLOP: on a CPU the probe uses fewer rows (<= 2 GFLOP per call)."""
    from fractal_opt.measure import machine_limits

    rows = machine_limits._probe_tokens(False, 4096, 11008)
    assert machine_limits._MIN_PROBE_TOKENS <= rows < 512 and 2 * rows * 4096 * 11008 <= machine_limits._CPU_MAX_FLOP
    assert machine_limits._probe_tokens(False, 576, 1536) == 512 and machine_limits._probe_tokens(True, 4096, 11008) == machine_limits._GPU_PROBE_TOKENS


def test_probe_cache_is_per_model_shape(machine):
    """Ceilings probed at one model's widths are not reused for another's (the fingerprint holds the shapes)."""
    from fractal_opt.measure.machine_limits import fingerprint

    assert fingerprint(machine, "cpu", 2, "t", [(576, 576), (576, 1536)]) != fingerprint(machine, "cpu", 2, "t", [(4096, 4096), (4096, 11008)])
    assert fingerprint(machine, "cpu", 2, "t") == fingerprint(machine, "cpu", 2, "t", [])
