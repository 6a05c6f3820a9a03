"""Capacity under SLOs: the highest offered load at which every SLO holds, found by a bracketing search.

The offered load is the profile's own knob (:meth:`fractal_opt.workloads.workload.LoadProfile.offered`):
arrivals per second for ``poisson``, users for ``conversations``, clients for ``closed``. A probe
serves the load at one level and is judged on the profile's SLOs at ``slo_percentile``:

- each SLO's percentile gets a 95% distribution-free interval (the order statistics whose ranks a
  binomial count of values below the true percentile reaches with 95% probability, normal
  approximation): the SLO is **met** when the whole interval is under the limit, **broken** when
  it is all above, and **straddles** otherwise (the requests measured cannot tell);
- a probe is broken when any SLO is broken or 1% or more of its requests did not finish (timeouts,
  rejections, errors; a cancel is the client's own), met when every SLO is met, and straddles
  otherwise.

The search (as SGLang's and guidellm's do against an SLA) starts at the profile's level, doubles
while probes are met (halves while they are not, down to :data:`MIN_FRACTION` of the start), then
bisects between the highest met level and the lowest level that was not until they are within
``capacity_resolution`` of each other (relative). The answer is the highest met level with its
interval ``[met, not met]``, and **indeterminate** when the probe at the interval's top straddled an
SLO: the capacity may then be higher than the answer says. Every probe's numbers are kept.

Example:
    >>> search = CapacitySearch(profile, run=lambda p: serve_at(p))   # doctest: +SKIP
    >>> search.run()["capacity"]                                       # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .metrics import percentile

if TYPE_CHECKING:
    from ..workloads.workload import LoadProfile
    from .load import LoadResult

__all__ = ["MAX_FAILED", "MIN_FRACTION", "CapacitySearch", "judge_probe", "quantile_interval"]

MAX_FAILED = 0.01  # a load at which 1% or more of the requests fail is over capacity, whatever the latencies
MIN_FRACTION = 1 / 64  # the search halves from the start at most six times before it says "none"
_Z95 = 1.96  # two-sided 95% normal quantile


def quantile_interval(values: Sequence[float], q: float) -> tuple[float, float] | None:
    """A 95% interval for the ``q``-th percentile (0-100) of the distribution ``values`` come from.

    Distribution-free: the count of values below the true percentile is Binomial(n, q/100), so the
    order statistics at ranks ``n p -/+ 1.96 sqrt(n p (1 - p))`` bracket it (ranks clipped to the
    sample: with few values the interval runs to the smallest or largest one).
    """
    if not values:
        return None
    xs = sorted(values)
    n, p = len(xs), q / 100
    half = _Z95 * math.sqrt(n * p * (1 - p))
    lo = max(0, math.floor(n * p - half) - 1)
    hi = min(n - 1, math.ceil(n * p + half))
    return xs[lo], xs[hi]


def judge_probe(result: LoadResult, profile: LoadProfile) -> dict[str, Any]:
    """One probe's verdict (met / broken / straddles) and the numbers behind it."""
    done = [r for r in result.records if r.status == "done"]
    counted = [r for r in result.records if r.status != "cancelled"]
    failed = (len(counted) - len(done)) / max(1, len(counted))
    slos: dict[str, Any] = {}
    for name, limit in profile.slos().items():
        values = [v for r in done if (v := getattr(r, name)) is not None]
        interval = quantile_interval(values, profile.slo_percentile)
        value = percentile(values, profile.slo_percentile)
        if interval is None:
            verdict = "broken"  # nothing finished: no request met it
        elif interval[1] <= limit:
            verdict = "met"
        elif interval[0] > limit:
            verdict = "broken"
        else:
            verdict = "straddles"
        slos[name] = {"limit": limit, "value": _r(value), "interval": None if interval is None else [_r(interval[0]), _r(interval[1])], "verdict": verdict}
    verdicts = {s["verdict"] for s in slos.values()}
    if failed >= MAX_FAILED or "broken" in verdicts:
        verdict = "broken"
    elif verdicts <= {"met"}:
        verdict = "met"
    else:
        verdict = "straddles"
    summary = result.summary()
    return {"verdict": verdict, "failed": round(failed, 4), "requests": len(result.records), "slos": slos,
            "throughput_tokens_per_s": summary.get("throughput_tokens_per_s"), "ttft_ms_p90": summary.get("ttft_ms_p90")}


class CapacitySearch:
    """The bracketing search over one plan: ``run(profile_at_level)`` serves a probe and returns its LoadResult."""

    def __init__(self, profile: LoadProfile, *, run: Callable[[LoadProfile], LoadResult], integer: bool | None = None):
        self.profile = profile
        self.serve = run
        self.integer = profile.mode != "poisson" if integer is None else integer  # users and clients are whole numbers
        self.probes: list[dict[str, Any]] = []
        self.results: dict[float, LoadResult] = {}

    def probe(self, level: float) -> str:
        """Serve ``level`` (once: a level is never measured twice) and return its verdict."""
        for p in self.probes:
            if p["load"] == level:
                return p["verdict"]
        result = self.serve(self.profile.at_load(level))
        self.results[level] = result
        found = judge_probe(result, self.profile)
        self.probes.append({"load": level, **found})
        return found["verdict"]

    def run(self) -> dict[str, Any]:
        """Search; the answer with its interval, its status and every probe in the order served."""
        start = self._level(self.profile.offered())
        low, high = self._bracket(start)
        while low is not None and high is not None and not self._narrow(low, high):
            mid = self._level((low + high) / 2)
            if mid in (low, high):
                break
            if self.probe(mid) == "met":
                low = mid
            else:
                high = mid
        return self._answer(low, high)

    def _bracket(self, start: float) -> tuple[float | None, float | None]:
        """(highest met, lowest not met) after growing or shrinking from ``start``; None where not found."""
        floor = self._level(max(start * MIN_FRACTION, 1.0 if self.integer else 0.0))
        level = start
        if self.probe(level) == "met":
            while level < self.profile.capacity_max:
                nxt = self._level(min(level * 2, self.profile.capacity_max))
                if self.probe(nxt) != "met":
                    return level, nxt
                level = nxt
            return level, None
        while level > floor:
            nxt = self._level(max(level / 2, floor))
            if nxt == level:
                break
            if self.probe(nxt) == "met":
                return nxt, level
            level = nxt
        return None, level

    def _narrow(self, low: float, high: float) -> bool:
        return high - low <= self.profile.capacity_resolution * high or (self.integer and high - low <= 1)

    def _level(self, value: float) -> float:
        return float(max(1, round(value))) if self.integer else round(value, 4)

    def _answer(self, low: float | None, high: float | None) -> dict[str, Any]:
        verdict_at = {p["load"]: p["verdict"] for p in self.probes}
        unit = {"poisson": "requests/s", "conversations": "users", "closed": "clients"}[self.profile.mode]
        if low is None:
            status, text = "none", f"none: {high:g} {unit} already breaks an SLO (the lowest load tried)"
        elif high is None:
            status, text = "at least", f"{low:g} {unit} or more (capacity_max; no load up to it broke an SLO)"
        elif verdict_at.get(high) == "straddles":
            status, text = "indeterminate", f"{low:g} {unit}, indeterminate: at {high:g} an SLO's interval straddles its limit"
        else:
            status, text = "found", f"{low:g} {unit} (interval {low:g} - {high:g})"
        return {"capacity": low, "interval": [low, high], "status": status, "unit": unit, "answer": f"capacity under the SLOs: {text}",
                "slo_percentile": self.profile.slo_percentile, "probes": list(self.probes)}


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
