"""One step of a run: skip it, or build, measure and judge the candidate against the kept state.

:func:`attempt` is a function of the kept state (:class:`~.resume.Kept`) and returns the next one
with the verdict's outcome: the runner's state changes only by what a step returns, so a step
that had to be abandoned past its deadline changes nothing. What a step needs from its run (the
recipe, the measurer, the builder, the quality scorer, the failure recorder) comes in a
:class:`StepEnv`; the step itself is recorded in the :class:`~.trace.Step` it fills.

Speed first: a step whose objective did not beat its threshold is rolled back whatever its
quality, so its KL, perplexity, eval set and custom probes are not scored (``quality_skipped`` in
its metrics says why); the numbers its measured outputs give for free (agreement with the
baseline's answers, path agreement) are kept. A search level that may hold (``Pass.holds``) is
always scored: only its quality guards can refuse it. A screened candidate with other weights,
weight types or KV cache is scored right after its screen passes (:class:`_QualityFirst`), and a quality
guard that trips there ends it before the full rounds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.machine import Machine
from ..core.text import fmt
from ..engine.protocol import Engine
from ..language.guards import QUALITY_METRICS
from ..language.policy import Verdict
from ..language.recipe import Recipe
from ..measure.metrics import METRICS, Measurement
from ..quality.probes import agreement_between
from ..report.trace import Step
from ..tower.passes import Layer, Pass
from ..tower.plan import Plan
from . import records
from .deadline import StepTimeout, abandoned, checkpoint
from .gate import skip_reason
from .resume import Kept
from .step_measurement import Comparison, StepMeasurer

__all__ = ["StepEnv", "attempt"]


@dataclass(frozen=True)
class StepEnv:
    """What a step needs from its run."""

    recipe: Recipe
    machine: Machine
    measurer: StepMeasurer
    baseline: Step
    build: Callable[[Plan], tuple[Engine, dict[str, float]]]  # build, then prepare: the engine and its timings
    refuse: Callable[[Plan], str | None]
    quality: Callable[[Engine, Measurement, str], dict[str, Any]]
    measured_quality: Callable[[Engine, Measurement], dict[str, Any]]  # agreement and answers from the measured outputs: no model call
    metrics: Callable[[Measurement, dict[str, Any]], dict[str, Any]]
    progress: Callable[[str], None]
    enter: Callable[[str], None]  # the step moves on to a stage (named if it fails); a step past its deadline stops there
    stage: Callable[[], str]  # the stage it is in
    fail: Callable[[Step, str, BaseException, str], None]  # record a failure (step, label, error, stage)
    before_build: Callable[[], None]  # resuming: the reference scored again, once, before the first step measured here
    clip: Callable[[str, int], str]


def attempt(env: StepEnv, p: Pass, ramp: Pass | None, step: Step, label: str, kept: Kept) -> tuple[str, Kept]:
    """Skip the step, or build, measure and judge it. Every stage (check, apply, pre-flight,
    build, measure, quality, judge) is inside the failure handling: a failed step is recorded,
    its candidate released as a rollback would, and the run goes on. Returns the verdict's outcome
    ("" when the step was not judged) and the kept state after it."""
    assert kept.measurement is not None
    steps, engine, mode = env.measurer, None, ""
    try:
        env.enter("check")
        if (reason := skip_reason(p, kept.plan, env.machine, refuse=env.refuse)) is not None:
            checkpoint()  # past its deadline, a worker writes nothing (here and below)
            _skip(env, step, label, reason)
            return "", kept
        env.enter("apply")
        candidate = p.apply(kept.plan).with_applied(p.name)
        env.enter("pre-flight")
        refused, numbers = steps.preflight(candidate)
        if refused:
            checkpoint()
            step.metrics = {"preflight": numbers}
            _skip(env, step, label, refused)
            return "", kept
        env.enter("reference")
        env.before_build()
        env.enter("build")
        mode = steps.before_build(candidate, kept.plan)
        env.progress(f"{label}: building")
        engine, timings = env.build(candidate)
        checkpoint()
        step.timings.update(timings)
        step.census = engine.census()
        env.enter("measure")
        t0 = time.perf_counter()
        screen = ramp is not None and ramp.screens()  # a generated candidate: a short screen first (Pass.screens)
        first = _QualityFirst(env, p, step, label, kept, engine) if screen and _stores_differently(candidate, kept.plan) else None
        cmp = steps.compare(engine, kept.measurement, mode=mode, objective=env.recipe.policy.objective_for(p.layer), label=label, screen=screen,
                            quality_first=first)
        checkpoint()  # a worker past its deadline leaves the kept state alone
        scored_s = first.seconds if first is not None else 0.0  # the quality gate's time, counted as quality_s, not measure_s
        step.timings.update(warmup_s=round(cmp.after.warmup_s, 2), measure_s=round(time.perf_counter() - t0 - scored_s, 2))
        if cmp.screened_out and not cmp.stopped_by_quality:
            return _screened_out(env, step, label, kept, candidate, engine, cmp, mode)
        kept = dataclasses.replace(kept, measurement=cmp.before)  # the previous plan, measured afresh beside the candidate
        env.enter("quality")
        if first is not None and first.quality is not None:  # scored after the screen: the answers do not change with more rounds
            quality, unscored = {**first.quality, **env.measured_quality(engine, cmp.after), **_path_agreement(env, p, candidate, cmp)}, None
            step.timings["quality_s"] = first.seconds
        else:
            quality, unscored = _quality(env, p, ramp, step, label, kept, candidate, engine, cmp)
        env.enter("judge")
        return _judge(env, p, ramp, step, label, kept, candidate, engine, cmp, quality, mode, unscored=unscored)
    except (Exception, SystemExit, StepTimeout) as e:  # noqa: BLE001 - a failing step is recorded and rolled back; the run goes on
        if abandoned():
            return "", kept  # the runner recorded this step's timeout and went on: touch nothing
        stage = records.gate_stage(e, p) if env.stage() == "check" else env.stage()
        env.fail(step, label, e, stage)
        _release(steps, engine, kept.plan, mode)
        return "", kept


def _stores_differently(candidate: Plan, kept: Plan) -> bool:
    """Whether ``candidate`` computes from other stored numbers than ``kept``: other weights or
    weight types (another runtime's copy, a quantization) or another model section (its KV cache).
    Such a candidate is predicted faster for the bytes it drops, and whether it keeps the answers
    decides it; a knob that only reorders sums (batch sizes) is judged on speed first."""
    return candidate.weights_key() != kept.weights_key() or candidate.model != kept.model


class _QualityFirst:
    """A screened candidate that stores other numbers (:func:`_stores_differently`) is scored by
    the quality gate right after its screen passes, before the full rounds: an expert checks that
    a faster model still answers before timing it closely, and a quality guard that trips ends the
    step there (rolled back, with the one round's numbers)."""

    def __init__(self, env: StepEnv, p: Pass, step: Step, label: str, kept: Kept, engine: Engine):
        self.env, self.p, self.step, self.label, self.kept, self.engine = env, p, step, label, kept, engine
        self.quality: dict[str, Any] | None = None
        self.seconds = 0.0

    def __call__(self, cmp: Comparison) -> bool:
        """Whether the candidate may go on to the full rounds: no quality guard tripped."""
        t0 = time.perf_counter()
        self.quality = self.env.quality(self.engine, cmp.after, self.label)
        self.seconds = round(time.perf_counter() - t0, 2)
        kept = dataclasses.replace(self.kept, measurement=cmp.before)
        tripped = _verdict(self.env, self.p, self.step, kept, cmp, self.quality).tripped
        return not any(m in QUALITY_METRICS for m in tripped)


def _quality(env: StepEnv, p: Pass, ramp: Pass | None, step: Step, label: str, kept: Kept, candidate: Plan, engine: Engine,
             cmp: Comparison) -> tuple[dict[str, Any], tuple[str, Verdict] | None]:
    """The step's quality numbers, scored only when they can decide its verdict. First the free
    ones (agreement and path agreement from the measured outputs) and the verdict they give with
    the speed numbers; when quality cannot change it (the objective did not beat its threshold
    (:meth:`.Policy.objective_improved`) and no search may hold the level: ``ramp.holds``), that
    verdict stands and the probes and the eval are not run (returned with why)."""
    quality = {**env.measured_quality(engine, cmp.after), **_path_agreement(env, p, candidate, cmp)}
    unscored = None
    if not env.recipe.policy.objective_improved(p.layer, changes=cmp.changes, after=env.metrics(cmp.after, {}), bands=cmp.bands):
        env.enter("judge")  # the verdict without quality numbers: a judge that fails here fails as the judge
        early = _verdict(env, p, step, kept, cmp, quality)
        env.enter("quality")
        if ramp is None or ramp.holds(early.outcome) is None:  # a search level that may hold is kept only when no quality guard trips
            unscored = ("the objective did not improve beyond its threshold: no quality number can keep the step", early)
    if unscored is not None:
        env.progress(f"{label}: quality not scored ({unscored[0]})")
        return quality, unscored
    t0 = time.perf_counter()
    quality = env.quality(engine, cmp.after, label)
    step.timings["quality_s"] = round(time.perf_counter() - t0, 2)  # the probes' and eval's time (report: where the time went)
    quality.update(_path_agreement(env, p, candidate, cmp))
    return quality, None


def _path_agreement(env: StepEnv, p: Pass, candidate: Plan, cmp: Comparison) -> dict[str, float]:
    """Path equivalence: the share of greedy answers a serving path leaves token-identical,
    reported on every scheduling step; a guard only with policy.determinism: required."""
    if (p.layer is Layer.SCHEDULING or "path_agreement" in {g.metric for g in env.recipe.policy.guards_for(p.layer)}) \
            and not candidate.application.do_sample:
        return {"path_agreement": agreement_between(cmp.before.outputs, cmp.after.outputs)}
    return {}


def _verdict(env: StepEnv, p: Pass, step: Step, kept: Kept, cmp: Comparison, quality: dict[str, Any]) -> Verdict:
    """The policy's verdict on the candidate's numbers (``quality``: those scored so far) against the kept plan's."""
    after_values = {**env.metrics(cmp.after, quality), "weight_mb": _weight_mb(step.census), **quality}
    before_values = {**env.metrics(cmp.before, dict(kept.quality)), "weight_mb": kept.weight_mb, **kept.quality}
    changes = cmp.changes
    if kept.weight_mb:  # a census number: exact, so no noise band
        changes = {**changes, "weight_mb": after_values["weight_mb"] / kept.weight_mb - 1}
    base = env.baseline.metrics
    baseline_values = {**{k: v for k, v in base.items() if k != "quality"}, **base["quality"]}
    return env.recipe.policy.judge(p.layer, before_values, after_values, changes, cmp.bands, baseline=baseline_values, intervals=cmp.intervals)


def _weight_mb(census: dict[str, Any]) -> float:
    return round(census["weight_bytes"] / 2**20, 1)


def _judge(env: StepEnv, p: Pass, ramp: Pass | None, step: Step, label: str, kept: Kept, candidate: Plan, engine: Engine, cmp: Comparison,
           quality: dict[str, Any], mode: str, *, unscored: tuple[str, Verdict] | None = None) -> tuple[str, Kept]:
    """Judge a measured step against the kept plan; keep it or roll it back. ``unscored``: why its
    quality was not scored, and the verdict already reached without it."""
    after = cmp.after
    step.metrics = env.metrics(after, quality)
    step.metrics["weight_mb"] = _weight_mb(step.census)
    step.metrics.update(intervals=cmp.intervals, comparison=cmp.info, roofline=env.measurer.roofline(engine, after))
    if cmp.info.get("mode") == "interleaved":  # the previous plan in the same rounds (one_user reads it); back to back it is an older measurement
        step.metrics["previous"] = cmp.before.summary()
    verdict = unscored[1] if unscored else _verdict(env, p, step, kept, cmp, quality)
    step.changes, step.bands = verdict.changes, verdict.bands
    step.metrics["guards"] = verdict.guards  # the guards in force, for the report
    if verdict.tripped:  # which guards stopped the step (a search does not try the same weights again after a quality guard)
        step.metrics["tripped"] = {"guards": verdict.tripped, "quality": [m for m in verdict.tripped if m in QUALITY_METRICS]}
    step.plan = candidate.to_dict()
    keep, step.reason = verdict.kept, verdict.reason
    if cmp.stopped_by_quality:
        step.reason += ("; the quality gate ran after the screen (the answers' numbers change) and a quality guard tripped, "
                        "so the full rounds were not run")
    if quality.get("eval_stopped"):  # a required question lost: the rest of the quality gate was not run
        step.reason += f"; the eval stopped {quality['eval_stopped']}"
    if unscored:
        step.metrics["quality_skipped"] = unscored[0]
        step.reason += "; quality not scored (it cannot keep a step whose objective did not improve)"
    if ramp is not None and (note := ramp.holds(verdict.outcome)):
        keep, step.reason = True, f"holds, {step.reason}; {note}"
    step.status = "kept" if keep else "rolled_back"
    step.reason += records.startup_note(step.timings)  # a start-up cost the numbers exclude: shown where the verdict is read
    step.reason += records.contention_note(cmp.after, *([cmp.before] if cmp.info.get("mode") == "interleaved" else []))  # rounds re-run for contention
    env.progress(f"{label}: {step.status.replace('_', ' ')} ({env.clip(step.reason, 160)})")
    checkpoint()  # a worker past its deadline leaves the engines and the kept state alone
    env.measurer.after_verdict(keep, engine, candidate if keep else kept.plan, mode)
    if keep:
        kept = Kept(plan=candidate, measurement=after, quality=quality, census=step.census)
    return verdict.outcome, kept


def _screened_out(env: StepEnv, step: Step, label: str, kept: Kept, candidate: Plan, engine: Engine, cmp: Comparison, mode: str) -> tuple[str, Kept]:
    """A candidate its screen stopped: recorded with the screen's numbers and why, released as a
    rollback is; the kept state (and its last full measurement) stays as it was."""
    screen = cmp.info["screen"]
    step.metrics = env.metrics(cmp.after, {})
    step.metrics.update(weight_mb=_weight_mb(step.census), screen=screen, comparison=cmp.info)
    step.plan = candidate.to_dict()
    step.status = "screened_out"
    better = "above +" if METRICS.get(screen["metric"], True) else "below -"
    low, high = screen.get("interval") or (None, None)
    numbers = f"{screen['metric']} {screen['change']:+.1%} [95%: {low:+.1%}, {high:+.1%}] in {screen['rounds']} paired round" if low is not None \
        else f"{screen['metric']}: no paired reading"
    step.reason = (f"screened out: {numbers} against the kept plan ({fmt(screen['before'])} -> {fmt(screen['after'])}); "
                   f"the interval does not reach {better}{screen['min_effect']:.0%} (min_effect), so the full rounds and the quality gate were not run")
    env.progress(f"{label}: screened out ({env.clip(step.reason, 160)})")
    checkpoint()
    env.measurer.after_verdict(False, engine, kept.plan, mode)
    return "screened_out", kept


def _skip(env: StepEnv, step: Step, label: str, reason: str) -> None:
    step.status, step.reason = "skipped", reason
    env.progress(f"{label}: skipped ({reason.removeprefix('check: ')})")


def _release(steps: StepMeasurer, engine: Engine | None, plan: Plan, mode: str) -> None:
    """After a failed step: close its candidate as a rollback would (best effort: when this fails
    too, the next step loads the kept plan again)."""
    if engine is None or engine is steps.previous:
        return
    try:
        steps.after_verdict(False, engine, plan, mode)
    except (Exception, StepTimeout):  # noqa: BLE001 - the step has failed already; this is clean-up
        steps.previous = None
