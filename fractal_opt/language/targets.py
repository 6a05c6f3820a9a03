"""Targets: the numbers a deployment must reach (recipe section ``targets``), validated.

The vocabulary half: what a target is, its direction, and the gap of one value to it. What a run
does with targets (the gap per step, ``--stop-at-target``, the binding limit) is
:mod:`fractal_opt.pipeline.targets`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import RecipeError, closest
from ..core.text import fmt
from .policy import ALL_METRICS

__all__ = ["Target", "Targets", "parse_targets"]


@dataclass(frozen=True)
class Target:
    """One wanted number: ``metric`` at ``value`` or better (the metric's own direction)."""

    metric: str
    value: float

    @property
    def higher_is_better(self) -> bool:
        return ALL_METRICS[self.metric]

    def gap(self, value: float | None) -> dict[str, Any]:
        """How ``value`` stands against the target: met, the ratio (>= 1 when met) and a sentence."""
        if value is None:
            return {"target": self.value, "value": None, "met": False, "ratio": None, "text": f"not measured (target {fmt(self.value, whole=True)})"}
        if value <= 0 and self.higher_is_better:
            ratio = 0.0
        elif value <= 0:
            ratio = math.inf
        else:
            ratio = value / self.value if self.higher_is_better else self.value / value
        met = ratio >= 1.0
        if met:
            text = f"{fmt(value, whole=True)} vs {fmt(self.value, whole=True)}: met" + (f" ({ratio:.1f}x)" if ratio >= 1.1 and math.isfinite(ratio) else "")
        else:
            short = (1 / ratio) if ratio > 0 else math.inf
            word = "short" if self.higher_is_better else "over"
            text = f"{fmt(value, whole=True)} vs {fmt(self.value, whole=True)}: {short:.1f}x {word}" if math.isfinite(short) else f"{fmt(value, whole=True)} vs {fmt(self.value, whole=True)}: not met"
        return {"target": self.value, "value": value, "met": met, "ratio": round(ratio, 4) if math.isfinite(ratio) else None, "text": text}


@dataclass(frozen=True)
class Targets:
    """The recipe's targets, in the order written (empty: no targets)."""

    items: tuple[Target, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.items)

    def __iter__(self):
        return iter(self.items)

    def to_dict(self) -> dict[str, float]:
        return {t.metric: t.value for t in self.items}


def parse_targets(data: Any, *, where: str = "recipe: targets") -> Targets:
    """Validate ``{metric: number}``: known metric names (closest match offered), positive finite numbers.

    Raises:
        RecipeError: naming the field, the value and what is allowed.
    """
    if data is None:
        return Targets()
    if not isinstance(data, Mapping):
        raise RecipeError(f"{where}: expected a mapping of metric -> number such as {{decode_tokens_per_s: 30, ttft_ms_p90: 800}}, got {data!r}.")
    items = []
    for metric, value in data.items():
        if metric not in ALL_METRICS:
            raise RecipeError(f"{where}: unknown metric {metric!r}. Valid metrics are: {sorted(ALL_METRICS)}.{closest(str(metric), ALL_METRICS)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            direction = "at least" if ALL_METRICS[metric] else "at most"
            raise RecipeError(f"{where}.{metric}: got {value!r}, expected a positive finite number ({metric} {direction} this value).")
        items.append(Target(str(metric), float(value)))
    return Targets(tuple(items))
