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
- any metric by hand in the recipe: ``{min: x}``, ``{max: x}`` or ``{max_regression: r}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import RecipeError, closest
from .measure.metrics import METRICS
from .passes import Layer

__all__ = ["DEFAULT_OBJECTIVES", "Guard", "Policy", "Verdict"]

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
# Scheduling leaves per-request latency off the list: batching makes each request a little slower
# and the machine much more productive; a recipe states its latency SLOs as guards instead.
WATCH = {
    Layer.HARDWARE: ("decode_tokens_per_s", "ttft_ms", "throughput_tokens_per_s", "peak_memory_mb", "weight_mb"),
    Layer.MODEL: ("decode_tokens_per_s", "ttft_ms", "throughput_tokens_per_s", "peak_memory_mb", "weight_mb"),
    Layer.SCHEDULING: ("throughput_tokens_per_s",),
    Layer.APPLICATION: ("ttft_ms",),
}
DEFAULT_GUARDS = {"kl_mean": {"max": 0.05}, "accuracy": {"max_drop": 0.1}}  # accuracy only when an eval set is given


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
        parts = [f"{k} {v:g}" for k, v in limits if v is not None]
        return f"{self.metric} " + ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The judgement of one step, with the numbers that decided it."""

    kept: bool
    reason: str
    changes: dict[str, float] = field(default_factory=dict)  # metric -> relative change vs previous
    bands: dict[str, float] = field(default_factory=dict)  # metric -> noise band used
    # kept | no_change (objective within noise, no guard tripped) | worse | guard | unmeasured
    outcome: str = ""


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Recipe section ``policy``.

    Attributes:
        objective: the metric that must improve, or ``auto`` for each layer's default.
        guards: ``{metric: {min|max|max_regression: value}}``, merged over the defaults; a metric
            set to ``null`` removes its default guard.
        max_regression: default limit for the numbers on each layer's watch list (0.10 = 10%).
        min_effect: the smallest relative change that counts even on a quiet machine (0.05 = 5%).
    """

    objective: str = "auto"
    guards: dict[str, Any] = field(default_factory=dict)
    max_regression: float = 0.10
    # 5%: two quickstart runs of a pass that changed nothing (threads 2 -> 2) measured -1.6% and
    # +3.5% decode tokens/s on the project's 2-core CPU; a 3% floor let the second one count.
    min_effect: float = 0.05

    def __post_init__(self) -> None:
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
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise RecipeError(f"policy.guards.{metric}.{key}: got {value!r}, expected a number.")
        for name in ("max_regression", "min_effect"):
            if not 0 <= getattr(self, name) < 10:
                raise RecipeError(f"policy, key {name!r}: got {getattr(self, name)}, expected a fraction like 0.1 (= 10%).")

    def objective_for(self, layer: Layer) -> str:
        return DEFAULT_OBJECTIVES[layer] if self.objective == "auto" else self.objective

    def guards_for(self, layer: Layer) -> list[Guard]:
        """Default guards of the layer, overridden and extended by the recipe's."""
        specs: dict[str, dict | None] = {m: {"max_regression": self.max_regression} for m in WATCH[layer] if m != self.objective_for(layer)}
        specs.update(DEFAULT_GUARDS)
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
    ) -> Verdict:
        """Keep or roll back: ``before``/``after`` are metric medians (quality included),
        ``changes`` relative changes (paired), ``bands`` the noise band per metric, ``baseline``
        the baseline's numbers (for ``max_drop``)."""
        objective = self.objective_for(layer)
        trips: list[str] = []
        notes: list[str] = []  # what the verdict could not judge, or judged on a bound
        for guard in self.guards_for(layer):
            value = after.get(guard.metric)
            if value is None:
                if guard.metric in QUALITY_METRICS and guard.metric in after:  # probed, not measurable (quality.probes kl_method)
                    notes.append(f"guard {guard.metric} not measurable on this runtime ({after.get('kl_method') or 'no value'})")
                continue
            if guard.metric.startswith("kl_") and str(after.get("kl_method", "full")).startswith("top-k"):
                notes.append(f"guard {guard.metric} judged a lower bound ({after['kl_method']}): it can only be too lenient")
            if guard.max is not None and value > guard.max:
                trips.append(f"guard {guard.metric} max {guard.max:g} tripped: {_fmt(value)}")
            if guard.min is not None and value < guard.min:
                trips.append(f"guard {guard.metric} min {guard.min:g} tripped: {_fmt(value)}")
            base = (baseline or {}).get(guard.metric)
            if guard.max_drop is not None and base is not None and base - value > guard.max_drop:
                trips.append(f"guard {guard.metric} max_drop {guard.max_drop:g} tripped: {_fmt(base)} at baseline -> {_fmt(value)}")
            change = changes.get(guard.metric)
            if guard.max_regression is not None and change is not None:
                worse = -change if ALL_METRICS.get(guard.metric, True) else change
                limit = guard.max_regression + bands.get(guard.metric, 0.0)  # worse beyond noise
                if worse > limit:
                    trips.append(f"guard {guard.metric} max_regression {guard.max_regression:.0%} tripped: {_move(guard.metric, before, after, change)}")
        change = changes.get(objective)
        band = bands.get(objective, self.min_effect)
        clean = {k: round(v, 4) for k, v in changes.items() if v is not None}
        note = "".join(f"; {n}" for n in notes)
        if change is None:
            return Verdict(kept=False, reason=f"objective {objective} could not be measured", changes=clean, bands=bands, outcome="unmeasured")
        better = change if METRICS[objective] else -change
        obj_text = f"{objective} {_move(objective, before, after, change)}, noise band ±{band:.1%}"
        if trips:
            return Verdict(kept=False, reason=f"{obj_text}; " + "; ".join(trips) + note, changes=clean, bands=bands, outcome="guard")
        if better <= band:
            verb = "no change beyond noise" if better >= -band else "worse"
            # The other side of a trade: watched numbers that did improve beyond noise.
            gains = [f"{m} {_move(m, before, after, c)}" for m in WATCH[layer] if m != objective and (c := changes.get(m)) is not None
                     and (c if ALL_METRICS.get(m, True) else -c) > bands.get(m, self.min_effect)]
            but = f"; better, but not the objective: {', '.join(gains)}" if gains else ""
            return Verdict(kept=False, reason=f"{verb}: {obj_text}{but}{note}", changes=clean, bands=bands, outcome="no_change" if better >= -band else "worse")
        # The price of a kept trade: watched numbers that got worse beyond noise without a guard tripping.
        costs = [f"{m} {_move(m, before, after, c)}" for m in WATCH[layer] if m != objective and (c := changes.get(m)) is not None
                 and -(c if ALL_METRICS.get(m, True) else -c) > bands.get(m, self.min_effect)]
        cost = f"; at a cost no guard forbids: {', '.join(costs)}" if costs else ""
        return Verdict(kept=True, reason=f"{obj_text}; no guard tripped{cost}{note}", changes=clean, bands=bands, outcome="kept")


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"


def _move(metric: str, before: dict, after: dict, change: float) -> str:
    return f"{change:+.1%} ({_fmt(before.get(metric))} -> {_fmt(after.get(metric))})"
