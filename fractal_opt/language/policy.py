"""Acceptance rules: objectives, guards and the threshold -> Verdict(kept, reason).

A pass is kept when its objective improves beyond its threshold (the step's interval half-width,
at least ``min_effect``) and no guard trips. Each layer
has a natural objective because each attacks a different cost:

- hardware and model: ``decode_tokens_per_s`` of one request;
- scheduling: ``throughput_tokens_per_s`` (aggregate output tokens/s of the suite);
- application: ``e2e_ms`` (end-to-end latency per request).

Guards:
- quality, against the baseline (:data:`DEFAULT_GUARDS`): ``kl_mean: {max: 0.05}``, the workload's
  greedy ``agreement: {min: 0.5}`` and, with an eval set (the default for an embedded model),
  ``accuracy: {max_drop: 0}`` judged beyond noise by a sign test on the questions that changed
  verdict. Only exact numbers are judged: a quality number that is missing or only a lower bound is
  *unknown* and trips, unless the recipe says ``accept_unknown: true`` (:mod:`fractal_opt.language.guards`);
- speed and memory, relative to the previous kept plan: every number on the layer's watch list may
  get at most ``max_regression`` (default 10%) worse beyond its threshold (the step's interval
  half-width, at least min_effect: the guard trips when the regression exceeds max_regression + it);
- determinism for scheduling passes (``determinism``): ``required`` holds a batching step to the
  previous plan's exact greedy tokens (``path_agreement: {min: 1.0}``); ``off`` (the default) judges
  the batched outputs like a numerics change, by the quality guards against the baseline above.
  Runtimes whose batched kernels round differently (llama.cpp; vLLM without its batch-invariant
  mode) change some greedy tokens without losing quality. Either way the step reports the
  identical fraction (``path_agreement``) and its reason quotes it;
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
from typing import Any, Literal

from ..core.errors import RecipeError, closest
from ..measure.metrics import METRICS
from ..tower.passes import Layer
from .guards import ALL_METRICS, CENSUS_METRICS, LIMITS, QUALITY_METRICS, Evidence, Guard, finite, fmt, move

__all__ = ["ALL_METRICS", "CENSUS_METRICS", "DEFAULT_OBJECTIVES", "LATENCY_GUARDS", "QUALITY_METRICS", "Guard", "Policy", "Verdict"]

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
# Quality, against the baseline, on every layer. kl_mean: the next-token distributions on the
# reference text. agreement: the workload's greedy answers token by token (the share of each answer
# that matches the baseline's before the first divergence, averaged); the lowest a harmless change
# gave on the default suite was 0.61 (bf16 on transformers), real regressions 0.05-0.41
# (docs/quality.md). accuracy: the eval set's questions, worse beyond noise (guards.WORSE_P); in
# force when an eval set is scored (by default for an embedded model).
DETERMINISM = ("off", "required")  # policy.determinism: the values it takes
OPTIONS = ("accept_unknown", "judged_by")  # a guard's keys besides its limits
# Below 0.5 the eval decides, where one was scored (judged_by: guards.py): agreement says the answers
# changed, the paired eval whether they are wrong.
# eval_required_lost: questions an eval set marks required (the README's example) that the baseline
# answered right and the step does not; any one rolls the step back.
DEFAULT_GUARDS = {"kl_mean": {"max": 0.05}, "agreement": {"min": 0.5, "judged_by": "accuracy"}, "accuracy": {"max_drop": 0.0},
                  "eval_required_lost": {"max": 0}}
# What a scheduling pass may cost the people waiting (DESIGN.md: throughput is the objective, TTFT /
# ITL percentiles the guards), relative to the previous plan. On the project's 2-core CPU, static
# and continuous batching at 8 in flight raised ITL p90 by 74-133% over one-by-one serving while
# cutting TTFT p90 under load 1.6-16x (docs/passes.md, default suite), so 150% lets that normal
# trade through; a static batch handed the whole suite at once raised TTFT 16x (the quickstart's), which
# 50% refuses. A recipe's own guard on the same metric (an SLO such as ``ttft_ms_p90: {max: 4000}``)
# replaces these.
LATENCY_GUARDS: dict[Layer, dict[str, dict[str, float]]] = {
    Layer.SCHEDULING: {"ttft_ms_p90": {"max_regression": 0.5}, "itl_ms_p90": {"max_regression": 1.5}},
}


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The judgement of one step, with the numbers that decided it."""

    kept: bool
    reason: str
    changes: dict[str, float] = field(default_factory=dict)  # metric -> relative change vs previous
    bands: dict[str, float] = field(default_factory=dict)  # metric -> threshold used (interval half-width, at least min_effect)
    # kept | no_change (objective within noise, no guard tripped) | worse | guard | unmeasured
    # (the objective has no number, or one that is not finite)
    outcome: str = ""
    guards: list[str] = field(default_factory=list)  # the guards in force that had a number to judge (Guard.describe)
    tripped: list[str] = field(default_factory=list)  # the metrics whose guard tripped (which guard stopped the step)


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
        determinism: ``required``: a scheduling step must give the previous plan's greedy tokens
            exactly (``path_agreement: {min: 1.0}``); ``off``: it is judged by the quality guards
            against the baseline, and its identical fraction is reported, not guarded.
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
    # Off by default: exact tokens under batching is a property of the runtime (its capability
    # table's batch_invariant), not of the pass; llama.cpp's continuous batching left 0.625-0.75 of
    # the answers identical while agreement with the baseline held (docs/quality.md).
    # False: YAML 1.1 (PyYAML) reads an unquoted ``determinism: off`` as false; it means "off".
    determinism: Literal["off", "required", False] = "off"

    def __post_init__(self) -> None:
        if self.determinism is False:
            object.__setattr__(self, "determinism", "off")
        if self.determinism not in DETERMINISM:
            raise RecipeError(f"policy, key 'determinism': got {self.determinism!r}, expected one of {list(DETERMINISM)}."
                              f"{closest(str(self.determinism), DETERMINISM)}")
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
                if key not in (*LIMITS, *OPTIONS):
                    valid = sorted((*LIMITS, *OPTIONS))
                    raise RecipeError(f"policy.guards.{metric}: unknown limit {key!r}. Valid limits are: {valid}.{closest(key, valid)}")
                if key == "judged_by":
                    if value is not None and value not in ALL_METRICS:
                        raise RecipeError(f"policy.guards.{metric}.judged_by: got {value!r}, expected a metric (such as 'accuracy') or null.{closest(str(value), ALL_METRICS)}")
                    continue
                if key == "accept_unknown":
                    if not isinstance(value, bool):
                        raise RecipeError(f"policy.guards.{metric}.accept_unknown: got {value!r}, expected true or false.")
                    continue
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
        if layer is Layer.SCHEDULING and self.determinism == "required":
            # A serving path (batching, continuous batching) must give the same greedy tokens as
            # the path it replaces; a divergence is a quality regression, not a speed-up.
            specs["path_agreement"] = {"min": 1.0}
        for metric, spec in self.guards.items():
            specs[metric] = None if spec is None else _merged(specs.get(metric), spec)
        return [Guard(metric=m, **spec) for m, spec in specs.items() if spec and any(k in LIMITS for k in spec)]

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
        ``changes`` relative changes (paired), ``bands`` the threshold per metric (interval half-width, at least min_effect), ``baseline``
        the baseline's numbers (for ``max_drop``), ``intervals`` the 95% interval ``[low, high]``
        of each paired change (quoted next to the estimate in the reason)."""
        ev = Evidence(before=before, after=after, changes=changes, bands=bands, baseline=baseline or {}, intervals=intervals or {})
        trips: list[str] = []
        notes: list[str] = []  # what the verdict could not judge, or chose not to
        in_force: list[str] = []
        tripped: list[str] = []
        for guard in self.guards_for(layer):
            found = guard.check(ev)
            trips += found.trips
            tripped += [guard.metric] if found.trips else []
            notes += found.notes
            if found.in_force:
                in_force.append(guard.describe())
        if layer is Layer.SCHEDULING and (identical := _identical(ev, self.determinism)):
            notes.append(identical)
        clean = {k: round(v, 4) for k, v in changes.items() if finite(v)}  # trace.json is strict JSON: no NaN
        finite_bands = {k: v for k, v in bands.items() if finite(v)}

        def verdict(kept: bool, reason: str, outcome: str) -> Verdict:
            return Verdict(kept=kept, reason=reason, changes=clean, bands=finite_bands, outcome=outcome, guards=in_force, tripped=tripped)

        return verdict(*self._decide(layer, ev, trips, notes))

    def _decide(self, layer: Layer, ev: Evidence, trips: list[str], notes: list[str]) -> tuple[bool, str, str]:
        """(kept, reason, outcome) from the objective's change and the guards' findings."""
        objective = self.objective_for(layer)
        change, value = ev.changes.get(objective), ev.after.get(objective)
        note, tripped = "".join(f"; {n}" for n in notes), "".join(f"; {t}" for t in trips)
        if change is None:
            return False, f"objective {objective} could not be measured{tripped}{note}", "unmeasured"
        if not finite(change) or (value is not None and not finite(value)):
            what = f"change {change!r}" if not finite(change) else f"value {value!r}"
            return False, f"objective {objective} is not finite ({what}): a failed number is never a gain{tripped}{note}", "unmeasured"
        band = ev.bands.get(objective, self.min_effect)
        better = _better(objective, change)
        # The threshold is the step's own interval half-width (from its rounds; at least min_effect),
        # not the A/A calibration's noise band, which the report shows apart.
        obj_text = f"{objective} {move(objective, ev, change)}, threshold ±{band:.1%} (interval half-width, at least min_effect)"
        if trips:
            return False, f"{obj_text}{tripped}{note}", "guard"
        if not self.objective_improved(layer, changes=ev.changes, after=ev.after, bands=ev.bands):
            verb = "no change beyond noise" if better >= -band else "worse"
            gains = self._moved(layer, ev, objective, better_side=True)  # the other side of a trade
            but = f"; better, but not the objective: {', '.join(gains)}" if gains else ""
            return False, f"{verb}: {obj_text}{but}{note}", "no_change" if better >= -band else "worse"
        costs = self._moved(layer, ev, objective, better_side=False)  # the price of a kept trade
        cost = f"; at a cost no guard forbids: {', '.join(costs)}" if costs else ""
        return True, f"{obj_text}; no guard tripped{cost}{note}", "kept"

    def objective_improved(self, layer: Layer, *, changes: dict[str, Any], after: dict[str, Any], bands: dict[str, float]) -> bool:
        """Whether the objective's paired change beats its threshold (``bands``, at least
        min_effect) with a finite number: the one condition no guard and no quality number can
        stand in for, so a step without it is rolled back whatever else it measured (the runner
        then spares it the quality probes)."""
        objective = self.objective_for(layer)
        change, value = changes.get(objective), after.get(objective)
        if change is None or not finite(change) or (value is not None and not finite(value)):
            return False
        return _better(objective, change) > bands.get(objective, self.min_effect)

    def _moved(self, layer: Layer, ev: Evidence, objective: str, *, better_side: bool) -> list[str]:
        """Watched numbers besides the objective that moved beyond noise, to the better or the worse side."""
        out = []
        for m in _watched(layer):
            c = ev.changes.get(m)
            if m == objective or not finite(c):
                continue
            gain = c if ALL_METRICS.get(m, True) else -c
            if (gain if better_side else -gain) > ev.bands.get(m, self.min_effect):
                out.append(f"{m} {move(m, ev, c)}")
        return out


def _better(objective: str, change: float) -> float:
    """The objective's change signed so that positive is better (its direction from ``METRICS``)."""
    return change if METRICS[objective] else -change


def _identical(ev: Evidence, determinism: str) -> str:
    """The batching step's identical fraction, for its reason: a guard with determinism
    ``required``, a reported number with ``off`` (the quality guards judge the step)."""
    value = ev.after.get("path_agreement")
    if value is None:
        return ""
    role = "guarded (determinism required)" if determinism == "required" else "reported, not guarded (determinism off)"
    return f"path_agreement {fmt(value)}: the share of answers token-identical to the previous plan's, {role}"


def _merged(default: dict | None, spec: dict) -> dict:
    """A recipe's guard over the default one: its limits replace the default's when it names any
    (``kl_mean: {max: 0.1}``); options (``accept_unknown``, ``judged_by``) it names replace the
    default's, and the default's others stay."""
    limits = {k: v for k, v in spec.items() if k in LIMITS} or {k: v for k, v in (default or {}).items() if k in LIMITS}
    options = {k: v for k, v in (default or {}).items() if k in OPTIONS} | {k: v for k, v in spec.items() if k in OPTIONS}
    return {**limits, **options}


def _watched(layer: Layer) -> tuple[str, ...]:
    """The numbers a layer's reasons mention when they moved: its watch list and latency guards."""
    return (*WATCH[layer], *(m for m in LATENCY_GUARDS.get(layer, {}) if m not in WATCH[layer]))
