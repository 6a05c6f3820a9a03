"""One figure of the final plan against the baseline: a ratio when large, its interval only when it bounds it, a status."""

from __future__ import annotations

import doctest

from fractal_opt.report import figures
from fractal_opt.report.figures import Figure, change_text


def test_large_changes_read_as_ratios_small_ones_as_percentages():
    """+478% reads 5.78x and -62% 0.38x; +12% and -32% stay percentages."""
    assert [change_text(c) for c in (4.78, -0.62, 0.12, -0.321)] == ["5.78x", "0.38x", "+12.0%", "-32.1%"]


def test_an_interval_that_does_not_bound_its_change_is_not_printed():
    """+15.3% [-64%, +269%] is 'too few rounds to bound' and shows no interval; a tight one shows its numbers."""
    wide = Figure("decode_tokens_per_s", baseline=16.2, final=32.1, change=0.153, interval=(-0.64, 2.691), band=0.9, verdict="within noise")
    assert wide.status() == "too few rounds to bound" and wide.text() == "decode 16.2 -> 32.1 tokens/s per stream: +15.3%, too few rounds to bound"
    tight = Figure("e2e_ms", baseline=3680.0, final=2630.0, change=-0.321, interval=(-0.369, -0.269), band=0.05, verdict="better")
    assert tight.text(objective=True) == "answer time 3.68 -> 2.63 s: -32.1% [95%: -36.9%, -26.9%], confirmed"


def test_no_change_inside_the_threshold_is_within_noise_whatever_its_estimate():
    """An estimate near zero with its whole interval inside the ±5% threshold is 'within noise', not unbounded."""
    still = Figure("decode_tokens_per_s", baseline=20.0, final=20.1, change=0.005, interval=(-0.03, 0.04), band=0.05, verdict="within noise")
    assert still.status() == "within noise" and "[95%" not in still.text()


def test_statuses_say_better_or_worse_for_a_figure_that_is_not_an_objective():
    """Beyond noise, an objective is 'confirmed'; any other figure 'better' or 'worse beyond noise'."""
    itl = Figure("itl_ms_p90", baseline=13.0, final=31.5, change=1.42, interval=(1.1, 1.8), band=0.2, verdict="worse")
    assert itl.status() == "worse beyond noise" and itl.text() == "ITL p90 13.0 -> 31.5 ms: 2.42x [95%: 2.10x, 2.80x], worse beyond noise"
    census = Figure.from_entry("weight_mb", {"change": -0.549, "baseline": 513.0, "final": 231.0, "source": "census", "verdict": "better"}, clients=4, path="p")
    assert census.text() == "weights 513 -> 231 MB: 0.45x (census, exact)"


def test_dollars_per_million_tokens_are_written_per_thousand():
    """usd_per_m_tokens 2.0 -> 1.0 reads $0.002 -> $0.001 per 1,000 tokens."""
    cost = Figure("usd_per_m_tokens", baseline=2.0, final=1.0, change=-0.5, interval=(-0.55, -0.45), band=0.05, verdict="better")
    assert cost.values() == "$0.00200 -> $0.00100 per 1,000 tokens"


def test_docstring_example_holds():
    """The module's example is what Figure.text returns."""
    assert doctest.testmod(figures).failed == 0
