"""Which objectives the final confirmation must see improved, and which a later step traded away.

Each layer is judged on its own objective: the hardware layer on one stream's decode, the
scheduling layer on throughput under load. A later layer may keep a pass that pays with an earlier
layer's objective: continuous batching under a burst shares the cores between the streams, so
each stream decodes slower while the burst is served sooner (the step's reason says so: "at a cost
no guard forbids: decode_tokens_per_s -64%"). The final plan then cannot beat the baseline on the
earlier objective by the earlier step's margin, and requiring it would call every such trade "not
confirmed". So an objective is *traded* when a later kept step, judged on another objective, made
it worse beyond that step's own threshold; the confirmation reports it with the step that traded
it and does not require it to improve (:func:`fractal_opt.report.confirmation.traded_lines` writes it). Every other kept layer's objective must still improve
beyond noise against the baseline.

Example:
    >>> from types import SimpleNamespace as S
    >>> rt = S(layer="hardware", pass_name="runtime", changes={"decode_tokens_per_s": 1.6}, bands={"decode_tokens_per_s": 0.7})
    >>> cb = S(layer="scheduling", pass_name="batching", changes={"decode_tokens_per_s": -0.64, "throughput_tokens_per_s": 0.49},
    ...        bands={"decode_tokens_per_s": 0.1, "throughput_tokens_per_s": 0.05})
    >>> objective = {"hardware": "decode_tokens_per_s", "scheduling": "throughput_tokens_per_s"}.get
    >>> required, traded = split_objectives([rt, cb], objective)
    >>> required, traded["decode_tokens_per_s"]["by"]
    (['throughput_tokens_per_s'], 'scheduling/batching')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..measure.metrics import METRICS
from ..serving.server import in_flight_limit
from ..tower.plan import Plan
from .confirm import drift

__all__ = ["annotate", "measured_alone", "split_objectives"]


def split_objectives(kept: Sequence[Any], objective_of: Callable[[str], str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """(objectives the confirmation requires, objectives traded by a later kept step).

    ``kept``: the kept steps in run order (each with ``layer``, ``pass_name``, ``changes`` and
    ``bands`` against the plan kept before it); ``objective_of(layer)``: the policy's objective of
    a layer. A traded entry says which step traded it, its change there and that step's objective.
    """
    objectives = [objective_of(s.layer) for s in kept]
    traded: dict[str, dict[str, Any]] = {}
    for i, metric in enumerate(objectives):
        for later, later_objective in zip(kept[i + 1:], objectives[i + 1:]):
            if later_objective == metric or metric not in METRICS:
                continue
            change, band = later.changes.get(metric), later.bands.get(metric)
            if change is None or band is None:
                continue
            worse = -change if METRICS[metric] else change
            if worse > band:
                traded[metric] = {"by": f"{later.layer}/{later.pass_name}", "change": round(change, 4), "band": round(band, 4),
                                  "for": later_objective}
    required = [m for m in dict.fromkeys(objectives) if m not in traded]
    return required, traded


def measured_alone(kept: Sequence[Any], traded: dict[str, dict[str, Any]], objective_of: Callable[[str], str]) -> list[str]:
    """The traded objectives their own step measured one request at a time (its plan served one
    request in flight): the confirmation measures those again one at a time. An objective kept
    with requests in flight together (throughput under continuous batching) has no such figure to
    hold the final plan to, and is only reported as traded. A step without a recorded plan counts
    as one at a time."""
    out = []
    for metric in traded:
        own = next((s for s in reversed(kept) if objective_of(s.layer) == metric), None)
        plan = getattr(own, "plan", None)
        if own is not None and (not plan or in_flight_limit(Plan.from_dict(plan).scheduling) == 1):
            out.append(metric)
    return out


def annotate(fields: dict[str, Any], *, kept: Sequence[Any], traded: dict[str, dict[str, Any]], objective_of: Callable[[str], str],
             calibration: dict[str, Any], min_effect: float, alone: Sequence[str] | None = None) -> None:
    """Add to a confirmation's ``fields`` whether it agrees with the step that kept the final plan
    (``confirmation.drift``, :func:`~.confirm.drift`) and the objectives later steps traded
    (``confirmation.traded``); ``alone`` (default: every traded one) are those measured again one
    request at a time (:func:`measured_alone`)."""
    last = kept[-1]  # the step that kept the final plan
    objective = objective_of(last.layer)
    d = drift(fields, step=f"{last.layer}/{last.pass_name}", objective=objective, in_step=last.metrics.get(objective),
              calibration=calibration, min_effect=min_effect)
    if d is not None:
        fields["confirmation"]["drift"] = d
    if traded:
        again = set(traded if alone is None else alone)
        fields["confirmation"]["traded"] = {m: {**t, **(_alone(fields, m, kept, objective_of, calibration, min_effect) if m in again else {})}
                                            for m, t in traded.items()}


def _alone(fields: dict[str, Any], metric: str, kept: Sequence[Any], objective_of: Callable[[str], str], calibration: dict[str, Any],
           min_effect: float) -> dict[str, Any]:
    """``{"alone": ...}``: a traded ``metric`` measured one request at a time in the confirmation
    (its ``at 1 client`` entry), with its drift against the last kept step judged on it; {} without one."""
    entry = next((e for e in fields["confirmation"].get("at_loads") or [] if e.get("clients") == 1 and not e.get("headline")), None)
    numbers = (entry or {}).get("metrics", {}).get(metric)
    if numbers is None:
        return {}
    alone = {k: numbers[k] for k in ("change", "interval", "band", "verdict", "baseline_median", "final_median")}
    own = next((s for s in reversed(kept) if objective_of(s.layer) == metric), None)
    if own is not None and (d := drift({"confirmation": entry}, step=f"{own.layer}/{own.pass_name}", objective=metric,
                                       in_step=own.metrics.get(metric), calibration=calibration, min_effect=min_effect)) is not None:
        alone["drift"] = d
    return {"alone": alone}
