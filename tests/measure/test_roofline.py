"""Roofline arithmetic and the bottleneck label of a measured step."""

from __future__ import annotations

import pytest

from fractal_opt.measure.roofline import BOUND_FRACTION, bound_label, decode_ceiling_tokens_per_s, prefill_flops, step_roofline


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
