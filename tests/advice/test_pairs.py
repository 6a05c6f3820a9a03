"""Two plans' comparison: worse and better read in each metric's own direction, beyond the noise band only."""

from __future__ import annotations

from fractal_opt.advice.pairs import PairResult


def _pair(metric: str, change: float | None, band: float = 0.05) -> PairResult:
    return PairResult(metric=metric, before=100.0, after=None if change is None else 100.0 * (1 + change), change=change,
                      interval=None if change is None else (change - 0.01, change + 0.01), band=band)


def test_a_slower_decode_and_a_longer_ttft_are_both_worse():
    """-20% tokens/s and +20% ms are both worse: the direction is the metric's, not the sign's."""
    assert _pair("decode_tokens_per_s", -0.2).worse and not _pair("decode_tokens_per_s", -0.2).better
    assert _pair("ttft_ms", 0.2).worse and _pair("ttft_ms", -0.2).better


def test_a_change_inside_the_band_is_neither():
    """A 3% change inside a 5% band is 'within noise', in the text too."""
    pair = _pair("decode_tokens_per_s", 0.03)
    assert not pair.worse and not pair.better
    assert pair.text() == "decode_tokens_per_s 103.0 vs 100.0: +3.0% [95%: +2.0%, +4.0%], band ±5.0%: within noise"


def test_an_unmeasured_metric_is_neither_and_says_so():
    """No paired value: neither worse nor better, and the text says 'not measured' rather than a number."""
    pair = _pair("e2e_ms", None)
    assert not pair.worse and not pair.better and pair.text() == "e2e_ms: not measured"
    assert pair.to_dict()["change"] is None and pair.to_dict()["worse"] is False
