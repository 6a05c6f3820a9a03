"""Noise-aware comparison: paired ratios, a bootstrap interval, and the noise band of the verdict.

The rule (docs/metrics.md, "The verdict"): previous (A) and candidate (B) are served in the same
rounds; each (request, round) gives one paired log-ratio ``log(B / A)``. The change of a metric is

    exp(mean over requests of median over rounds of log(B/A)) - 1

(a geometric mean, so a short and a long prompt weigh the same; the median per request so one
stalled round does not decide). Its 95% interval is a stratified percentile bootstrap: rounds are
resampled with replacement within each request (``BOOTSTRAP`` resamples, fixed seed, so the same
numbers always give the same verdict). With a single round the requests' ratios are resampled as
one pool instead (a within-request spread needs two rounds). Per-repeat metrics (throughput, memory) pair round r of A
with round r of B and bootstrap over rounds.

The noise band a change must exceed is ``max(min_effect, inner half-width)``, where the inner
half-width is the distance from the estimate to the end of the interval nearer zero: a change then
counts exactly when it is larger than ``min_effect`` and its 95% interval excludes zero. The band is
widened to ``2 × |A/A change|`` of the calibration when A and B could not be interleaved (back to
back, the machine's drift between them is not cancelled by pairing).

What a machine can resolve at all is read from the A/A calibration (:func:`resolution`): when the
95% interval of the same plan measured against itself reaches X% from its estimate, a step's
interval on that machine is about as wide, its band about X%, so no verdict can see a change below it.

Example:
    >>> ci = paired_interval({"r1": [0.1, 0.1, 0.1], "r2": [0.1, 0.1, 0.1]})
    >>> round(ci.change, 4), round(ci.low, 4), round(ci.high, 4)
    (0.1052, 0.1052, 0.1052)
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["BOOTSTRAP", "CONFIDENCE", "Interval", "band", "paired_interval", "resolution", "settled"]

BOOTSTRAP = 1000  # resamples: percentile error of a 95% interval ~0.7 points of coverage at 1000
CONFIDENCE = 0.95
_SEED = 1234  # fixed: a verdict must not depend on the RNG state


@dataclass(frozen=True)
class Interval:
    """A relative change (+0.10 = 10% larger) with its bootstrap interval and the pairs behind it."""

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


def _estimate(logs_by_key: Sequence[Sequence[float]]) -> float:
    return statistics.fmean(statistics.median(v) for v in logs_by_key)


def paired_interval(logs: Mapping[str, Sequence[float]], *, resamples: int = BOOTSTRAP, confidence: float = CONFIDENCE) -> Interval | None:
    """Change and bootstrap interval from paired log-ratios ``{request id: [log(B/A) per round]}``.

    For per-repeat metrics pass a single key holding one log-ratio per round. None without pairs.
    """
    groups = [list(v) for v in logs.values() if v]
    if not groups:
        return None
    est = _estimate(groups)
    n_pairs = sum(len(g) for g in groups)
    if n_pairs == 1:
        return Interval(math.exp(est) - 1, math.exp(est) - 1, math.exp(est) - 1, n_pairs)
    rng = random.Random(_SEED)
    stats = []
    if all(len(g) == 1 for g in groups):
        # One round: no request has a spread of its own, so the requests' ratios are resampled
        # as one pool (their differences stand in for the noise; wider, never zero).
        pool = [g[0] for g in groups]
        for _ in range(resamples):
            stats.append(statistics.fmean(pool[rng.randrange(len(pool))] for _ in pool))
    else:
        for _ in range(resamples):
            stats.append(_estimate([[g[rng.randrange(len(g))] for _ in g] for g in groups]))
    stats.sort()
    tail = (1 - confidence) / 2
    lo = stats[int(tail * (resamples - 1))]
    hi = stats[int(math.ceil((1 - tail) * (resamples - 1)))]
    # The interval always contains the estimate (a percentile interval of a median can miss it).
    return Interval(math.exp(est) - 1, math.exp(min(lo, est)) - 1, math.exp(max(hi, est)) - 1, n_pairs)


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
