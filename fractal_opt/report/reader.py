"""The one reader of a trace: what the reports, ``compare`` and the notebook ask of a run.

A trace (:class:`~.trace.Trace`) is a plain record. This reader answers the questions every
consumer asks of it, one way: the steps in order, the policy, the layers that kept a pass and the
objective each was judged on, the final plan's answers, and above all the final plan's numbers.
Each of those has one source, the final confirmation (``final.confirmation``): the baseline and
the final plan measured again in the same rounds after the last step, at each offered load it
measured (:class:`Load`). A figure the confirmation did not measure (quality, the census's
weights, a peak memory both plans could not show while resident together) comes from the step
that kept the final plan, as ``final.metrics`` records it; before a confirmation, a provisional
plan's numbers are its last step's and carry no change against the baseline.

Example:
    >>> from fractal_opt.report.trace import Trace
    >>> conf = {"clients": 4, "metrics": {"throughput_tokens_per_s": {"change": 1.2, "interval": [1.07, 1.34], "band": 0.13,
    ...         "verdict": "better", "baseline_median": 13.6, "final_median": 30.2}}}
    >>> reader = Reader(Trace(recipe={}, final={"status": "confirmed", "confirmation": conf, "metrics": {"weight_mb": 231.0}}))
    >>> reader.figure("throughput_tokens_per_s").text(objective=True)
    'throughput 13.6 -> 30.2 tokens/s: 2.20x [95%: 2.07x, 2.34x], confirmed'
    >>> reader.final_metrics()
    {'weight_mb': 231.0, 'throughput_tokens_per_s': 30.2}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..core.errors import RecipeError
from ..language.policy import Policy
from ..tower.passes import Layer
from ..quality.evals import eval_set_name
from .figures import Figure
from .svg import is_num

__all__ = ["MEASURED", "Load", "Objective", "Reader", "policy_of", "wall_time"]

# Final statuses whose confirmation measured the final plan against the baseline.
MEASURED = ("confirmed", "not_confirmed")


@dataclass(frozen=True)
class Load:
    """One offered load the confirmation measured both plans at."""

    clients: int | None  # None: the load does not depend on the plan (the suite, poisson, conversations, capacity)
    label: str  # "one request at a time", "4 clients at once", "the suite as the plan serves it"
    index: int | None  # its place in confirmation.at_loads; None when the confirmation measured one load
    headline: bool  # the final plan's own offered load: what the user will run

    @property
    def alone(self) -> bool:
        return self.clients == 1


@dataclass(frozen=True)
class Objective:
    """What the recipe asked of the layers that kept a pass: a metric, and the load it was judged at."""

    metric: str
    layers: tuple[str, ...]  # the kept layers judged on it, in tower order
    load: Load
    traded: Mapping[str, Any] | None  # a later kept step paid with it (confirmation.traded), else None

    def role(self) -> str:
        """``hardware objective`` / ``hardware and model objective``."""
        return " and ".join(self.layers) + " objective"


def policy_of(recipe: Mapping[str, Any]) -> Policy:
    """The recipe's policy as a trace stores it; the default rules for an old or hand-edited trace."""
    data = recipe.get("policy") or {}
    names = {f.name for f in dataclasses.fields(Policy)}
    try:
        return Policy(**{k: v for k, v in data.items() if k in names})
    except (RecipeError, TypeError):
        return Policy()


def wall_time(run: Mapping[str, Any]) -> str | None:
    """``"14 min 7 s"``: the wall clock from the trace's ``run.started_at`` to its ``run.ended_at``
    as the trace records them; None when either is missing."""
    try:
        seconds = (datetime.fromisoformat(run["ended_at"]) - datetime.fromisoformat(run["started_at"])).total_seconds()
    except (KeyError, TypeError, ValueError):
        return None
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


class Reader:
    """Read one trace (see the module docstring); it never changes the trace."""

    def __init__(self, trace: Any) -> None:
        self.trace = trace
        self.final: Mapping[str, Any] = trace.final or {}
        self.confirmation: Mapping[str, Any] = self.final.get("confirmation") or {}
        self.policy = policy_of(trace.recipe or {})

    # ------------------------------------------------------------------ the run
    @property
    def status(self) -> str | None:
        """The final plan's status (confirmed, not_confirmed, unchanged, provisional, failed); None for a trace older than the confirmation."""
        return self.final.get("status")

    @property
    def measured(self) -> bool:
        """Whether a confirmation measured the final plan against the baseline."""
        return self.status in MEASURED and bool(self.confirmation.get("metrics"))

    def steps(self) -> list[tuple[str, Any]]:
        """``(id, step)`` in trace order: "0" the baseline, "1".. the steps (report.html's data-step)."""
        out: list[tuple[str, Any]] = [("0", self.trace.baseline)] if self.trace.baseline else []
        return out + [(str(i), s) for i, s in enumerate(self.trace.steps, start=1)]

    def kept(self) -> list[Any]:
        """The kept steps in run order."""
        return [s for s in self.trace.steps if s.status == "kept"]

    def kept_labels(self) -> list[str]:
        """``hardware/runtime(backend=llama_cpp)``: each kept step with the parameters that differ from its pass's defaults."""
        return [f"{s.layer}/{s.label()}" for s in self.kept()]

    def workload_load(self) -> Mapping[str, Any]:
        """The recipe's load profile ({} when the suite is served as the plan schedules it)."""
        return (self.trace.recipe.get("workload") or {}).get("load") or {}

    # ------------------------------------------------------------------ the final plan's numbers
    def loads(self) -> list[Load]:
        """The offered loads the confirmation measured, the headline (the final plan's load) first."""
        entries = self.confirmation.get("at_loads") or []
        if entries:
            return [Load(clients=e.get("clients"), label=self._label(e.get("clients")), index=i, headline=bool(e.get("headline")))
                    for i, e in enumerate(entries)]
        clients = self.confirmation.get("clients")
        return [Load(clients=clients, label=self._label(clients), index=None, headline=True)]

    def headline(self) -> Load:
        return next(load for load in self.loads() if load.headline)

    def alone(self) -> Load | None:
        """The load at which one request was served at a time, if the confirmation measured one."""
        return next((load for load in self.loads() if load.alone), None)

    def _label(self, clients: int | None) -> str:
        if clients is not None:
            return "one request at a time" if clients == 1 else f"{clients} clients at once"
        load = self.workload_load()
        mode = load.get("mode")
        if load.get("capacity"):
            return "the capacity search's loads"
        if mode == "poisson":
            return f"Poisson arrivals, {load.get('rate')} requests/s"
        if mode == "conversations":
            return f"{load.get('users', 'its')} users in conversation"
        return "the suite as the plan serves it"

    def figure(self, metric: str, load: Load | None = None) -> Figure | None:
        """``metric`` of the final plan against the baseline at ``load`` (default: the headline), as
        the confirmation measured it; None when it did not."""
        if not self.measured:
            return None
        load = load or self.headline()
        if load.index is None:
            metrics, path = self.confirmation.get("metrics") or {}, "confirmation.metrics"
        else:
            metrics, path = (self.confirmation["at_loads"][load.index].get("metrics") or {}), f"confirmation.at_loads.{load.index}.metrics"
        entry = metrics.get(metric)
        if not isinstance(entry, Mapping):
            return None
        return Figure.from_entry(metric, entry, clients=load.clients, path=f"{path}.{metric}")

    def final_value(self, metric: str) -> Any:
        """The final plan's one figure for ``metric`` at its offered load: the confirmation's when it measured it."""
        fig = self.figure(metric)
        if fig is not None and is_num(fig.final):
            return fig.final
        return (self.final.get("metrics") or {}).get(metric)

    def final_metrics(self) -> dict[str, Any]:
        """The final plan's metrics, one figure each: ``final.metrics`` with every number the
        confirmation measured (at the headline load) taken from the confirmation."""
        out = dict(self.final.get("metrics") or {})
        if self.measured:
            for metric in self.confirmation.get("metrics") or {}:
                fig = self.figure(metric)
                if fig is not None and is_num(fig.final):
                    out[metric] = fig.final
        return out

    # ------------------------------------------------------------------ what the recipe asked
    def objectives(self) -> list[Objective]:
        """Per objective of a layer that kept a pass (tower order): the load it was judged at.

        An objective a later step traded and the confirmation measured again one request at a
        time (``confirmation.traded[metric].alone``) is judged there, where its own step measured
        it; every other objective at the headline load."""
        traded = self.confirmation.get("traded") or {}
        by_metric: dict[str, list[str]] = {}
        for step in self.kept():
            layer = Layer.__members__.get(str(step.layer).upper())
            if layer is not None:
                by_metric.setdefault(self.policy.objective_for(layer), []).append(layer.section)
        alone = self.alone()
        out = []
        for metric, layers in by_metric.items():
            t = traded.get(metric)
            load = alone if t is not None and t.get("alone") is not None and alone is not None else self.headline()
            out.append(Objective(metric=metric, layers=tuple(dict.fromkeys(layers)), load=load, traded=t))
        return out

    def objective_figure(self, metric: str) -> Figure | None:
        """``metric`` at the load its layer was judged on (:meth:`objectives`), else at the headline load."""
        objective = next((o for o in self.objectives() if o.metric == metric), None)
        return self.figure(metric, objective.load if objective is not None else None)

    def guard_max(self, metric: str) -> float | None:
        """An absolute ``max`` every layer's guard on ``metric`` shares (an SLO such as ``itl_ms_p90: {max: 100}``), else None."""
        limits = {g.max for layer in Layer for g in self.policy.guards_for(layer) if g.metric == metric}
        return limits.pop() if len(limits) == 1 and None not in limits else None

    # ------------------------------------------------------------------ the answers
    def baseline_quality(self) -> Mapping[str, Any]:
        baseline = self.trace.baseline
        return (baseline.metrics.get("quality") or {}) if baseline is not None and baseline.metrics else {}

    def final_quality(self) -> Mapping[str, Any]:
        """The quality numbers of the final plan: the kept step's (``final.metrics``), else the baseline's."""
        quality = (self.final.get("metrics") or {}).get("quality")
        return quality if quality else self.baseline_quality()

    def eval_guard(self) -> dict[str, Any]:
        """The eval set that guarded the run (``name``) and why (``why``), as the trace records them
        (a step's quality ``eval_set``, the baseline's ``eval_why``); a trace written before they were
        recorded: the set its recipe names, no reason; {} without one."""
        final, base = self.final_quality(), self.baseline_quality()
        name = final.get("eval_set") or base.get("eval_set")
        if not isinstance(name, str) or not name:
            recipe = self.trace.recipe or {}
            name = eval_set_name((recipe.get("quality") or {}).get("eval", "auto"), str(recipe.get("model", "")))
        why = base.get("eval_why")
        return {k: v for k, v in (("name", name), ("why", why)) if isinstance(v, str) and v}
