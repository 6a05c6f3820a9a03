"""The final confirmation: after the last step, the final plan measured against the baseline.

Every step is judged against the plan kept before it, minutes after the baseline was measured,
under whatever else the machine was doing then. Setting the kept plan's last medians beside the
baseline's is therefore not a measurement of "final vs baseline": on a busy machine two
measurements of the *same* plan differed by up to 38% (+11.8% and -38% on one plan). So after the last step the
baseline and the final plan are served in the same rounds, A B / B A, with the rule of every step
(:func:`~fractal_opt.measure.runner.measure_pair`, paired t intervals over rounds per metric, the
threshold of :func:`~fractal_opt.measure.noise.band`: the interval half-width, at least ``min_effect``), and "final vs baseline" in trace.json,
report.md and the terminal comes only from that comparison, with its intervals. When no pass was
kept the final plan is the baseline: nothing is measured and no change is printed.

``trace.final["status"]``:

- ``provisional``: written after every step, the best plan so far; not compared with the baseline.
- ``unchanged``: no pass was kept; nothing changed.
- ``confirmed``: measured again; the objective of every layer that kept a pass improved beyond noise.
- ``not_confirmed``: measured again; some kept layer's objective did not (the note says which).
- ``failed``: the confirmation could not run (the error is kept); no final-vs-baseline numbers.

Both plans are offered the same load. Under a closed load profile a plan's offered load follows its
``max_concurrency`` (a concurrency search settles on 16 clients where the profile, and so the
baseline, has 8: :func:`~fractal_opt.measure.rounds.offered_clients`); then both plans are measured
at the final plan's load, the headline "final vs baseline" (what the user will run), and again at
the baseline's, shown beside it (``confirmation.at_loads``, each labelled "at N clients"). The drift
check compares the headline's final with its own step, which measured it at that same load.

An objective a later kept step traded (:mod:`.objectives`: continuous batching shares the cores, so
each stream of a burst decodes slower) is measured where the step that kept it measured it: when
the headline load holds more than one request in flight, both plans are served again one request
at a time (1 client, ``at_loads`` labelled "at 1 client"), and the traded objective must improve
there, or the final is not confirmed. That comparison judges the traded objective alone, so it
stops after one A B / B A pair of rounds when that objective's interval is settled there.

When the two plans do not fit in memory together (the step measurer's own rule), they are measured
one after the other instead, and the band includes twice the calibration's A/A drift, as a
back-to-back step's does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..measure.metrics import METRICS, Measurement
from ..measure.noise import band
from ..measure.rounds import offered_clients
from ..measure.runner import measure, measure_pair, paired_changes
from ..report.confirmation import HEADLINE
from ..report.reader import Reader
from .targets import note_targets

if TYPE_CHECKING:
    from ..engine.protocol import Engine
    from ..tower.plan import Plan
    from .step_measurement import StepMeasurer

__all__ = ["RESIDENT", "confirm", "drift", "failed", "offered_entries", "offered_loads", "same_plan", "settle", "unchanged"]

# Numbers of the process rather than of a plan while both plans are resident (interleaved): the
# confirmation leaves them out, so the final plan's figure is its own step's, measured alone.
RESIDENT = ("peak_memory_mb", "memory_headroom_mb")


def same_plan(a: Plan, b: Plan) -> bool:
    """True when two plans serve alike: every section equal (the list of applied passes aside)."""
    da, db = a.to_dict(), b.to_dict()
    da.pop("applied", None)
    db.pop("applied", None)
    return da == db


def unchanged() -> dict[str, Any]:
    """``trace.final``'s fields when the final plan is the baseline: no comparison, no deltas."""
    return {"status": "unchanged", "vs_baseline": {}, "confirmation": {}}


def failed(error: BaseException) -> dict[str, Any]:
    """``trace.final``'s fields when the confirmation could not run: the error, and no deltas."""
    return {"status": "failed", "vs_baseline": {}, "confirmation": {"error": f"{type(error).__name__}: {error}".strip()[:500]}}


def confirm(
    steps: StepMeasurer,
    *,
    baseline_plan: Plan,
    final_plan: Plan,
    build: Callable[[Plan], Engine],
    objectives: Iterable[str],
    weight_mb: tuple[float | None, float | None] = (None, None),
    label: str = "final vs baseline",
    alone: Sequence[str] = (),
) -> dict[str, Any]:
    """Measure ``final_plan`` against ``baseline_plan`` after the last step; ``trace.final``'s fields.

    Both plans are offered the same load. When the two plans would be offered different loads
    (a concurrency search raised the final plan's clients, :func:`offered_loads`), both are
    measured at the final plan's load (the headline: what the user will run) and again at the
    baseline's (``confirmation.at_loads`` holds both, labelled).

    Args:
        steps: the run's step measurer: its fit rule decides interleaved or back to back, its
            engine of the kept plan is reused, and its workload, requests, ``min_effect`` and
            calibration are the ones every step used.
        build: ``build(plan) -> Engine``, prepared for measurement (the runner's own build).
        objectives: the objectives of the layers that kept a pass: the final plan is
            ``confirmed`` when each of them improved beyond noise. Rounds are added (up to the
            workload's ``max_repeats``) while the last one's interval is unsettled, as in a step.
        weight_mb: the baseline's and the final plan's weights from the census (exact, no interval).
        alone: the objectives a later kept step traded: measured again one request at a time
            (:func:`offered_entries`), where they must improve beyond noise.
    """
    objectives = list(dict.fromkeys(objectives))
    objective = objectives[-1] if objectives else "decode_tokens_per_s"
    offered = offered_loads(steps.workload, baseline_plan, final_plan)
    entries = offered_entries(offered, objectives, alone)
    loads = [clients for clients, _, _ in entries]
    clock = _Clock()
    mode = steps.before_build(baseline_plan, final_plan)  # keeps the final plan's engine resident when both fit
    pairs, drift, note = _measure(steps, mode, baseline_plan, final_plan, build, entries, objective=objective,
                                  traded=len(entries) > len(offered), label=label, clock=clock)
    same = {"mode": mode, "min_effect": steps.min_effect, "drift": drift, "weight_mb": weight_mb}
    labelled = len(loads) > 1  # one load: the note is as it always was
    fields = [record(before, after, note=note + (_at(clients, whose) if labelled else ""), objectives=objs, **same)
              for (before, after), (clients, whose, objs) in zip(pairs, entries)]
    head = fields[0]
    conf = head["confirmation"]
    if loads[0] is not None:
        conf["clients"] = loads[0]
    if len(loads) > 1:
        conf["at_loads"] = [_at_load(f, clients, whose, headline=i == 0) for i, (f, (clients, whose, _)) in enumerate(zip(fields, entries))]
    if alone:
        _hold_traded_alone(head, fields, entries)
    conf["timings"] = clock.timings()
    return head


def _hold_traded_alone(head: dict[str, Any], fields: Sequence[Mapping[str, Any]], entries: Sequence[tuple]) -> None:
    """A traded objective that does not improve one request at a time (the last entry) leaves the final unconfirmed."""
    if len(fields) < 2 or entries[-1][0] != 1 or fields[-1]["status"] == "confirmed":
        return
    conf = head["confirmation"]
    head["status"] = "not_confirmed"
    why = f"one request at a time, {fields[-1]['confirmation'].get('not_confirmed', 'the traded objective did not improve')}"
    conf["not_confirmed"] = "; ".join(filter(None, (conf.get("not_confirmed"), why)))


def offered_loads(workload: Any, baseline_plan: Plan, final_plan: Plan) -> list[int | None]:
    """The offered loads the confirmation measures both plans at: the final plan's first (the
    headline), then the baseline's when it differs (:func:`~fractal_opt.measure.rounds.offered_clients`).
    ``[None]`` when the load does not depend on the plan (the suite, poisson, conversations, capacity)."""
    final, base = offered_clients(workload, final_plan), offered_clients(workload, baseline_plan)
    return [final] if final == base else [final, base]


def offered_entries(loads: list[int | None], objectives: list[str], alone: Sequence[str]) -> list[tuple[int | None, str, list[str]]]:
    """(clients, whose load, the objectives judged there) for each comparison the confirmation makes:
    the :func:`offered_loads`, then, for the objectives a later step traded (``alone``), one request
    at a time when the headline holds more than one in flight (the load their own step had)."""
    entries = [(clients, whose, objectives) for clients, whose in _whose(loads)]
    if alone and (loads[0] or 0) > 1 and 1 not in loads:
        entries.append((1, f"one request at a time, where {', '.join(alone)} was kept", list(alone)))
    return entries


def _whose(loads: list[int | None]) -> list[tuple[int | None, str]]:
    """Each load with whose it is: the final plan's offered load first, then the baseline's."""
    if len(loads) == 1:
        return [(loads[0], "both plans' offered load")]
    return [(loads[0], "the final plan's offered load"), (loads[1], "the baseline's offered load")]


def _at(clients: int | None, whose: str) -> str:
    """The note's load: ``", at 16 clients (the final plan's offered load)"``; "" without a closed load."""
    return "" if clients is None else f", at {clients} client{'' if clients == 1 else 's'} ({whose})"


def _at_load(fields: Mapping[str, Any], clients: int | None, whose: str, *, headline: bool) -> dict[str, Any]:
    """One entry of ``confirmation.at_loads``: the comparison at one offered load, labelled."""
    conf = fields["confirmation"]
    entry = {"clients": clients, "label": f"at {clients} client{'' if clients == 1 else 's'}", "whose": whose, "headline": headline, "status": fields["status"],
             "rounds": conf["rounds"], "metrics": conf["metrics"]}
    if "not_confirmed" in conf:
        entry["not_confirmed"] = conf["not_confirmed"]
    return entry


class _Clock:
    """The confirmation's own time, split like a step's (``confirmation.timings``): build and measure seconds."""

    def __init__(self) -> None:
        self.build_s = 0.0
        self.measure_s = 0.0

    def build(self, build: Callable[[Plan], Engine], plan: Plan) -> Engine:
        t0 = time.perf_counter()
        try:
            return build(plan)
        finally:
            self.build_s += time.perf_counter() - t0

    def measure(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.measure_s += time.perf_counter() - t0

    def timings(self) -> dict[str, float]:
        return {"build_s": round(self.build_s, 2), "measure_s": round(self.measure_s, 2)}


def _measure(steps: StepMeasurer, mode: str, baseline_plan: Plan, final_plan: Plan, build: Callable[[Plan], Engine], entries: Sequence[tuple], *,
             objective: str, traded: bool, label: str, clock: _Clock) -> tuple[list[tuple[Measurement, Measurement]], Mapping[str, float], str]:
    """Both plans at every entry's load, interleaved or (when they do not fit together) back to
    back: the (before, after) pairs, the drift the band adds, and the note saying which."""
    if mode == "interleaved":
        pairs = _interleaved(steps, baseline_plan, final_plan, build, entries, objective=objective, traded=traded, label=label, clock=clock)
        return pairs, {}, "baseline and final plan measured again after the last step, interleaved (A B / B A)"
    loads = [clients for clients, _, _ in entries]
    pairs = _back_to_back(steps, baseline_plan, final_plan, build, loads, label=label, clock=clock)
    return pairs, steps.calibration, ("baseline and final plan did not fit in memory together: measured again one after the other; "
                                      "the band includes 2 x the A/A drift")


def _interleaved(steps: StepMeasurer, baseline_plan: Plan, final_plan: Plan, build: Callable[[Plan], Engine], entries: Sequence[tuple], *,
                 objective: str, traded: bool, label: str, clock: _Clock) -> list[tuple[Measurement, Measurement]]:
    """Both plans resident, measured in the same rounds (A B / B A) at each offered load in turn.
    ``traded``: the last entry is the one-request-at-a-time check of traded objectives, which
    judges its own objective only, so it stops after one A B / B A pair when that one is settled."""
    final_engine = steps.previous if steps.previous is not None else clock.build(build, final_plan)
    steps.say(f"{label}: loading the baseline again")
    base_engine = clock.build(build, baseline_plan)
    try:
        out = []
        for i, (clients, _, objs) in enumerate(entries):
            alone = traded and i == len(entries) - 1
            out.append(clock.measure(measure_pair, base_engine, final_engine, steps.workload, requests=steps.requests, objective=objs[-1] if alone else objective,
                                     min_effect=steps.min_effect, warm_previous=True, progress=_progress(steps, label, clients, len(entries)),
                                     clients=clients, min_repeats=2 if alone else None))
        return out
    finally:
        if base_engine is not final_engine:
            base_engine.close()


def _back_to_back(steps: StepMeasurer, baseline_plan: Plan, final_plan: Plan, build: Callable[[Plan], Engine], loads: list[int | None], *,
                  label: str, clock: _Clock) -> list[tuple[Measurement, Measurement]]:
    """Each plan built alone and measured at every offered load, then released (so the next has the memory)."""
    before = _alone(build, baseline_plan, steps, loads, label=label, clock=clock)
    after = _alone(build, final_plan, steps, loads, label=label, clock=clock)
    return list(zip(before, after))


def _alone(build: Callable[[Plan], Engine], plan: Plan, steps: StepMeasurer, loads: list[int | None], *, label: str, clock: _Clock) -> list[Measurement]:
    """Build ``plan``, measure it on its own at each offered load, and release it."""
    engine = clock.build(build, plan)
    try:
        return [clock.measure(measure, engine, steps.workload, requests=steps.requests, progress=_progress(steps, label, clients, len(loads)),
                              clients=clients) for clients in loads]
    finally:
        engine.close()
        steps.runtimes.clear_cache()


def _progress(steps: StepMeasurer, label: str, clients: int | None, n_loads: int) -> Callable[[str], None]:
    at = f" at {clients} clients" if n_loads > 1 else ""
    return lambda m: steps.say(f"{label}: measuring{at}, {m}")


def record(
    before: Measurement,
    after: Measurement,
    *,
    mode: str,
    note: str,
    objectives: list[str],
    min_effect: float,
    drift: Mapping[str, float] | None = None,
    weight_mb: tuple[float | None, float | None] = (None, None),
) -> dict[str, Any]:
    """``trace.final``'s fields from the two measurements (baseline ``before``, final ``after``).

    Per metric: the paired change and its 95% interval, the threshold (``band``), the two medians (labelled
    as such: the change is not their ratio) and a verdict ``better`` / ``worse`` / ``within noise``.
    """
    intervals = paired_changes(before, after)
    drift = drift or {}
    b_sum, a_sum = before.summary(), after.summary()
    metrics: dict[str, dict[str, Any]] = {}
    for m in METRICS:
        iv = intervals.get(m)
        if iv is None or (mode == "interleaved" and m in RESIDENT):
            continue
        width = round(band(iv, min_effect=min_effect, drift=drift.get(m)), 4)
        gain = iv.change if METRICS[m] else -iv.change
        verdict = "better" if gain > width else "worse" if gain < -width else "within noise"
        metrics[m] = {"change": round(iv.change, 4), "interval": iv.to_list(), "band": width, "verdict": verdict,
                      "baseline_median": b_sum.get(m), "final_median": a_sum.get(m)}
    base_w, final_w = weight_mb
    if base_w and final_w is not None:  # census figures: exact, the change is their ratio
        metrics["weight_mb"] = {"change": round(final_w / base_w - 1, 4), "baseline": base_w, "final": final_w, "source": "census",
                                "verdict": "better" if final_w < base_w else "worse" if final_w > base_w else "within noise"}
    missing = [o for o in objectives if o not in metrics]
    short = [o for o in objectives if o in metrics and metrics[o]["verdict"] != "better"]
    status = "confirmed" if objectives and not missing and not short else "not_confirmed"
    why = ""
    if short:
        why = "the objective " + ", ".join(f"{o} is {metrics[o]['verdict']}" for o in short) + " against the baseline"
    if missing:
        why += ("; " if why else "") + "no paired number for " + ", ".join(missing)
    confirmation = {"mode": mode, "rounds": len(after.repeats), "note": note, "objectives": objectives, "metrics": metrics}
    if why:
        confirmation["not_confirmed"] = why
    vs = {m: metrics[m]["change"] for m in (*HEADLINE, "weight_mb") if m in metrics}
    return {"status": status, "vs_baseline": vs, "confirmation": confirmation}


def settle(trace: Any) -> None:
    """After a confirmation measured the final plan: ``trace.final["metrics"]`` holds one figure per
    metric, the confirmation's wherever it measured one (at the final plan's offered load,
    :meth:`~fractal_opt.report.reader.Reader.final_metrics`), the step's elsewhere (quality, the
    census, the peak memory a plan shows alone), and the targets are judged on those figures."""
    if trace.final.get("status") in ("confirmed", "not_confirmed"):
        trace.final["metrics"] = Reader(trace).final_metrics()
        note_targets(trace)


def drift(fields: Mapping[str, Any], *, step: str, objective: str, in_step: Any, calibration: Mapping[str, Any],
          min_effect: float) -> dict[str, Any] | None:
    """Whether the confirmed final agrees with the step that kept it: ``confirmation.drift``.

    ``in_step`` is the objective's median in that step (``step``, its label), the confirmation's
    is the final plan's median here. They agree when their ratio is within the calibrated noise:
    the A/A calibration's interval half-width for the metric (``calibration["resolution"]``), at
    least ``min_effect``. A disagreement means the final plan was measured under other conditions
    than its own step (another engine resident, the machine's load): the report says so.
    None when either number is missing.
    """
    entry = ((fields.get("confirmation") or {}).get("metrics") or {}).get(objective) or {}
    here = entry.get("final_median")
    if not (isinstance(here, int | float) and isinstance(in_step, int | float) and in_step > 0):
        return None
    noise = max(min_effect, float((calibration.get("resolution") or {}).get(objective) or 0.0))
    change = here / in_step - 1
    return {"metric": objective, "step": step, "confirmed": here, "in_step": in_step, "change": round(change, 4),
            "noise": round(noise, 4), "agrees": abs(change) <= noise}
