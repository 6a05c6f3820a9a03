"""Noise-aware comparison: paired ratios, a t interval over rounds, and the noise band of the verdict.

The rule (docs/metrics.md, "The verdict"): previous (A) and candidate (B) are served in the same
rounds, the order alternating A B / B A; each (request, round) gives one paired log-ratio
``log(B / A)``. A round is the unit of the comparison: its requests ran back to back on one machine
state, so they share that round's luck, while two rounds are measured seconds apart. Each round's
log-ratio is the mean over its requests (a geometric mean, so a short and a long prompt weigh the
same), and the change of a metric is

    exp(mean over rounds of the round log-ratios) - 1

with a 95% Student t interval over the rounds (``n - 1`` degrees of freedom). With a single round
its requests' log-ratios stand in for the rounds (they are the only spread there is). Per-repeat
metrics (throughput, memory) have one log-ratio per round already.

Why not a bootstrap: a percentile bootstrap of three rounds never reaches beyond the three
observed values, and three draws bracket their own median only 75% of the time, so a "95%"
interval from three rounds covered the truth far less often: on a quiet 2-core Intel Xeon VM, 2 of the first 7 A/A
trials of benchmarks/noise.py ended "worse" (docs/metrics.md has the run). A t interval
from three rounds is honest and wide (t = 4.3 at 2 degrees of freedom); the runner adds rounds
while it is not :func:`settled`, up to ``max_repeats``.

The noise band a change must exceed is ``max(min_effect, inner half-width)``, where the inner
half-width is the distance from the estimate to the end of the interval nearer zero: a change then
counts exactly when it is larger than ``min_effect`` and its 95% interval excludes zero. The band is
widened to ``2 × |A/A change|`` of the calibration when A and B could not be interleaved (back to
back, the machine's drift between them is not cancelled by pairing).

What a machine can resolve at all is read from the A/A calibration (:func:`resolution`): when the
95% interval of the same plan measured against itself reaches X% from its estimate, a step's
interval on that machine is about as wide, its band about X%, so no verdict can see a change below it.

Example:
    >>> ci = paired_interval({0: [0.1, 0.1], 1: [0.1, 0.1], 2: [0.1, 0.1]})
    >>> round(ci.change, 4), round(ci.low, 4), round(ci.high, 4)
    (0.1052, 0.1052, 0.1052)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CONFIDENCE", "Interval", "band", "paired_interval", "resolution", "settled", "t_quantile"]

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """A relative change (+0.10 = 10% larger) with its 95% interval and the pairs behind it."""

    change: float
    low: float
    high: float
    pairs: int

    @property
    def inner_half_width(self) -> float:
        """Distance from the estimate to the end of the interval on the side of zero: a change
        larger than this has an interval that excludes zero."""
        return self.change - self.low if self.change >= 0 else self.high - self.change

    @property
    def half_width(self) -> float:
        """The larger distance from the estimate to an end of the interval."""
        return max(self.high - self.change, self.change - self.low)

    def to_list(self) -> list[float]:
        return [round(self.low, 4), round(self.high, 4)]


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (exact for 1 and 2 degrees of freedom, else the Cornish-Fisher series of
    Abramowitz & Stegun 26.7.5, within 0.003 of the tables from 3 up). Written here because the
    standard library has only the normal distribution and scipy is not a dependency.

    Example:
        >>> round(t_quantile(0.975, 2), 3), round(t_quantile(0.975, 10), 3)
        (4.303, 2.228)
    """
    if df < 1:
        raise ValueError(f"df={df}: a t quantile needs at least one degree of freedom")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))
    z = statistics.NormalDist().inv_cdf(p)
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2) + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4))


def paired_interval(logs: Mapping[Any, Sequence[float]], *, confidence: float = CONFIDENCE) -> Interval | None:
    """Change and t interval from paired log-ratios grouped by round: ``{round: [log(B/A) per request]}``.

    For per-repeat metrics each round holds one log-ratio. None without pairs.
    """
    groups = [list(v) for v in logs.values() if v]
    if not groups:
        return None
    n_pairs = sum(len(g) for g in groups)
    # One round: its requests are the only spread there is (a round's requests share its luck, so
    # this is the narrower guess; the runner adds rounds while the verdict is unsettled).
    units = [statistics.fmean(g) for g in groups] if len(groups) > 1 else groups[0]
    est = statistics.fmean(units)
    if len(units) == 1:
        return Interval(math.exp(est) - 1, math.exp(est) - 1, math.exp(est) - 1, n_pairs)
    half = t_quantile(1 - (1 - confidence) / 2, len(units) - 1) * statistics.stdev(units) / math.sqrt(len(units))
    return Interval(math.exp(est) - 1, math.exp(est - half) - 1, math.exp(est + half) - 1, n_pairs)


def band(interval: Interval | None, *, min_effect: float, drift: float | None = None) -> float:
    """The relative change a metric must exceed to count as a change.

    ``max(min_effect, inner half-width of the interval, 2 × |drift|)``; ``drift`` is the
    calibration's A/A change, passed only when A and B were measured back to back.
    """
    width = interval.inner_half_width if interval is not None else 0.0
    return max(min_effect, width, 2 * abs(drift or 0.0))


def settled(interval: Interval | None, *, min_effect: float) -> bool:
    """True when more rounds would not change the verdict on this metric: the interval is no wider
    than ``min_effect`` on each side, or it lies entirely beyond ±``min_effect`` (a clear change)."""
    if interval is None:
        return True
    if interval.half_width <= min_effect:
        return True
    return interval.low > min_effect or interval.high < -min_effect


def resolution(intervals: Iterable[Interval | None]) -> float:
    """The smallest change an A/A calibration lets a verdict see: the largest half-width of the
    given A/A intervals (0.0 when there are none).

    Example:
        >>> round(resolution([Interval(0.02, -0.10, 1.02, 18), Interval(0.0, -0.02, 0.03, 6)]), 2)
        1.0
    """
    return max((iv.half_width for iv in intervals if iv is not None), default=0.0)
