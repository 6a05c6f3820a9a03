"""The screen: one short paired round decides whether a candidate gets the full rounds.

A search tries many candidates; most are far behind the kept plan, and one A B round shows it.
The screen serves the candidate and the kept plan once each (the first round of the comparison
the full verdict would run, so a candidate that passes pays nothing extra) and computes the
objective's **screen interval**: the round's paired change with a 95% interval as wide as the
larger of

- the spread of the round's own requests (their paired log-ratios, a t interval over them), and
- the run's round-to-round noise: the A/A calibration's interval of the objective says how far one
  round's log-ratio strays from the truth on this machine (its half-width at ``n`` rounds is
  ``t(n-1) x sd / sqrt(n)``, so one round strays ``t(n-1) x sd``); once the full comparisons
  against the current kept plan give enough rounds (:class:`KeptNoise`), their own spread instead.

The candidate goes on to the full rounds and the quality gate when that interval still reaches
past the kept plan by ``min_effect`` (:func:`can_still_beat`): a candidate that is unlucky in its
first round but faster over full rounds is within the interval and is kept going. Only a
candidate whose whole interval stays short of ``+min_effect`` is stopped (``screened_out``).

Example:
    >>> from fractal_opt.measure.noise import Interval
    >>> can_still_beat(Interval(-0.03, -0.12, 0.07, 4), "decode_tokens_per_s", min_effect=0.05)
    True
    >>> can_still_beat(Interval(-0.30, -0.36, -0.24, 4), "decode_tokens_per_s", min_effect=0.05)
    False
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .metrics import METRICS, Measurement
from .noise import CONFIDENCE, Interval, paired_interval, t_quantile

__all__ = ["MIN_DF", "SCREEN_ROUNDS", "KeptNoise", "can_still_beat", "round_noise", "screen_interval", "screen_record"]

# One A B round: the cheapest paired comparison there is. The interval then leans on the
# calibration's round-to-round noise, which the A/A rounds measured on this machine.
SCREEN_ROUNDS = 1
# Degrees of freedom the kept plan's own comparisons must give before their noise replaces the
# calibration's (two comparisons of 3 rounds): fewer would let one lucky pair make screens too bold.
MIN_DF = 4


def round_noise(calibration: Mapping[str, Any], metric: str) -> tuple[float, int] | None:
    """How far one round's log-ratio of ``metric`` strays on this machine, as the 95% half-width
    of a single round (log scale) and the degrees of freedom behind it, from the A/A calibration
    record (its ``intervals`` and ``rounds``); None when the calibration has no interval for it."""
    found = _round_sd((calibration.get("intervals") or {}).get(metric), int(calibration.get("rounds") or 0))
    return None if found is None else (t_quantile(1 - (1 - CONFIDENCE) / 2, found[1]) * found[0], found[1])


def _round_sd(bounds: Sequence[float] | None, rounds: int) -> tuple[float, int] | None:
    """One round's log-ratio standard deviation and its degrees of freedom, from a comparison's 95%
    t interval over ``rounds`` rounds (its half-width is ``t(n-1) x sd / sqrt(n)``)."""
    if not bounds or rounds < 2 or min(bounds) <= -1:
        return None
    low, high = bounds
    half = (math.log1p(high) - math.log1p(low)) / 2  # the interval's half-width in log units
    return half * math.sqrt(rounds) / t_quantile(1 - (1 - CONFIDENCE) / 2, rounds - 1), rounds - 1


class KeptNoise:
    """How far one paired round strays when the kept plan is measured against its candidates,
    pooled over the full comparisons made against the current kept plan (each one's rounds about
    its own mean change). The A/A calibration measures the baseline against itself (the float32
    model, the slowest and noisiest rounds of a run); once a faster plan is kept, the pairs a screen
    compares are that plan against its variants, and their own rounds say how far one strays.
    Used once the pooled rounds give :data:`MIN_DF` degrees of freedom; :meth:`reset` when a
    candidate is kept (a new plan, a new noise).

    Example:
        >>> noise = KeptNoise()
        >>> noise.learn({"decode_tokens_per_s": [-0.02, 0.02]}, rounds=3)
        >>> noise.noise("decode_tokens_per_s") is None   # 2 degrees of freedom: not yet
        True
        >>> noise.learn({"decode_tokens_per_s": [-0.02, 0.02]}, rounds=3)
        >>> half, df = noise.noise("decode_tokens_per_s"); round(half, 4), df
        (0.0223, 4)
    """

    def __init__(self) -> None:
        self._seen: dict[str, list[tuple[float, int]]] = {}

    def learn(self, intervals: Mapping[str, Sequence[float]], *, rounds: int) -> None:
        """Add a full comparison's intervals over ``rounds`` rounds against the kept plan."""
        for metric, bounds in intervals.items():
            if (found := _round_sd(bounds, rounds)) is not None:
                self._seen.setdefault(metric, []).append(found)

    def reset(self) -> None:
        self._seen.clear()

    def noise(self, metric: str) -> tuple[float, int] | None:
        """One round's 95% half-width (log scale) and degrees of freedom, pooled; None below MIN_DF."""
        seen = self._seen.get(metric) or []
        df = sum(d for _, d in seen)
        if df < MIN_DF:
            return None
        sd = math.sqrt(sum(d * s * s for s, d in seen) / df)
        return t_quantile(1 - (1 - CONFIDENCE) / 2, df) * sd, df


def screen_interval(before: Measurement, after: Measurement, metric: str, *, calibration: Mapping[str, Any],
                    noise: tuple[float, int] | None = None) -> Interval | None:
    """The screen's change of ``metric`` with its 95% interval (see the module's note); None when
    the round gave no pair for it. ``noise``: one round's half-width from the kept plan's own
    comparisons (:class:`KeptNoise`), used instead of the calibration's when given."""
    from .runner import paired_changes

    own = paired_changes(before, after, [metric]).get(metric)
    if own is None:
        return None
    logs = _request_logs(before, after, metric)
    spread = paired_interval({i: [x] for i, x in enumerate(logs)}) if len(logs) > 1 else None  # the requests as the units
    est = math.log1p(own.change)
    half = 0.0 if spread is None else max(math.log1p(spread.high) - est, est - math.log1p(spread.low))
    noise = noise or round_noise(calibration, metric)
    if noise is not None:
        half = max(half, noise[0])
    return Interval(own.change, math.exp(est - half) - 1, math.exp(est + half) - 1, own.pairs)


def can_still_beat(interval: Interval | None, metric: str, *, min_effect: float) -> bool:
    """Whether the screen interval reaches past the kept plan by ``min_effect`` on the better side
    of ``metric`` (higher tokens/s, lower latency). No interval (nothing measured): True, the
    full rounds decide."""
    if interval is None:
        return True
    return interval.high > min_effect if METRICS.get(metric, True) else interval.low < -min_effect


def screen_record(interval: Interval | None, metric: str, *, min_effect: float, before: Measurement, after: Measurement) -> dict[str, Any]:
    """What the trace keeps of a screen: the objective, its change and interval, the medians, the
    rounds, the rule and whether the candidate passed."""
    passed = can_still_beat(interval, metric, min_effect=min_effect)
    side = "above +" if METRICS.get(metric, True) else "below -"
    out: dict[str, Any] = {"metric": metric, "rounds": SCREEN_ROUNDS, "min_effect": min_effect, "passed": passed,
                           "rule": f"full rounds only when the screen's 95% interval reaches {side}{min_effect:.0%}",
                           "before": before.median(metric), "after": after.median(metric)}
    if interval is not None:
        out.update(change=round(interval.change, 4), interval=interval.to_list())
    return out


def _request_logs(before: Measurement, after: Measurement, metric: str) -> list[float]:
    """The paired log-ratios of ``metric`` per request of the round (per-request metrics only)."""
    first = {(s.request_id, s.repeat): getattr(s, metric, None) for s in before.samples}
    out = []
    for s in after.samples:
        va, vb = first.get((s.request_id, s.repeat)), getattr(s, metric, None)
        if va and vb and va > 0 and vb > 0:
            out.append(math.log(vb / va))
    return out
