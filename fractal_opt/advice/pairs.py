"""Two plans measured the pipeline's way: interleaved rounds, a paired t interval over rounds, a noise band.

``bisect`` and ``compare --measure`` judge "worse" and "better" with the same rule a run's verdict
uses (:func:`fractal_opt.measure.measure_pair`, :func:`~fractal_opt.measure.noise.band`): a change
counts when it exceeds ``max(min_effect, the interval's inner half-width)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.machine import Machine
from ..core.text import fmt, interval_text
from ..engine.protocol import Engine
from ..measure.metrics import METRICS, Measurement
from ..measure.noise import band
from ..measure.runner import measure_pair, paired_changes
from ..tower.plan import Plan
from ..workloads.workload import Workload

__all__ = ["Engines", "PairResult", "measure_plans"]

Build = Callable[..., Engine]


@dataclass(frozen=True)
class PairResult:
    """``after`` against ``before`` on one metric: medians, the relative change, its interval and band."""

    metric: str
    before: float | None
    after: float | None
    change: float | None
    interval: tuple[float, float] | None
    band: float
    before_measurement: Measurement | None = None
    after_measurement: Measurement | None = None

    @property
    def worse(self) -> bool:
        """Worse beyond the noise band, in the metric's own direction."""
        if self.change is None:
            return False
        signed = self.change if METRICS.get(self.metric, True) else -self.change
        return signed < -self.band

    @property
    def better(self) -> bool:
        if self.change is None:
            return False
        signed = self.change if METRICS.get(self.metric, True) else -self.change
        return signed > self.band

    def text(self) -> str:
        if self.change is None:
            return f"{self.metric}: not measured"
        iv = f" {interval_text(self.change, *self.interval)}" if self.interval else ""
        word = "worse" if self.worse else "better" if self.better else "within noise"
        return f"{self.metric} {fmt(self.after, missing='–')} vs {fmt(self.before, missing='–')}: {self.change:+.1%}{iv}, band ±{self.band:.1%}: {word}"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "before": self.before, "after": self.after, "change": self.change,
                "interval": list(self.interval) if self.interval else None, "band": self.band, "worse": self.worse, "better": self.better}


class Engines:
    """Builds engines for plans and keeps them (weights are shared by the runtimes' cache); ``close()`` ends them all."""

    def __init__(self, *, build: Build | None, machine: Machine, workload: Workload, progress: Callable[[str], None]):
        from .. import runtimes

        self.build = build or runtimes.build
        self.machine = machine
        self.workload = workload
        self.say = progress
        self._open: dict[Plan, Engine] = {}

    def get(self, plan: Plan) -> Engine:
        if plan not in self._open:
            engine = self.build(plan, machine=self.machine, progress=self.say, max_new_tokens=self.workload.max_new_tokens)
            engine.prepare(self.workload.requests(), self.workload)
            self._open[plan] = engine
        return self._open[plan]

    def release(self, plan: Plan) -> None:
        engine = self._open.pop(plan, None)
        if engine is not None:
            engine.close()

    def close(self) -> None:
        for plan in list(self._open):
            self.release(plan)


def measure_plans(before: Engine, after: Engine, workload: Workload, *, metric: str, min_effect: float = 0.03,
                  progress: Callable[[str], None] | None = None) -> PairResult:
    """Measure ``after`` against ``before`` interleaved (A B / B A rounds, extended until the
    metric's interval settles) and judge ``metric`` against the noise band."""
    requests = workload.requests()
    a, b = measure_pair(before, after, workload, requests=requests, objective=metric, min_effect=min_effect, progress=progress)
    intervals = paired_changes(a, b, [metric])
    iv = intervals.get(metric)
    return PairResult(metric=metric, before=a.summary().get(metric), after=b.summary().get(metric), change=iv.change if iv else None,
                      interval=(iv.low, iv.high) if iv else None, band=band(iv, min_effect=min_effect), before_measurement=a, after_measurement=b)
