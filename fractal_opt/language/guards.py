"""Guards: limits on one metric each, every one checked by its own small rule.

A guard is ``metric: {min | max | max_regression | max_drop: number, accept_unknown: bool}``:

- ``min`` / ``max``: an absolute limit on the step's value (an SLO, a quality bound). An absolute
  speed or memory limit that the previous plan already breaks trips only when the step is further
  from it (a later step may still meet it); quality limits always trip.
- ``max_regression``: at most this relative change for the worse against the previous kept plan,
  beyond the metric's noise band.
- ``max_drop``: at most this absolute decrease against the baseline (e.g. eval accuracy). For
  ``accuracy`` with the paired counts of the same questions (``eval_lost`` / ``eval_gained``), the
  decrease must also be beyond noise: a one-sided sign test below :data:`WORSE_P`, or a drop over
  :data:`CERTAIN_DROP`.
- ``accept_unknown``: see below.
- ``judged_by``: another metric that decides when this one trips and that one was measured. The
  default ``agreement`` guard is ``{min: 0.5, judged_by: accuracy}``: greedy agreement on a few
  prompts is a coarse statistic (harmless changes scored 0.61 and up on the default suite,
  docs/quality.md), so an agreement under its floor says the answers changed more than harmless
  changes make them, not that they are wrong; where the paired eval was scored, it decides between
  "reworded" (no more questions lost than gained: the agreement is a note) and "wrong" (a net loss,
  however small: the agreement guard trips, saying so). Without an eval it trips.

**Only exact values are judged.** A quality number that could not be measured on the step's
runtime (``None``), or a KL that is only a lower bound (a runtime that gives its top-k rows only:
:func:`fractal_opt.quality.probes.is_lower_bound`), is *unknown*: the bound could hide any true
value above the limit, so an unknown guard trips, unless the recipe says ``accept_unknown: true``
for it, and the verdict says which. A metric the step did not measure at all (no eval set, no load
profile) is not in force.

A number that is not finite (NaN, infinite) trips every guard that watches it: ``NaN > 0.05`` is
False, so a plain comparison would let it pass.

Example:
    >>> g = Guard(metric="kl_mean", max=0.05)
    >>> g.check(Evidence(after={"kl_mean": 0.2, "kl_method": "full"})).trips
    ['guard kl_mean max 0.05 tripped: 0.2']
    >>> g.check(Evidence(after={"kl_mean": 0.001, "kl_method": "top-k lower bound (k=20)"})).trips[0][:30]
    'guard kl_mean unknown: only a l'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..core.text import fmt, interval_text
from ..measure.metrics import METRICS

__all__ = ["ALL_METRICS", "CENSUS_METRICS", "QUALITY_METRICS", "WORSE_P", "Evidence", "Finding", "Guard", "finite", "fmt", "move"]

QUALITY_METRICS: dict[str, bool] = {  # metric -> True when higher is better
    "kl_mean": False,
    "kl_p99": False,
    "kl_max": False,
    "top1_flip": False,
    "ppl_ratio": False,
    "ppl_ratio_low": False,
    "ppl_ratio_high": False,
    "agreement": True,
    "similarity": True,
    "accuracy": True,
    "eval_lost": False,
    "eval_required_lost": False,
    "path_agreement": True,
}
# Read from the engine's census, not a clock: the bytes the plan's weights hold. Guarded because
# peak RSS cannot show a weight change while the previous plan's model is resident for interleaved
# measurement (docs/metrics.md).
CENSUS_METRICS: dict[str, bool] = {"weight_mb": False}
ALL_METRICS = {**METRICS, **QUALITY_METRICS, **CENSUS_METRICS}
LIMITS = ("min", "max", "max_regression", "max_drop")
# The accuracy guard's "worse beyond noise": a drop counts when a one-sided sign test on the eval
# questions that changed verdict gives p below this. On the packaged basics set's first 40 questions the
# harmless changes measured (bf16, threads, eager attention, prepacked weights, bf16 on llama.cpp)
# lost 0-1 questions; Q4_1 kernels lost 5 and gained 0 (p=0.031), docs/quality.md.
WORSE_P = 0.10
# A drop in accuracy larger than this trips whatever the sign test says: an eval set of a handful of
# questions cannot reach significance (3 lost of 3 gives p=0.125), and losing that much is no noise.
CERTAIN_DROP = 0.10


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """The numbers a verdict is made of: metric medians before and after (quality included),
    paired relative changes, noise bands, the baseline's numbers and the changes' 95% intervals."""

    after: dict[str, Any]
    before: dict[str, Any] = field(default_factory=dict)
    changes: dict[str, float | None] = field(default_factory=dict)
    bands: dict[str, float] = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)
    intervals: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """What one guard found: its trips, its notes (what it did not judge, and why), and whether it
    had a number to judge (``in_force``)."""

    trips: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    in_force: bool = False


@dataclass(frozen=True, kw_only=True)
class Guard:
    """A limit on one metric (see the module docstring for each kind)."""

    metric: str
    min: float | None = None
    max: float | None = None
    max_regression: float | None = None
    max_drop: float | None = None
    accept_unknown: bool = False
    judged_by: str | None = None  # a metric that decides instead when this guard trips and it was measured

    def describe(self) -> str:
        limits = ((k, getattr(self, k)) for k in LIMITS)
        parts = [f"{k} {v:.0%}" if k == "max_regression" else f"{k} {v:g}" for k, v in limits if v is not None]  # max_regression is relative
        return f"{self.metric} " + ", ".join(parts)

    def check(self, ev: Evidence) -> Finding:
        """Judge the step's numbers against this guard."""
        if self.metric not in ev.after:
            return Finding()  # not measured by this step: not in force
        value = ev.after[self.metric]
        if (why := self.unknown(ev.after)) is not None:
            if self.accept_unknown:
                note = f"guard {self.metric} unknown ({why}): accepted (accept_unknown)"
                if finite(value) and self.max is not None and value > self.max:  # a lower bound already above the limit: the value is too
                    return Finding(trips=[f"guard {self.metric} max {self.max:g} tripped: its lower bound {fmt(value)} is already above"], notes=[note], in_force=True)
                return Finding(notes=[note], in_force=True)
            return Finding(trips=[f"guard {self.metric} unknown: {why}; a guard is judged only on an exact value "
                                  f"(accept_unknown: true under policy.guards.{self.metric} accepts it)"], in_force=True)
        if value is None:
            return Finding()  # a speed number this step has none of (e.g. no load profile)
        if not finite(value):
            return Finding(trips=[f"guard {self.describe()} tripped: {self.metric} is not finite ({value!r})"], in_force=True)
        trips, notes = self._absolute(value, ev)
        trips += self._drop(value, ev) + self._regression(ev)
        if trips and self.judged_by and finite(ev.after.get(self.judged_by)):
            if self._judge_holds(ev):
                return Finding(notes=[*notes, *(f"{t}, {self._deferred(ev)}" for t in trips)], in_force=True)
            return Finding(trips=[f"{t}, {self._deferred(ev, holds=False)}" for t in trips], notes=notes, in_force=True)
        return Finding(trips=trips, notes=notes, in_force=True)

    def _judge_holds(self, ev: Evidence) -> bool:
        """The deciding metric is no worse than the baseline's: for the eval, no more questions lost
        than gained. Under this guard's floor the answers changed more than harmless changes make
        them, so any net loss counts as wrong, however few questions changed."""
        assert self.judged_by is not None
        higher = ALL_METRICS.get(self.judged_by, True)
        after, base = ev.after.get(self.judged_by), ev.baseline.get(self.judged_by)
        if not finite(base):
            return True
        return after >= base if higher else after <= base

    def _deferred(self, ev: Evidence, *, holds: bool = True) -> str:
        """Why a trip of this guard is a note (the metric it defers to held: reworded), or stands (it got worse: wrong)."""
        a = ev.after
        paired = f" (lost {a.get('eval_lost')}, gained {a.get('eval_gained')} of {a.get('eval_total')} questions)" if "eval_lost" in a else ""
        base = fmt(ev.baseline.get(self.judged_by))
        if holds:
            return (f"more than harmless changes move it on this workload, and {self.judged_by} {fmt(a.get(self.judged_by))}{paired} is no worse "
                    f"than the baseline's {base}: the answers are reworded, not wrong")
        return (f"more than harmless changes move it on this workload, and {self.judged_by} {fmt(a.get(self.judged_by))}{paired} is below "
                f"the baseline's {base}: the answers are wrong, not reworded")

    def unknown(self, after: dict[str, Any]) -> str | None:
        """Why this guard's quality number is not an exact value, or None when it is."""
        if self.metric not in QUALITY_METRICS:
            return None
        if after.get(self.metric) is None:
            return f"not measurable on this runtime ({after.get('kl_method') or 'no value'})"
        if self.metric.startswith("kl_") and str(after.get("kl_method") or "").startswith("top-k lower bound"):
            return f"only a lower bound ({after['kl_method']}), which can hide any true value above the limit"
        return None

    def _absolute(self, value: float, ev: Evidence) -> tuple[list[str], list[str]]:
        trips, notes = [], []
        prev = ev.before.get(self.metric)
        for bound, limit, broken in (("max", self.max, _above), ("min", self.min, _below)):
            if limit is None or not broken(value, limit):
                continue
            # A speed or memory limit (an SLO) the previous plan already breaks does not block a
            # step that is no further from it: the step is judged on its objective, and a later
            # step (batching, a concurrency limit) may still meet the SLO. Quality limits always trip.
            if self.metric in METRICS and prev is not None and finite(prev) and broken(prev, limit) and not broken(value, prev):
                notes.append(f"guard {self.metric} {bound} {limit:g} not met before or after ({fmt(prev)} -> {fmt(value)}): not a regression, not tripped")
                continue
            which = f" ({', '.join(ev.after.get('eval_required_lost_ids') or [])} answered wrong, the baseline right)" if self.metric == "eval_required_lost" else ""
            trips.append(f"guard {self.metric} {bound} {limit:g} tripped: {fmt(value)}{which}")
        return trips, notes

    def _drop(self, value: float, ev: Evidence) -> list[str]:
        base = ev.baseline.get(self.metric)
        if self.max_drop is None or base is None:
            return []
        if not finite(base):
            return [f"guard {self.metric} max_drop {self.max_drop:g} tripped: the baseline's {self.metric} is not finite ({base!r})"]
        if base - value <= self.max_drop:
            return []
        drop = f"guard {self.metric} max_drop {self.max_drop:g} tripped: {fmt(base)} at baseline -> {fmt(value)}"
        if self.metric == "accuracy" and finite(p := ev.after.get("eval_worse_p")):
            # The same questions answered by both plans: the items that changed verdict decide
            # whether the drop is beyond noise (a one-sided sign test, quality.evals.sign_test_worse).
            paired = f"lost {ev.after.get('eval_lost')}, gained {ev.after.get('eval_gained')} of {ev.after.get('eval_total')} questions"
            if p < WORSE_P:
                return [f"{drop} ({paired}; sign test p={p:.3g} < {WORSE_P:g})"]
            if base - value > CERTAIN_DROP:  # a small eval set cannot reach significance: a drop this large still counts
                return [f"{drop} ({paired}; a drop over {CERTAIN_DROP:g} counts without the sign test, p={p:.3g})"]
            return []  # a drop this few changed answers can give by chance: not beyond noise
        return [drop]

    def _regression(self, ev: Evidence) -> list[str]:
        change = ev.changes.get(self.metric)
        if self.max_regression is None or change is None:
            return []
        if not finite(change):
            return [f"guard {self.metric} max_regression {self.max_regression:.0%} tripped: its change is not finite ({change!r})"]
        worse = -change if ALL_METRICS.get(self.metric, True) else change
        if worse > self.max_regression + ev.bands.get(self.metric, 0.0):  # worse beyond noise
            return [f"guard {self.metric} max_regression {self.max_regression:.0%} tripped: {move(self.metric, ev, change)}"]
        return []


def _above(v: float, limit: float) -> bool:
    return v > limit


def _below(v: float, limit: float) -> bool:
    return v < limit


def finite(v: object) -> bool:
    """True for a real number that is neither NaN nor infinite (bools and None are not numbers here)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def move(metric: str, ev: Evidence, change: float) -> str:
    """A change as a reason quotes it, saying what the percentage is computed from.

    Census numbers (``weight_mb``) are exact, and their change is the ratio of the two figures
    printed next to it. Measured numbers change by the paired estimate (per request and round,
    :mod:`fractal_opt.measure.noise`), which is not the ratio of the two medians: the text names
    it, with its 95% interval when known, and labels the medians as medians.
    """
    b, a = fmt(ev.before.get(metric)), fmt(ev.after.get(metric))
    if metric in CENSUS_METRICS:
        return f"{change:+.1%} ({b} -> {a})"
    interval = ev.intervals.get(metric)
    ci = f" {interval_text(change, *interval)}" if interval and len(interval) == 2 else ""  # "too few rounds to bound" when it bounds nothing
    return f"paired estimate {change:+.1%}{ci}, medians {b} -> {a}"
