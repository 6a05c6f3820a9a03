"""The fleet a load needs: replicas and machines of this kind, from measured capacity and measured scaling.

``fractal-opt fleet RUN --users N`` (or ``--rate R``) reads a run's trace.json:

- **one replica's capacity** under the recipe's SLOs (``load: {capacity: true}``): the capacity
  the run measured for a plan of one server, with its interval (the search's highest load that
  met every SLO, and the lowest that did not, over the rounds);
- **the scaling efficiency** of adding replicas, measured on this machine: a ``replicas`` step of
  the run (N copies, each on its own cores) against the one-replica plan before it, with the same
  cores per replica: ``capacity(N) / (N x capacity(1))``; or the ``replicas`` object that
  ``benchmarks/placement.py --json`` printed (``--scaling FILE``).

Replicas for a target load ``L``: ``ceil(L / (C x e))`` with ``C`` the one-replica capacity and
``e`` the efficiency; the interval comes from ``C``'s (more capacity than was met cannot be
promised, so the first figure is the count to buy; the top of the interval gives the fewest that
could do). Machines of this kind: the replicas over the replicas one machine holds (its physical
cores over the cores per replica). Cost per 1,000 output tokens at ``--price-per-hour``: the
machines' price per hour over the tokens per hour the load makes (each replica's throughput at its
capacity, per unit of load). An efficiency that was not measured is said so beside the answer,
never filled in: the count is then what perfect scaling would need, a floor.

A run that measured no capacity (no ``capacity: true``, or no load met the SLOs) is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import RecipeError

__all__ = ["Capacity", "FleetAnswer", "Scaling", "fleet_basis", "plan_fleet", "scaling_from_benchmark"]

_UNITS = {"users": ("users", "clients"), "rate": ("requests/s",)}  # the CLI option -> the capacity units it can size


@dataclass(frozen=True)
class Capacity:
    """One replica's measured capacity: the load met (median over rounds), the interval over rounds, its unit, and its throughput there."""

    value: float
    low: float
    high: float | None  # the lowest load that broke an SLO (None: nothing up to capacity_max did)
    unit: str
    tokens_per_s: float | None  # output tokens/s at that load
    cores: int  # the cores the replica ran on
    where: str  # which step measured it


@dataclass(frozen=True)
class Scaling:
    """Measured scaling efficiency: N replicas' capacity over N times one's."""

    efficiency: float
    replicas: int
    source: str  # what measured it (a step of the run, or the benchmark's JSON)


@dataclass
class FleetAnswer:
    """Replicas and machines for a target load, with the interval and what they rest on."""

    target: float
    unit: str
    replicas: int
    replicas_interval: tuple[int, int]
    per_machine: int
    machines: int
    capacity: Capacity
    scaling: Scaling | None
    usd_per_1k_tokens: float | None = None
    price_per_hour: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        c, s = self.capacity, self.scaling
        return {"target": self.target, "unit": self.unit, "replicas": self.replicas, "replicas_interval": list(self.replicas_interval),
                "replicas_per_machine": self.per_machine, "machines": self.machines,
                "capacity_per_replica": {"value": c.value, "interval": [c.low, c.high], "unit": c.unit, "tokens_per_s": c.tokens_per_s, "cores": c.cores, "measured_by": c.where},
                "scaling_efficiency": s.efficiency if s else None, "scaling_measured_by": s.source if s else None,
                "price_per_hour": self.price_per_hour, "usd_per_1k_tokens": self.usd_per_1k_tokens, "notes": self.notes}

    def to_text(self) -> str:
        c, s = self.capacity, self.scaling
        high = f"{c.high:g}" if c.high is not None else "more"
        eff = (f"scaling efficiency {s.efficiency:.2f} measured here ({s.source})" if s else
               "scaling efficiency NOT MEASURED: the count assumes perfect scaling (1.00), a floor; add a replicas pass to the recipe or pass --scaling")
        lines = [
            f"For {self.target:g} {self.unit}: {self.replicas} replicas (interval {self.replicas_interval[0]} - {self.replicas_interval[1]}), "
            f"{self.machines} machine(s) of this kind ({self.per_machine} replicas each).",
            f"  one replica ({c.cores} core(s)) serves {c.value:g} {c.unit} under the SLOs (interval {c.low:g} - {high}; {c.where})",
            f"  {eff}",
        ]
        if self.usd_per_1k_tokens is not None:
            lines.append(f"  cost: ${self.usd_per_1k_tokens:.6f} per 1,000 output tokens at ${self.price_per_hour:g} per machine-hour")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _step_capacity(step: dict[str, Any]) -> tuple[float, float, float | None, str] | None:
    """(median capacity, lowest met over rounds, lowest broken over rounds, unit) of a trace step; None when it measured none."""
    metrics = step.get("metrics") or {}
    searches = (metrics.get("load") or {}).get("capacity") or []
    met = [s["capacity"] for s in searches if isinstance(s, dict) and isinstance(s.get("capacity"), (int, float))]
    value = metrics.get("capacity")
    if not met or not isinstance(value, (int, float)):
        return None
    tops = [s["interval"][1] for s in searches if isinstance(s, dict) and s.get("interval") and s["interval"][1] is not None]
    return float(value), float(min(met)), (float(min(tops)) if tops else None), str(searches[0].get("unit", "users"))


def _cores(plan: dict[str, Any], machine_cores: int) -> tuple[int, int]:
    """(replicas, cores each) of a trace step's plan."""
    sched = plan.get("scheduling") or {}
    replicas = int(sched.get("replicas") or 1)
    each = sched.get("replica_cores")
    return replicas, int(each) if each else max(1, machine_cores // replicas)


def _measured_steps(trace: dict[str, Any]) -> list[dict[str, Any]]:
    steps = [trace["baseline"]] if trace.get("baseline") else []
    return steps + [s for s in trace.get("steps") or [] if s.get("status") in ("kept", "rolled_back")]


def _one_replica(step: dict[str, Any], cores: int) -> Capacity | None:
    """The capacity of a measured step whose plan is one replica (None for N replicas or no capacity)."""
    cap = _step_capacity(step)
    replicas, each = _cores(step.get("plan") or {}, cores)
    if cap is None or replicas != 1:
        return None
    tps = (step.get("metrics") or {}).get("throughput_tokens_per_s")
    return Capacity(cap[0], cap[1], cap[2], cap[3], float(tps) if isinstance(tps, (int, float)) else None, each, f"step {step.get('pass')} ({step.get('status')})")


def fleet_basis(trace: dict[str, Any]) -> tuple[Capacity, Scaling | None]:
    """One replica's capacity and, when the run measured it, the scaling efficiency against that same replica.

    With a ``replicas`` step of N > 1 copies: the last such step, against the latest one-replica plan
    measured before it with the same cores per replica (kept or rolled back: both were measured
    here). Without one: the kept plan's capacity when it is one replica, else the latest
    one-replica plan measured, and no efficiency.

    Raises:
        RecipeError: the run measured no capacity of a one-replica plan (no ``load: {capacity: true}``, or no load met the SLOs).
    """
    cores = int((trace.get("machine") or {}).get("physical_cores") or 1)
    singles: list[Capacity] = []
    basis: tuple[Capacity, Scaling] | None = None
    kept: Capacity | None = None
    for step in _measured_steps(trace):
        one = _one_replica(step, cores)
        replicas, each = _cores(step.get("plan") or {}, cores)
        cap = _step_capacity(step)
        if one is not None:
            singles.append(one)
            kept = one if step.get("status") != "rolled_back" else kept
        elif step.get("pass") == "replicas" and cap is not None:
            same = [c for c in singles if c.cores == each]
            if same:
                c1 = same[-1]
                basis = (c1, Scaling(cap[0] / (replicas * c1.value), replicas,
                                     f"{replicas} replicas of {each} core(s) against 1 ({c1.where}), step replicas ({step.get('status')})"))
        elif step.get("status") != "rolled_back":
            kept = None  # the kept plan is now N replicas
    if basis is not None:
        return basis
    found = kept or (singles[-1] if singles else None)
    if found is None:
        msg = ("this run measured no capacity of a one-replica plan: the fleet is sized from the capacity under the SLOs that one replica "
               "served (workload: {load: {capacity: true, slo_ttft_ms: ...}}), and no step of this run has one (or no load met the SLOs)")
        raise RecipeError(msg)
    return found, None


def scaling_from_benchmark(path: str | Path) -> Scaling:
    """The efficiency ``benchmarks/placement.py --json`` measured (its ``replicas`` object).

    Raises:
        RecipeError: the file is not that JSON, or it holds no measured efficiency.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        rep = data["replicas"]
        eff = float(rep["scaling_efficiency"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecipeError(f"--scaling {str(path)!r}: expected the JSON of benchmarks/placement.py --json with replicas.scaling_efficiency ({type(e).__name__}: {e})") from None
    return Scaling(eff, int(rep.get("replicas", 2)), f"benchmarks/placement.py ({path})")


def plan_fleet(capacity: Capacity, *, target: float, option: str, machine_cores: int, scaling: Scaling | None = None,
               price_per_hour: float | None = None) -> FleetAnswer:
    """Replicas and machines for ``target`` (``option``: ``users`` or ``rate``, which must match the capacity's unit).

    Raises:
        RecipeError: a target that is not positive, or one in another unit than the capacity was measured in.
    """
    if not target > 0:
        raise RecipeError(f"fleet: the target load must be > 0, got {target:g}")
    if capacity.unit not in _UNITS[option]:
        other = "--rate (requests/s)" if capacity.unit == "requests/s" else "--users"
        raise RecipeError(f"fleet: --{option} sizes a load in {' or '.join(_UNITS[option])}, but this run measured capacity in {capacity.unit}; give {other}")
    eff = scaling.efficiency if scaling else 1.0
    need = math.ceil(target / (capacity.value * eff) - 1e-9)
    fewest = math.ceil(target / (capacity.high * eff) - 1e-9) if capacity.high else 1
    per_machine = max(1, machine_cores // capacity.cores)
    answer = FleetAnswer(target, capacity.unit, need, (max(1, fewest), need), per_machine, math.ceil(need / per_machine), capacity, scaling)
    if price_per_hour is not None and capacity.tokens_per_s:
        tokens_per_s = target * capacity.tokens_per_s / capacity.value  # the load's output tokens/s, at each replica's measured rate per unit of load
        answer.usd_per_1k_tokens = answer.machines * price_per_hour / 3600 / tokens_per_s * 1000
        answer.price_per_hour = price_per_hour
    if capacity.high is None:
        answer.notes.append("no load up to the search's capacity_max broke an SLO: one replica may serve more, so fewer replicas may do")
    return answer
