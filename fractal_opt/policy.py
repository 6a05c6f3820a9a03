"""Acceptance rules: objectives, guards and the noise band -> Verdict(kept, reason).

A pass is kept when its objective improves beyond the noise band and no guard trips. Each layer
has a natural objective because each attacks a different cost:

- hardware and model: ``decode_tokens_per_s`` of one request;
- scheduling: ``throughput_tokens_per_s`` (aggregate output tokens/s of the suite);
- application: ``e2e_ms`` (end-to-end latency per request).

Guards:
- quality, absolute against the baseline: ``kl_mean: {max: 0.05}`` by default (bfloat16 and int8
  weight-only stay far below it on SmolLM2; 4-bit and dynamic int8 go far above; docs/metrics.md);
- speed and memory, relative to the previous kept plan: every number on the layer's watch list may
  get at most ``max_regression`` (default 10%) worse beyond its noise band (the guard trips when
  the regression exceeds max_regression + band);
- latency for scheduling passes: TTFT p90 at most 50% and inter-token latency p90 at most 150%
  worse than the previous plan's (:data:`LATENCY_GUARDS`), so a batching that buys throughput by
  making every user wait several times longer is not kept by default;
- any metric by hand in the recipe: ``{min: x}``, ``{max: x}`` or ``{max_regression: r}``. An
  absolute speed or memory limit that the previous plan already breaks trips only when the
  candidate is further from it, so a step is not refused for an SLO that no plan so far meets
  (e.g. TTFT p90 under load before batching); quality limits always trip.

A number that is not finite (NaN, infinite) trips every guard that watches it, and an objective
that is not finite is never kept: ``NaN > 0.05`` is False, so a plain comparison would let it pass.

Reasons quote numbers a reader can check: a change printed as ``+21.1% (513.0 -> 621.0)`` is
computed from those two numbers (census figures); a measured change is the paired estimate, and
the text says so: ``paired estimate -29.3% [95%: -70.0%, +12.0%], medians 13.1 -> 13.7`` (the
medians come from the same rounds but are not what the percentage is computed from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import RecipeError, closest
from .measure.metrics import METRICS
from .passes import Layer

__all__ = ["DEFAULT_OBJECTIVES", "LATENCY_GUARDS", "Guard", "Policy", "Verdict"]

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
    "path_agreement": True,
}
# Read from the engine's census, not a clock: the bytes the plan's weights hold. Guarded because
# peak RSS cannot show a weight change while the previous plan's model is resident for interleaved
# measurement (docs/metrics.md).
CENSUS_METRICS: dict[str, bool] = {"weight_mb": False}
ALL_METRICS = {**METRICS, **QUALITY_METRICS, **CENSUS_METRICS}

DEFAULT_OBJECTIVES = {
    Layer.HARDWARE: "decode_tokens_per_s",
    Layer.MODEL: "decode_tokens_per_s",
    Layer.SCHEDULING: "throughput_tokens_per_s",
    Layer.APPLICATION: "e2e_ms",
}
# Numbers a layer's passes must not make worse by more than max_regression (besides the objective).
# Scheduling leaves per-request latency off this list: batching makes each request a little slower
# and the machine much more productive; its latency limits are the wider LATENCY_GUARDS below, and
# a recipe states its own SLOs as guards on top.
WATCH = {
    Layer.HARDWARE: ("decode_tokens_per_s", "ttft_ms", "throughput_tokens_per_s", "peak_memory_mb", "weight_mb"),
    Layer.MODEL: ("decode_tokens_per_s", "ttft_ms", "throughput_tokens_per_s", "peak_memory_mb", "weight_mb"),
    Layer.SCHEDULING: ("throughput_tokens_per_s",),
    Layer.APPLICATION: ("ttft_ms",),
}
DEFAULT_GUARDS = {"kl_mean": {"max": 0.05}, "accuracy": {"max_drop": 0.1}}  # accuracy only when an eval set is given
# What a scheduling pass may cost the people waiting (DESIGN.md: throughput is the objective, TTFT /
# ITL percentiles the guards), relative to the previous plan. On the project's 2-core CPU, static
# and continuous batching at 8 in flight raised ITL p90 by 74-133% over one-by-one serving while
# cutting TTFT p90 under load 1.6-16x (docs/passes.md, default suite), so 150% lets that normal
# trade through; a static batch handed the whole suite at once raised TTFT 16x (issue 16), which
# 50% refuses. A recipe's own guard on the same metric (an SLO such as ``ttft_ms_p90: {max: 4000}``)
# replaces these.
LATENCY_GUARDS: dict[Layer, dict[str, dict[str, float]]] = {
    Layer.SCHEDULING: {"ttft_ms_p90": {"max_regression": 0.5}, "itl_ms_p90": {"max_regression": 1.5}},
}


@dataclass(frozen=True, kw_only=True)
class Guard:
    """A limit on one metric: absolute ``min`` / ``max``, ``max_regression`` (relative, vs the
    previous kept plan, beyond noise) or ``max_drop`` (absolute decrease vs the baseline, e.g. accuracy)."""

    metric: str
    min: float | None = None
    max: float | None = None
    max_regression: float | None = None
    max_drop: float | None = None

    def describe(self) -> str:
        limits = (("min", self.min), ("max", self.max), ("max_regression", self.max_regression), ("max_drop", self.max_drop))
        parts = [f"{k} {v:.0%}" if k == "max_regression" else f"{k} {v:g}" for k, v in limits if v is not None]  # max_regression is relative
        return f"{self.metric} " + ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The judgement of one step, with the numbers that decided it."""

    kept: bool
    reason: str
    changes: dict[str, float] = field(default_factory=dict)  # metric -> relative change vs previous
    bands: dict[str, float] = field(default_factory=dict)  # metric -> noise band used
    # kept | no_change (objective within noise, no guard tripped) | worse | guard | unmeasured
    # (the objective has no number, or one that is not finite)
    outcome: str = ""
    guards: list[str] = field(default_factory=list)  # the guards in force that had a number to judge (Guard.describe)


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Recipe section ``policy``.

    Attributes:
        objective: the metric that must improve, or ``auto`` for each layer's default.
        guards: ``{metric: {min|max|max_regression: value}}``, merged over the defaults; a metric
            set to ``null`` removes its default guard.
        max_regression: default limit for the numbers on each layer's watch list (0.10 = 10%).
        min_effect: the smallest relative change that counts even on a quiet machine (0.05 = 5%).
        timeout_s: seconds one step (or the baseline) may take before it is ended as ``failed: timeout``.
    """

    objective: str = "auto"
    guards: dict[str, Any] = field(default_factory=dict)
    max_regression: float = 0.10
    # 5%: two quickstart runs of a pass that changed nothing (threads 2 -> 2) measured -1.6% and
    # +3.5% decode tokens/s on the project's 2-core CPU; a 3% floor let the second one count.
    min_effect: float = 0.05
    # Wall-clock limit of one step (build, measure, probes, judge) and of the baseline; a step
    # past it is recorded ``failed: timeout`` and the run goes on (None = no limit). Two hours:
    # the A/A baseline of a 7B model on a laptop CPU takes about one (load + 2 x the suite).
    timeout_s: float | None = field(default=7200.0, metadata={"bounds": (1, 7 * 86400)})

    def __post_init__(self) -> None:
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float)
                                           or not 1 <= self.timeout_s <= 7 * 86400):
            raise RecipeError(f"policy, key 'timeout_s': got {self.timeout_s!r}, expected seconds in [1, 604800] or null (no limit).")
        if self.objective != "auto" and self.objective not in METRICS:
            valid = ["auto", *METRICS]
            raise RecipeError(f"policy, key 'objective': unknown metric {self.objective!r}. Valid objectives are: {valid}.{closest(self.objective, valid)}")
        if not isinstance(self.guards, dict):
            raise RecipeError(f"policy, key 'guards': expected a mapping of metric -> {{min|max|max_regression: value}}, got {self.guards!r}.")
        for metric, spec in self.guards.items():
            if metric not in ALL_METRICS and "." not in metric:  # "probe.name" = a custom probe's number
                valid = sorted(ALL_METRICS)
                raise RecipeError(f"policy.guards: unknown metric {metric!r}. Valid metrics are: {valid}.{closest(metric, valid)}")
            if spec is None:
                continue
            if not isinstance(spec, dict) or not spec:
                raise RecipeError(f"policy.guards.{metric}: expected a mapping like {{max: 0.05}}, got {spec!r}.")
            for key, value in spec.items():
                if key not in ("min", "max", "max_regression", "max_drop"):
                    valid = ["max", "max_drop", "max_regression", "min"]
                    raise RecipeError(f"policy.guards.{metric}: unknown limit {key!r}. Valid limits are: {valid}.{closest(key, valid)}")
                if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                    raise RecipeError(f"policy.guards.{metric}.{key}: got {value!r}, expected a finite number.")
        for name in ("max_regression", "min_effect"):
            if not 0 <= getattr(self, name) < 10:
                raise RecipeError(f"policy, key {name!r}: got {getattr(self, name)}, expected a fraction like 0.1 (= 10%).")

    def objective_for(self, layer: Layer) -> str:
        return DEFAULT_OBJECTIVES[layer] if self.objective == "auto" else self.objective

    def guards_for(self, layer: Layer) -> list[Guard]:
        """Default guards of the layer, overridden and extended by the recipe's."""
        specs: dict[str, dict | None] = {m: {"max_regression": self.max_regression} for m in WATCH[layer] if m != self.objective_for(layer)}
        specs.update(DEFAULT_GUARDS)
        specs.update({m: dict(spec) for m, spec in LATENCY_GUARDS.get(layer, {}).items() if m != self.objective_for(layer)})
        if layer is Layer.SCHEDULING:
            # A serving path (batching, continuous batching) must give the same greedy tokens as
            # the path it replaces; a divergence is a quality regression, not a speed-up.
            specs["path_agreement"] = {"min": 1.0}
        specs.update(self.guards)
        return [Guard(metric=m, **spec) for m, spec in specs.items() if spec]

    def judge(
        self,
        layer: Layer,
        before: dict[str, float | None],
        after: dict[str, float | None],
        changes: dict[str, float | None],
        bands: dict[str, float],
        baseline: dict[str, float | None] | None = None,
        intervals: dict[str, list[float]] | None = None,
    ) -> Verdict:
        """Keep or roll back: ``before``/``after`` are metric medians (quality included),
        ``changes`` relative changes (paired), ``bands`` the noise band per metric, ``baseline``
        the baseline's numbers (for ``max_drop``), ``intervals`` the 95% interval ``[low, high]``
        of each paired change (quoted next to the estimate in the reason)."""
        objective = self.objective_for(layer)
        intervals = intervals or {}
        trips: list[str] = []
        notes: list[str] = []  # what the verdict could not judge, or judged on a bound
        in_force: list[str] = []

        def move(metric: str, change: float) -> str:
            return _move(metric, before, after, change, intervals.get(metric))

        for guard in self.guards_for(layer):
            value = after.get(guard.metric)
            if value is None:
                if guard.metric in QUALITY_METRICS and guard.metric in after:  # probed, not measurable (quality.probes kl_method)
                    notes.append(f"guard {guard.metric} not measurable on this runtime ({after.get('kl_method') or 'no value'})")
                continue
            in_force.append(guard.describe())
            if not _finite(value):  # NaN > limit is False: without this a NaN would pass every guard
                trips.append(f"guard {guard.describe()} tripped: {guard.metric} is not finite ({value!r})")
                continue
            if guard.metric.startswith("kl_") and str(after.get("kl_method", "full")).startswith("top-k"):
                notes.append(f"guard {guard.metric} judged a lower bound ({after['kl_method']}): it can only be too lenient")
            prev = before.get(guard.metric)
            for bound, limit, broken in (("max", guard.max, lambda v, lim: v > lim), ("min", guard.min, lambda v, lim: v < lim)):
                if limit is None or not broken(value, limit):
                    continue
                # A speed or memory limit (an SLO) the previous plan already breaks does not block a
                # step that is no further from it: the step is judged on its objective, and a later
                # step (batching, a concurrency limit) may still meet the SLO. Quality limits always trip.
                if guard.metric in METRICS and prev is not None and _finite(prev) and broken(prev, limit) and not broken(value, prev):
                    notes.append(f"guard {guard.metric} {bound} {limit:g} not met before or after ({_fmt(prev)} -> {_fmt(value)}): not a regression, not tripped")
                    continue
                trips.append(f"guard {guard.metric} {bound} {limit:g} tripped: {_fmt(value)}")
            base = (baseline or {}).get(guard.metric)
            if guard.max_drop is not None and base is not None:
                if not _finite(base):
                    trips.append(f"guard {guard.metric} max_drop {guard.max_drop:g} tripped: the baseline's {guard.metric} is not finite ({base!r})")
                elif base - value > guard.max_drop:
                    trips.append(f"guard {guard.metric} max_drop {guard.max_drop:g} tripped: {_fmt(base)} at baseline -> {_fmt(value)}")
            change = changes.get(guard.metric)
            if guard.max_regression is not None and change is not None:
                if not _finite(change):
                    trips.append(f"guard {guard.metric} max_regression {guard.max_regression:.0%} tripped: its change is not finite ({change!r})")
                    continue
                worse = -change if ALL_METRICS.get(guard.metric, True) else change
                limit = guard.max_regression + bands.get(guard.metric, 0.0)  # worse beyond noise
                if worse > limit:
                    trips.append(f"guard {guard.metric} max_regression {guard.max_regression:.0%} tripped: {move(guard.metric, change)}")
        change = changes.get(objective)
        band = bands.get(objective, self.min_effect)
        clean = {k: round(v, 4) for k, v in changes.items() if _finite(v)}  # trace.json is strict JSON: no NaN
        finite_bands = {k: v for k, v in bands.items() if _finite(v)}
        note = "".join(f"; {n}" for n in notes)
        tripped = "".join(f"; {t}" for t in trips)

        def verdict(kept: bool, reason: str, outcome: str) -> Verdict:
            return Verdict(kept=kept, reason=reason, changes=clean, bands=finite_bands, outcome=outcome, guards=in_force)

        if change is None:
            return verdict(False, f"objective {objective} could not be measured{tripped}{note}", "unmeasured")
        value = after.get(objective)
        if not _finite(change) or (value is not None and not _finite(value)):
            what = f"change {change!r}" if not _finite(change) else f"value {value!r}"
            return verdict(False, f"objective {objective} is not finite ({what}): a failed number is never a gain{tripped}{note}", "unmeasured")
        better = change if METRICS[objective] else -change
        obj_text = f"{objective} {move(objective, change)}, noise band ±{band:.1%}"
        if trips:
            return verdict(False, f"{obj_text}{tripped}{note}", "guard")
        if better <= band:
            verb = "no change beyond noise" if better >= -band else "worse"
            # The other side of a trade: watched numbers that did improve beyond noise.
            gains = [f"{m} {move(m, c)}" for m in _watched(layer) if m != objective and _finite(c := changes.get(m))
                     and (c if ALL_METRICS.get(m, True) else -c) > bands.get(m, self.min_effect)]
            but = f"; better, but not the objective: {', '.join(gains)}" if gains else ""
            return verdict(False, f"{verb}: {obj_text}{but}{note}", "no_change" if better >= -band else "worse")
        # The price of a kept trade: watched numbers that got worse beyond noise without a guard tripping.
        costs = [f"{m} {move(m, c)}" for m in _watched(layer) if m != objective and _finite(c := changes.get(m))
                 and -(c if ALL_METRICS.get(m, True) else -c) > bands.get(m, self.min_effect)]
        cost = f"; at a cost no guard forbids: {', '.join(costs)}" if costs else ""
        return verdict(True, f"{obj_text}; no guard tripped{cost}{note}", "kept")


def _watched(layer: Layer) -> tuple[str, ...]:
    """The numbers a layer's reasons mention when they moved: its watch list and latency guards."""
    return (*WATCH[layer], *(m for m in LATENCY_GUARDS.get(layer, {}) if m not in WATCH[layer]))


def _finite(v: object) -> bool:
    """True for a real number that is neither NaN nor infinite (bools and None are not numbers here)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if not _finite(v):
        return repr(v)
    return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"


def _move(metric: str, before: dict, after: dict, change: float, interval: list[float] | None = None) -> str:
    """A change as a reason quotes it, saying what the percentage is computed from.

    Census numbers (``weight_mb``) are exact, and their change is the ratio of the two figures
    printed next to it. Measured numbers change by the paired estimate (per request and round,
    :mod:`fractal_opt.measure.noise`), which is not the ratio of the two medians: the text names
    it, with its 95% interval when known, and labels the medians as medians.
    """
    b, a = _fmt(before.get(metric)), _fmt(after.get(metric))
    if metric in CENSUS_METRICS:
        return f"{change:+.1%} ({b} -> {a})"
    ci = f" [95%: {interval[0]:+.1%}, {interval[1]:+.1%}]" if interval and len(interval) == 2 else ""
    return f"paired estimate {change:+.1%}{ci}, medians {b} -> {a}"
