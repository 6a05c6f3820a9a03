"""The runner: baseline, then for each pass check -> apply -> build -> measure -> judge -> keep or roll back.

Rollback is free: a pass returns a new Plan, and rolling it back means keeping the previous one.
Every step is written to the output folder as it finishes (``trace.json``, ``report.md`` and
``recipe.yaml`` of the best plan so far), so a failed or killed run never loses work.

The runner knows no particular pass or runtime. It asks a pass through its protocol (``expand``,
``unavailable``, ``check``, ``apply``; :mod:`.gate`), a runtime through the Engine protocol
(``refuse``, ``prepare``, ``serve``, ``census``), and the recipe's policy for the verdict.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import runtimes
from ..engine.protocol import Engine
from ..errors import EngineError, ModelSourceError, RecipeError, RunFailed
from ..machine import Machine, resolve_device
from ..measure.machine_limits import MachineLimits, probe_limits
from ..measure.metrics import Measurement
from ..passes import Layer, Pass
from ..plan import Plan
from ..quality.evals import eval_set_name, load_eval_set, score
from ..quality.probes import agreement, agreement_between, build_reference, model_probes
from ..quiet import quiet_third_party
from ..recipe import Recipe, dump_recipe, load_recipe
from ..text import clip
from ..workload import Request
from . import confirm
from .deadline import StepTimeout, WorkerAbandoned, abandoned, checkpoint, run_with_deadline
from .gate import PassSteps, skip_reason
from .outputs import write_outputs
from .progress import Progress
from .resume import MEASURER_STATE, Resumable
from .step_measurement import Comparison, StepMeasurer, read_shape
from .targets import note_targets, stop_reason
from .trace import Step, Trace

__all__ = ["Pipeline", "Result", "optimize"]

# What a build function looks like: fractal_opt.runtimes.build, or a test's fake.
Build = Callable[..., Engine]


@dataclass
class Result:
    """What a run produced: the final plan, the trace, and the tuned recipe."""

    plan: Plan
    trace: Trace
    recipe: Recipe
    out_dir: Path | None = None

    def _repr_html_(self) -> str:
        """In a notebook: the same content as report.html."""
        return self.trace._repr_html_()

    def __repr__(self) -> str:
        where = f"\n  results in {self.out_dir} (report.html, report.md, trace.json, recipe.yaml)" if self.out_dir else ""
        plan, trace = (repr(x).replace("\n", "\n    ") for x in (self.plan, self.trace))  # their own lines, indented under them
        return f"Result(\n  plan: {plan}\n  trace: {trace}{where}\n)"


class Pipeline(Resumable):
    """Run a recipe: measure the baseline, then try each pass in tower order.

    Args:
        recipe: a Recipe, a path to a YAML recipe, YAML text or a dict.
        out_dir: where trace.json, report.md and recipe.yaml are written after every step (None = nowhere).
        progress: show a live status line on stderr.
        machine: a probed Machine (probed here when None).
        build: ``build(plan, *, machine, progress, max_new_tokens) -> Engine``; None = the runtime the
            plan names (:func:`fractal_opt.runtimes.build`). Tests pass a fake
            (:meth:`fractal_opt.testing.FakeEngine.factory`), as httpx tests pass a MockTransport.
        refuse: ``refuse(plan) -> str | None``, what the runtime cannot honour; None = the runtime's
            own (:func:`fractal_opt.runtimes.refuse`).
        limits: the machine's bandwidth and matmul ceilings (probed here, cached per machine, when None).
        stop_at_target: once every target of the recipe is met, skip the remaining steps (recorded with that reason).
        wait_quiet: before the A/A calibration, wait up to this many seconds for other processes to leave the CPU (0 = no wait).
        resume: continue the run in ``out_dir`` from its journal (its finished steps are not measured
            again); refused when the recipe, the model files or the machine changed.
        force: replace the run in ``out_dir``. Without resume or force, a folder holding a run is refused.
    """

    def __init__(
        self,
        recipe: Recipe | str | Path | dict,
        *,
        out_dir: str | Path | None = None,
        progress: bool | Callable[[str], None] = True,
        machine: Machine | None = None,
        build: Build | None = None,
        refuse: Callable[[Plan], str | None] | None = None,
        limits: MachineLimits | None = None,
        stop_at_target: bool = False,
        wait_quiet: float = 0.0,
        resume: bool = False,
        force: bool = False,
    ):
        # A real build needs the weights and tokenizer too, so a model folder without them is
        # refused here (exit 2) rather than by the baseline's loader; a fake build needs neither.
        self.recipe = load_recipe(recipe, complete_model=build is None)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.resume, self.force = resume, force
        if self.out_dir is not None:
            self._check_out()  # a file, an unwritable folder, another run's folder: refused before anything loads
        self.progress = progress if callable(progress) else Progress(bool(progress))
        self.machine = machine
        self.build = build or runtimes.build
        self.refuse = refuse or runtimes.refuse
        self.limits = limits
        self.stop_at_target = stop_at_target
        self.wait_quiet = wait_quiet  # seconds the calibration may wait for other work to leave the CPU (0 = no wait)
        # Loaded now, so a bad eval set or probe fails before any model is loaded.
        eval_set = eval_set_name(self.recipe.quality.eval, self.recipe.model)  # "auto": basics for an embedded model
        self._eval_items = load_eval_set(eval_set) if eval_set else []
        self._probes = self.recipe.quality.load_probes()
        # The state of one run, set by run(): the kept plan and what was measured for it.
        self._trace = Trace(recipe=self.recipe.to_dict())
        self._requests: list[Request] = []
        self._steps: StepMeasurer | None = None
        self._reference: Any = None  # the baseline's reference logits and outputs (quality probes)
        self._model_probes: dict[tuple, dict[str, float]] = {}  # by Plan.numerics_key()
        self._plan = self.recipe.base_plan()
        self._current: Measurement | None = None
        self._current_quality: dict[str, Any] = {}
        self._weight_mb: float | None = None  # the kept plan's weights (census), MB
        self._machine: Machine | None = None
        self._limits: MachineLimits | None = None  # the ceilings in use (given, probed, or from the journal)
        self._stage = ""  # what the step in progress is doing, for its failure message
        self._outcome = ""  # the last tried step's verdict outcome, for its journal record
        # Resume (pipeline/journal.py): the journal, and what it holds of the run being resumed.
        self._journal: Journal | None = None
        self._journaled_baseline: dict[str, Any] | None = None
        self._replay: dict[int, dict[str, Any]] = {}  # finished steps by position (1 = the first step)
        self._reference_outputs: dict[str, list[int]] | None = None  # a resumed baseline's outputs, until the reference is scored again

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        machine = self.recipe.machine.on(self.machine or Machine.probe())  # the recipe's machine price, for the cost per token
        self._trace = Trace(recipe=self.recipe.to_dict(), machine=machine.to_dict())
        self._model_probes = {}
        self._requests = self.recipe.workload.requests()
        passes = list(self.recipe.passes)
        self._machine = machine
        self._open_journal(machine)  # refuses a resume whose inputs changed; marks the run in progress
        self._baseline(machine)
        for index, p in enumerate(passes, start=1):
            if self.stop_at_target and (done := stop_reason(self._trace)):  # every target met: the rest is skipped
                step = Step(pass_name=p.name, layer=p.layer.section, params=p.params(), status="", reason="")
                self._skip(step, f"[{index}/{len(passes)}] {p.layer.section}/{p.describe()}", done)
                self._record(step)
                continue
            # A pass runs as the steps it proposes one at a time (a search: from its levels' outcomes).
            steps = PassSteps(p)
            for s in steps:
                label = f"{steps.label(index, len(passes))} {s.layer.section}/{s.describe()}"
                step = Step(pass_name=s.name, layer=s.layer.section, params=s.params(), status="", reason="")
                outcome = self._try(s, p if steps.searches else None, step, label, machine)
                steps.record(s, step.status, outcome, step.reason)
                self._record(step)
            if (found := steps.conclusion(self.recipe.policy.guards_for(p.layer))) is not None:  # a search's answer
                self._trace.searches.append(found)
                self._trace.steps[-1].reason += f" Search result: {found['answer']} ({found['summary']})."
                self.progress(f"[{index}/{len(passes)}] {p.layer.section}/{p.name}: {found['answer']}")
                self._save()

        self._confirm_final(machine)  # final vs baseline, measured again (pipeline/confirm.py)
        self._trace.finished = True
        self._save()
        if isinstance(self.progress, Progress):
            self.progress.done("done" + (f": results in {self.out_dir}" if self.out_dir else ""))
        return Result(plan=self._plan, trace=self._trace, recipe=self._trace.to_recipe(), out_dir=self.out_dir)

    def _baseline(self, machine: Machine) -> None:
        """The baseline: from the journal when resuming, else measured (:meth:`_measure_baseline`)
        within ``policy.timeout_s``. A failing baseline ends the run: the failure is recorded in
        trace.json (finished) and :class:`~fractal_opt.errors.RunFailed` says why."""
        if not self._restore_baseline(machine):
            try:
                run_with_deadline(lambda: self._measure_baseline(machine), self.recipe.policy.timeout_s, name="baseline")
            except (Exception, SystemExit, StepTimeout) as e:  # noqa: BLE001 - every failure is recorded, then ends the run
                self._fail_baseline(e)
            self._journal_baseline()
        self._finish()
        note_targets(self._trace, self._trace.baseline)  # the gap to each target
        self._save()

    def _measure_baseline(self, machine: Machine) -> None:
        """Build and measure the recipe's base plan twice (A/A) to calibrate this machine's noise."""
        recipe, say, trace = self.recipe, self._say, self._trace
        plan = self._plan = recipe.base_plan()
        limits = self.limits
        self._enter("baseline: machine ceilings")
        if limits is None:
            say("probing the machine's bandwidth and matmul ceilings (cached per machine)")
            limits = probe_limits(resolve_device(plan.hardware.device, machine), machine=machine, shape=read_shape(plan.source))
        trace.machine["limits"] = limits.to_dict()
        self._limits = limits
        self._steps = self._new_measurer(machine, limits)
        self._enter("baseline: pre-flight")
        refused, _ = self._steps.preflight(plan)
        if refused:
            raise EngineError(f"the baseline cannot run on this machine: {refused}")
        say(f"baseline: loading {recipe.model}")
        self._enter("baseline: build")
        engine, timings = self._build(plan, machine)
        # The reference is scored before any measurement, so the memory it holds is part of every
        # measurement alike (baseline included) and cannot masquerade as a pass's memory cost.
        say("baseline: scoring the reference text")
        self._enter("baseline: reference")
        self._reference = build_reference(engine, {}, recipe.quality)
        watch = sorted({recipe.policy.objective_for(p.layer) for p in recipe.passes} or {"decode_tokens_per_s"})  # what the verdicts will judge
        self._enter("baseline: measure")
        current, trace.calibration = self._steps.calibrate(engine, "baseline (A/A calibration, interleaved)", watch=watch)
        self._reference.outputs = current.outputs
        self._enter("baseline: quality")
        quality = self._quality(engine, current, "baseline")
        checkpoint()  # a baseline past its deadline leaves the trace alone (the runner records the timeout)
        trace.baseline = Step(
            pass_name="baseline", layer="-", params={}, status="baseline",
            reason="plain transformers: " + _plan_text(plan),
            metrics=_metrics(current, quality), plan=plan.to_dict(), census=engine.census(),
            timings={**timings, "warmup_s": round(current.warmup_s, 2)},
        )
        trace.baseline.metrics["roofline"] = self._steps.roofline(engine, current)
        # The weights the plan holds, from the census: peak RSS cannot show a quantization's
        # saving while the previous plan's model is resident for interleaved measurement.
        self._weight_mb = trace.baseline.metrics["weight_mb"] = round(trace.baseline.census["weight_bytes"] / 2**20, 1)
        self._current, self._current_quality = current, quality

    def _try(self, p: Pass, ramp: Pass | None, step: Step, label: str, machine: Machine) -> str:
        """One step: from the journal when resuming, else attempted (:meth:`_attempt`) within
        ``policy.timeout_s`` (:mod:`.deadline`). Whatever the step raises ends it ``failed`` and the
        run goes on. Returns the verdict's outcome ("" when the step was not judged)."""
        if (outcome := self._from_journal(step, label)) is None:
            kept_state = (self._plan, self._current, self._current_quality, self._weight_mb)
            outcome = ""
            try:
                outcome = run_with_deadline(lambda: self._attempt(p, ramp, step, label, machine), self.recipe.policy.timeout_s, name=f"step {label}")
            except WorkerAbandoned as e:
                # The worker may still run: the state it could touch goes back to before the step, and
                # the next step gets a fresh measurer (the old one's engines are the worker's now).
                self._plan, self._current, self._current_quality, self._weight_mb = kept_state
                self._steps = self._new_measurer(machine, self._limits, like=self._steps)
                self._fail(step, label, e)
            except (Exception, SystemExit, StepTimeout) as e:  # noqa: BLE001 - raised past _attempt's own handler (in its clean-up)
                if step.status != "failed":
                    self._fail(step, label, e)
        self._outcome = outcome
        return outcome

    def _attempt(self, p: Pass, ramp: Pass | None, step: Step, label: str, machine: Machine) -> str:
        """Skip the step, or build, measure and judge it. Every stage (check, apply, pre-flight,
        build, measure, quality, judge) is inside the failure handling: a failed step is recorded,
        its candidate released as a rollback would, and the run goes on."""
        assert self._steps is not None and self._current is not None
        engine: Engine | None = None
        mode = ""
        try:
            self._enter("check")
            if (reason := skip_reason(p, self._plan, machine, refuse=self.refuse)) is not None:
                checkpoint()  # past its deadline, a worker writes nothing (here and below)
                self._skip(step, label, reason)
                return ""
            self._enter("apply")
            candidate = p.apply(self._plan).with_applied(p.name)
            self._enter("pre-flight")
            refused, numbers = self._steps.preflight(candidate)
            if refused:
                checkpoint()
                step.metrics = {"preflight": numbers}
                self._skip(step, label, refused)
                return ""
            self._enter("reference")
            self._rescore_reference(machine)  # resuming: once, before the first step measured here
            self._enter("build")
            mode = self._steps.before_build(candidate, self._plan)
            self.progress(f"{label}: building")
            engine, timings = self._build(candidate, machine)
            checkpoint()
            step.timings.update(timings)
            step.census = engine.census()
            self._enter("measure")
            t0 = time.perf_counter()
            cmp = self._steps.compare(engine, self._current, mode=mode, objective=self.recipe.policy.objective_for(p.layer), label=label)
            checkpoint()  # a worker past its deadline leaves the kept state alone
            self._current = cmp.before
            step.timings["warmup_s"] = round(cmp.after.warmup_s, 2)
            step.timings["measure_s"] = round(time.perf_counter() - t0, 2)
            self._enter("quality")
            quality = self._quality(engine, cmp.after, label)
            if "path_agreement" in self._guarded(p) and not candidate.application.do_sample:
                # Path equivalence: with greedy decoding a serving path must not change a token.
                quality.update(path_agreement=agreement_between(self._current.outputs, cmp.after.outputs))
            self._enter("judge")
            return self._judge(p, ramp, step, label, candidate, engine, cmp, quality, mode)
        except (Exception, SystemExit, StepTimeout) as e:  # noqa: BLE001 - a failing step is recorded and rolled back; the run goes on
            if abandoned():
                return ""  # the runner recorded this step's timeout and went on: touch nothing
            if self._stage == "check":
                self._stage = _gate_stage(e, p)
            self._fail(step, label, e)
            self._release(engine, mode)
            return ""

    def _judge(self, p: Pass, ramp: Pass | None, step: Step, label: str, candidate: Plan, engine: Engine, cmp: Comparison,
               quality: dict[str, Any], mode: str) -> str:
        """Judge a measured step against the kept plan; keep it or roll it back. Returns the outcome."""
        assert self._steps is not None and self._trace.baseline is not None
        after = cmp.after
        step.metrics = _metrics(after, quality)
        step.metrics["weight_mb"] = round(step.census["weight_bytes"] / 2**20, 1)
        step.metrics.update(intervals=cmp.intervals, comparison=cmp.info, roofline=self._steps.roofline(engine, after))
        if cmp.info.get("mode") == "interleaved":  # the previous plan in the same rounds (one_user reads it); back to back it is an older measurement
            step.metrics["previous"] = cmp.before.summary()
        before_values = {**_metrics(cmp.before, self._current_quality), "weight_mb": self._weight_mb, **self._current_quality}
        after_values = {**step.metrics, **quality}
        changes = cmp.changes
        if self._weight_mb:  # a census number: exact, so no noise band
            changes = {**changes, "weight_mb": step.metrics["weight_mb"] / self._weight_mb - 1}
        baseline_metrics = self._trace.baseline.metrics
        baseline_values = {**{k: v for k, v in baseline_metrics.items() if k != "quality"}, **baseline_metrics["quality"]}
        verdict = self.recipe.policy.judge(p.layer, before_values, after_values, changes, cmp.bands, baseline=baseline_values,
                                           intervals=cmp.intervals)
        step.changes, step.bands = verdict.changes, verdict.bands
        step.metrics["guards"] = verdict.guards  # the guards in force, for the report
        step.plan = candidate.to_dict()
        kept, step.reason = verdict.kept, verdict.reason
        if ramp is not None and (note := ramp.holds(verdict.outcome)):
            kept, step.reason = True, f"holds, {step.reason}; {note}"
        step.status = "kept" if kept else "rolled_back"
        if "compile_s" in step.timings:  # a start-up cost the numbers exclude: shown where the verdict is read
            step.reason += f" Start-up: compiling took {step.timings['compile_s']:.1f} s (excluded from the numbers above)."
        self.progress(f"{label}: {step.status.replace('_', ' ')} ({_clip(step.reason, 160)})")
        checkpoint()  # a worker past its deadline leaves the engines and the kept state alone
        self._steps.after_verdict(kept, engine, candidate if kept else self._plan, mode)
        if kept:
            self._plan, self._current, self._current_quality = candidate, after, quality
            self._weight_mb = step.metrics["weight_mb"]
        return verdict.outcome

    # ------------------------------------------------------------------ failures
    def _fail(self, step: Step, label: str, e: BaseException) -> None:
        """Record ``e`` as the step's failure: which stage, what was raised, the last frames."""
        step.status = "failed"
        step.reason = _failure_text(e, self._stage, self.recipe.policy.timeout_s)
        step.timings["traceback"] = "".join(traceback.format_exception(e, limit=-4))[-2000:]  # type: ignore[assignment]
        self.progress(f"{label}: failed ({_clip(step.reason, 160)})")

    def _fail_baseline(self, e: BaseException) -> None:
        """The baseline failed: record it (trace.json finished, the failure as the baseline step) and end the run."""
        reason = _failure_text(e, self._stage or "baseline", self.recipe.policy.timeout_s)
        self._trace.baseline = Step(pass_name="baseline", layer="-", params={}, status="failed", reason=reason,
                                    timings={"traceback": "".join(traceback.format_exception(e, limit=-4))[-2000:]})  # type: ignore[dict-item]
        self._trace.finished = True
        self._save()
        self.progress(f"baseline: failed ({_clip(reason, 160)})")
        if isinstance(e, RecipeError | ModelSourceError):
            raise e  # bad input keeps its own message and exit code
        where = f" {self.out_dir / 'trace.json'} records it." if self.out_dir is not None else ""
        raise RunFailed(f"the baseline failed, so no pass was tried: {reason}.{where}") from e

    def _release(self, engine: Engine | None, mode: str) -> None:
        """After a failed step: close its candidate as a rollback would (best effort: when this fails
        too, the next step loads the kept plan again)."""
        if engine is None or self._steps is None or engine is self._steps.previous:
            return
        try:
            self._steps.after_verdict(False, engine, self._plan, mode)
        except (Exception, StepTimeout):  # noqa: BLE001 - the step has failed already; this is clean-up
            self._steps.previous = None

    def _new_measurer(self, machine: Machine, limits: MachineLimits | None, *, like: StepMeasurer | None = None) -> StepMeasurer:
        """A StepMeasurer for this run (``like``: carrying over another's calibration and memory)."""
        recipe, say = self.recipe, self.progress
        steps = StepMeasurer(machine=machine, workload=recipe.workload, requests=self._requests, min_effect=recipe.policy.min_effect,
                             limits=limits, progress=self._say, build=self.build, wait_quiet_s=self.wait_quiet, reprobe=self.limits is None,
                             note=say.done if isinstance(say, Progress) else say)  # note: a line that stays on a terminal
        for name in MEASURER_STATE if like is not None else ():
            setattr(steps, name, getattr(like, name, None))
        return steps

    def _enter(self, stage: str) -> None:
        """The step moves on to ``stage`` (named in its failure message); a step past its deadline stops here."""
        checkpoint()
        self._stage = stage

    def _say(self, message: str) -> None:
        """Progress from inside a step; also where a step past its deadline stops (:func:`.deadline.checkpoint`)."""
        checkpoint()
        self.progress(message)

    # ------------------------------------------------------------------ helpers
    def _build(self, plan: Plan, machine: Machine) -> tuple[Engine, dict[str, float]]:
        """Build ``plan``, then let the runtime do its start-up work (``Engine.prepare``: compiling
        every shape the suite needs) before any clock runs. Returns the engine and the timings."""
        workload = self.recipe.workload
        t0 = time.perf_counter()
        engine = self.build(plan, machine=machine, progress=self.progress, max_new_tokens=workload.max_new_tokens)
        timings = {"build_s": round(time.perf_counter() - t0, 2)}
        timings.update({name: round(seconds, 2) for name, seconds in engine.prepare(self._requests, workload).items()})
        return engine, timings

    def _guarded(self, p: Pass) -> set[str]:
        """The metrics the policy guards for ``p``'s layer (what the step must measure)."""
        return {g.metric for g in self.recipe.policy.guards_for(p.layer)}

    def _skip(self, step: Step, label: str, reason: str) -> None:
        step.status, step.reason = "skipped", reason
        self.progress(f"{label}: skipped ({reason.removeprefix('check: ')})")

    def _quality(self, engine: Engine, m: Measurement, label: str) -> dict[str, Any]:
        """Quality of the engine against the baseline. Model-level probes are recomputed only
        when the plan's numerics changed; the eval set and custom probes run on every step."""
        quality_cfg = self.recipe.quality
        if self._reference is None and self._machine is not None:
            self._rescore_reference(self._machine)  # resumed with every step from the journal (the final confirmation)
        key = engine.plan.numerics_key()
        if key not in self._model_probes:
            self.progress(f"{label}: KL / perplexity on the reference text")
            self._model_probes[key] = model_probes(self._reference, engine)
        out: dict[str, Any] = {**self._model_probes[key], **agreement(self._reference, m.outputs, cap=engine.plan.application.max_new_tokens)}
        out.update(_answers(engine, m.outputs))  # the side-by-side answers (report_answers.py)
        if self._trace.baseline is None:
            out["prompts"] = {r.id: r.messages[-1][1] for r in self._requests}
        if self._eval_items:
            self.progress(f"{label}: eval set ({len(self._eval_items)} questions)")
            base = self._trace.baseline.metrics.get("quality", {}).get("eval_items") if self._trace.baseline else None  # None: this is the baseline
            out.update(score(engine, self._eval_items, max_new_tokens=quality_cfg.eval_max_new_tokens, baseline=base))
        for name, probe in self._probes.items():
            try:
                values = probe(engine)
            except (Exception, SystemExit) as e:  # named here: the traceback alone points at the user's module
                code = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
                raise RuntimeError(f"custom probe {name!r} {code}") from e
            if not isinstance(values, dict):
                raise TypeError(f"custom probe {name!r} must return a dict of named numbers, got {type(values).__name__}")
            out.update({f"{name}.{k}": float(v) for k, v in values.items()})
        return out

    def _record(self, step: Step) -> None:
        self._trace.steps.append(step)
        self._journal_step(step)  # durable before the outputs show it
        self._finish()
        note_targets(self._trace, step)  # what is left of each target after this step
        self._save()

    def _finish(self) -> None:
        """The best plan so far (``trace.final``, status ``provisional``): its last medians, and no
        change against the baseline; that comes only from :meth:`_confirm_final`."""
        assert self._current is not None and self._trace.baseline is not None
        now = _metrics(self._current, self._current_quality)
        now["weight_mb"] = self._weight_mb
        kept = [f"{s.layer}/{s.pass_name}" for s in self._trace.steps if s.status == "kept"]
        self._trace.final = {"plan": self._plan.to_dict(), "kept": kept, "metrics": now, "status": "provisional", "vs_baseline": {}}

    def _confirm_final(self, machine: Machine) -> None:
        """After the last step: the final plan and the baseline measured again, interleaved, by the
        rule of every step (:mod:`.confirm`); ``trace.final``'s final-vs-baseline numbers come only
        from here. A final plan equal to the baseline is not measured; a failure is recorded."""
        assert self._steps is not None and self._trace.baseline is not None
        base = self.recipe.base_plan()
        kept = [s for s in self._trace.steps if s.status == "kept"]
        if not kept or confirm.same_plan(self._plan, base):
            self._trace.final.update(confirm.unchanged())
            return
        if self._restore_final():  # resuming a finished run: the journal's confirmation, nothing measured
            return
        objectives = [self.recipe.policy.objective_for(Layer.from_name(s.layer)) for s in kept]
        self.progress("final: measuring the final plan against the baseline again, interleaved")
        try:
            fields = confirm.confirm(self._steps, baseline_plan=base, final_plan=self._plan, build=lambda plan: self._build(plan, machine)[0],
                                     objectives=objectives, weight_mb=(self._trace.baseline.metrics.get("weight_mb"), self._weight_mb))
        except (Exception, MemoryError) as e:  # the steps stand; only the final comparison is missing
            fields = confirm.failed(e)
            self.progress(f"final: the confirmation failed ({fields['confirmation']['error'][:120]})")
        self._trace.final.update(fields)
        self._journal_final()

    def _save(self) -> None:
        if self.out_dir is None:
            return
        recipe, trace = self.recipe, self._trace
        self.out_dir.mkdir(parents=True, exist_ok=True)
        header = (
            f"# Tuned by fractal_opt from {recipe.name or recipe.model}: the kept passes only.\n"
            "# Load it in an app with fractal_opt.Engine.from_recipe(\"recipe.yaml\").\n"
        )
        # Each file whole after a kill at any moment: staged, fsynced, renamed (pipeline/outputs.py).
        write_outputs(self.out_dir, {
            "trace.json": trace.to_json(),
            "report.md": trace.to_markdown(),
            "report.html": trace.to_html(),  # the same run as pictures
            "recipe.yaml": dump_recipe(trace.to_recipe(), header=header),
        })


def _answers(engine: Engine, outputs: dict[str, list[int]]) -> dict[str, Any]:
    """The workload's greedy answers as text, for the reports; none from an engine that cannot decode ids."""
    try:
        return {"answers": {rid: engine.decode(ids) for rid, ids in outputs.items()}}
    except NotImplementedError:
        return {}


def _metrics(m: Measurement, quality: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(m.summary())
    out["spread"] = m.spreads()
    out["memory_source"] = m.memory_source
    out.update({k: v for k, v in m.extra.items() if k in ("gpu", "cuda_max_reserved_mb", "capacity_mb", "load", "activate_s", "cost")})  # GPU telemetry: "unavailable" on CPU; load: the profile and per-round request counts
    out["quality"] = dict(quality)
    return out


def _gate_stage(e: BaseException, p: Pass) -> str:
    """Which of the pass's methods raised inside the gate (:func:`.gate.skip_reason` calls
    ``unavailable``, ``check`` and ``apply``, the last to see whether the pass changes anything)."""
    methods = {getattr(type(p), name).__code__: name for name in ("unavailable", "check", "apply") if hasattr(getattr(type(p), name), "__code__")}
    stage, tb = "check", e.__traceback__
    while tb is not None:
        stage = methods.get(tb.tb_frame.f_code, stage)
        tb = tb.tb_next
    return stage


def _failure_text(e: BaseException, stage: str, timeout_s: float | None) -> str:
    """A failed step's reason: ``timeout after ...`` or ``<stage>: <Error>: <message>``."""
    if isinstance(e, StepTimeout):
        return f"timeout after {timeout_s:g} s (policy.timeout_s), in {stage}: the step was stopped"[:500]
    if isinstance(e, WorkerAbandoned):
        return f"{e} (it was in {stage})"[:500]
    if isinstance(e, SystemExit):
        return f"{stage}: SystemExit({e.code!r}): a step cannot end the run"[:500]
    return f"{stage}: {type(e).__name__}: {e}".strip()[:500]


def _plan_text(plan: Plan) -> str:
    hw = plan.hardware
    return f"{hw.dtype}, {hw.attention} attention, {hw.threads or 'default'} threads, {plan.model.kv_cache} KV cache, {plan.scheduling.batching} serving"


def optimize(recipe: Recipe | str | Path | dict, *, out: str | Path | None = None, progress: bool = True, stop_at_target: bool = False,
             wait_quiet: float = 0.0, resume: bool = False, force: bool = False) -> Result:
    """Optimize the model a recipe names; write trace.json, report.md and recipe.yaml to ``out``.

    ``resume=True`` continues the killed run in ``out`` from its journal; ``force=True`` replaces
    the run there (without either, a folder holding a run is refused: :class:`~fractal_opt.errors.ResumeError`).

    Example:
        >>> import fractal_opt
        >>> result = fractal_opt.optimize("recipes/quickstart.yaml", out="fractal-out")  # doctest: +SKIP
        >>> result.plan.scheduling.batching                                              # doctest: +SKIP
        'static'
    """
    quiet_third_party()  # load bars and import-time warnings would bury the progress line (as in the CLI)
    return Pipeline(recipe, out_dir=out, progress=progress, stop_at_target=stop_at_target, wait_quiet=wait_quiet, resume=resume, force=force).run()


def _clip(text: str, width: int) -> str:
    """``text`` cut at a word boundary to at most ``width`` characters, ending "… [report.md]" when
    cut: the progress line stays one screen line, and the whole reason is in the report."""
    return clip(text, width, tail=" … [report.md]", words=True)
