"""The runner: baseline, then for each pass check -> apply -> build -> measure -> judge -> keep or roll back.

Rollback is free: a pass returns a new Plan, and rolling it back means keeping the previous :class:`~.resume.Kept` value. Every
step is written to the output folder as it finishes (``trace.json``, ``report.md`` and ``recipe.yaml`` of the best plan so far),
and to the run's journal (:class:`~.resume.RunJournal`), so a failed or killed run never loses work.

The runner knows no particular pass or runtime. It asks a pass through its protocol (``expand``, ``unavailable``, ``check``,
``apply``; :mod:`.gate`), the runtimes through the registry it was given (:class:`~fractal_opt.engine.registry.Runtimes`: build,
refuse, eviction) and the Engine protocol (``prepare``, ``serve``, ``census``), and the recipe's policy for the verdict.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import EngineError
from ..core.machine import Machine, resolve_device
from ..core.quiet import quiet_third_party
from ..core.text import clip
from ..core.threads import in_own_thread
from ..engine.protocol import Engine
from ..engine.registry import RUNTIMES, Runtimes
from ..language.recipe import Recipe, load_recipe
from ..measure.machine_limits import MachineLimits, probe_limits
from ..measure.metrics import Measurement
from ..report.trace import Step, Trace
from ..tower.passes import Layer, Pass, SearchContext
from ..tower.plan import Plan
from ..workloads.workload import Request
from . import confirm, records
from .deadline import StepTimeout, WorkerAbandoned, checkpoint, run_with_deadline
from .gate import PassSteps, skip_reason
from .objectives import annotate, measured_alone, split_objectives
from .progress import Progress
from .result import Result, write_run
from .resume import MEASURER_STATE, Kept, RunJournal, check_out
from .run_info import now, run_info
from .step_attempt import StepEnv, attempt
from .step_measurement import StepMeasurer, read_shape
from .step_quality import StepQuality
from .targets import note_targets, stop_reason
from .time_budget import TimeBudget, search_context

__all__ = ["Pipeline", "Result", "optimize"]

Build = Callable[..., Engine]  # what a build function looks like: a registry's build, or a test's fake


class Pipeline:
    """Run a recipe: measure the baseline, then try each pass in tower order.

    Args:
        recipe: a Recipe, a path to a YAML recipe, YAML text or a dict.
        out_dir: where trace.json, report.md and recipe.yaml are written after every step (None = nowhere).
        progress: show a live status line on stderr.
        machine: a probed Machine (probed here when None).
        runtimes: the runtimes the run may use (:class:`~fractal_opt.engine.registry.Runtimes`):
            it builds each plan, says what a runtime refuses and evicts cached models between
            steps; None = the process's registry (:data:`fractal_opt.runtimes.RUNTIMES`).
        build: ``build(plan, *, machine, progress, max_new_tokens) -> Engine``; None = ``runtimes.build``.
            Tests pass a fake (:meth:`fractal_opt.testing.FakeEngine.factory`), as httpx tests pass a MockTransport.
        refuse: ``refuse(plan) -> str | None``, what the runtime cannot honour; None = ``runtimes.refuse``.
        limits: the machine's bandwidth and matmul ceilings (probed here, cached per machine, when None).
        stop_at_target: once every target of the recipe is met, skip the remaining steps (recorded with that reason).
        wait_quiet: before the A/A calibration, wait up to this many seconds for other processes to leave the CPU (0 = no wait).
        resume: continue the run in ``out_dir`` from its journal (its finished steps are not measured
            again); refused when the recipe, the model files or the machine changed.
        force: replace the run in ``out_dir``. Without resume or force, a folder holding a run is refused.
    """

    reconfirm: bool = False  # resuming a finished run: measure its final confirmation again (run --reconfirm)
    budget_s: float | None = None  # the run's time budget (run --budget), over the recipe's workload.budget_s

    def __init__(self, recipe: Recipe | str | Path | dict, *, out_dir: str | Path | None = None, progress: bool | Callable[[str], None] = True,
                 machine: Machine | None = None, runtimes: Runtimes | None = None, build: Build | None = None,
                 refuse: Callable[[Plan], str | None] | None = None, limits: MachineLimits | None = None, stop_at_target: bool = False,
                 wait_quiet: float = 0.0, resume: bool = False, force: bool = False):
        # A real build needs the weights and tokenizer too: a folder without them is refused here (exit 2), not by the loader.
        self.recipe = load_recipe(recipe, complete_model=build is None)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.resume, self.force = resume, force
        if self.out_dir is not None:
            check_out(self.out_dir, resume=resume, force=force)  # a file, an unwritable folder, another run's folder: refused before anything loads
        self.progress = progress if callable(progress) else Progress(bool(progress))
        self.machine, self.runtimes = machine, runtimes or RUNTIMES
        self.build, self.refuse = build or self.runtimes.build, refuse or self.runtimes.refuse
        self.limits, self.stop_at_target, self.wait_quiet = limits, stop_at_target, wait_quiet  # wait_quiet: seconds the calibration may wait for a quiet CPU
        self.quality = StepQuality(self.recipe, progress=self.progress)  # loads the eval set and probes: bad ones fail before any model loads
        # The state of one run, set by run(): the kept state, and what measures and records it.
        self.kept = Kept(plan=self.recipe.base_plan())
        self.journal = RunJournal(self.out_dir, progress=self.progress)
        self._trace = Trace(recipe=self.recipe.to_dict())
        self._requests: list[Request] = []
        self._steps: StepMeasurer | None = None
        self._machine: Machine | None = None  # the probed machine, with the recipe's price
        self._limits: MachineLimits | None = None  # the ceilings in use (given, probed, or from the journal)
        self._stage = ""  # what the step in progress is doing, for its failure message
        self._budget = TimeBudget(None)  # the run's time budget, started by run()

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        machine = self._machine = self.recipe.machine.on(self.machine or Machine.probe())  # the recipe's machine price, for the cost per token
        self._trace = Trace(recipe=self.recipe.to_dict(), machine=machine.to_dict(), run=run_info(self.recipe.to_dict(), machine.to_dict()))
        self._requests = self.recipe.workload.requests()
        self._budget = TimeBudget(self.budget_s or self.recipe.workload.budget_s)
        if isinstance(self.progress, Progress):
            self.progress.budget_s = self._budget.budget_s  # the status line shows the budget left
        passes = list(self.recipe.passes)
        self.journal.open(self.recipe, machine, resume=self.resume)  # refuses a resume whose inputs changed
        self._save()  # from here trace.json says finished: false, before any model loads
        self._baseline(machine)
        for index, p in enumerate(passes, start=1):
            if done := (self.stop_at_target and stop_reason(self._trace)) or self._budget.spent():  # every target met, or the budget spent
                step = Step(pass_name=p.name, layer=p.layer.section, params=p.params(), status="", reason="")
                self._skip(step, f"[{index}/{len(passes)}] {p.layer.section}/{p.describe()}", done)
                self._record(step, "")
                continue
            # A pass runs as the steps it proposes one at a time (a search: from the kept plan, the load and the budget left).
            steps = PassSteps(p, context=lambda after=len(passes) - index: self._context(machine, after))
            for s in steps:
                label = f"{steps.label(index, len(passes))} {s.layer.section}/{s.describe()}"
                step = Step(pass_name=s.name, layer=s.layer.section, params=s.params(), status="", reason="")
                outcome = self._try(s, p if steps.searches else None, step, label, machine)
                steps.record(s, step.status, outcome, step.reason, metrics=step.metrics, plan=step.plan)
                self._record(step, outcome)
            if (found := steps.conclusion(self.recipe.policy.guards_for(p.layer))) is not None:  # a search's answer
                self._trace.searches.append(found)
                if steps.history:  # its last step's reason carries the answer; a search that tried nothing has only its record
                    self._trace.steps[-1].reason += f" Search result: {found['answer']} ({found['summary']})."
                self.progress(f"[{index}/{len(passes)}] {p.layer.section}/{p.name}: {found['answer']}")
                self._save()
        self._confirm_final(machine)  # final vs baseline, measured again (pipeline/confirm.py)
        self._trace.finished = True
        self._save()
        if isinstance(self.progress, Progress):
            self.progress.done("done" + (f": results in {self.out_dir}" if self.out_dir else ""))
        return Result(plan=self.kept.plan, trace=self._trace, recipe=self._trace.to_recipe(), out_dir=self.out_dir)

    def _context(self, machine: Machine, passes_after: int) -> SearchContext:  # the kept plan, the load, the gate's skip rule, the budget left
        return search_context(plan=self.kept.plan, machine=machine, workload=self.recipe.workload, trace=self._trace, budget=self._budget,
                              passes_after=passes_after, skip=lambda p, plan: skip_reason(p, plan, machine, refuse=self.refuse), runtimes=self.runtimes)

    def _baseline(self, machine: Machine) -> None:
        """The baseline: from the journal when resuming, else measured (:meth:`_measure_baseline`)
        within ``policy.timeout_s``. A failing baseline ends the run: the failure is recorded in
        trace.json (finished) and :class:`~fractal_opt.core.errors.RunFailed` says why."""
        if not self._restore_baseline(machine):
            try:
                run_with_deadline(lambda: self._measure_baseline(machine), self.recipe.policy.timeout_s, name="baseline")
            except (Exception, SystemExit, StepTimeout) as e:  # noqa: BLE001 - every failure is recorded, then ends the run
                self._fail_baseline(e)
            trace = self._trace
            assert trace.baseline is not None and self.quality.reference is not None
            self.journal.append_baseline(trace.baseline, calibration=trace.calibration, limits=trace.machine.get("limits"),
                                         reference_outputs=self.quality.reference.outputs, state=self.kept.to_record(self._steps))
        self._finish()
        note_targets(self._trace, self._trace.baseline)  # the gap to each target
        self._save()

    def _measure_baseline(self, machine: Machine) -> None:
        """Build and measure the recipe's base plan twice (A/A) to calibrate this machine's noise."""
        recipe, say, trace = self.recipe, self._say, self._trace
        plan = recipe.base_plan()
        self._enter("baseline: machine ceilings")
        limits = self.limits
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
        t0 = time.perf_counter()
        self.quality.score_reference(engine)
        spent = {"reference_s": round(time.perf_counter() - t0, 2)}  # where the baseline's time went (report.md), as a step's timings
        watch = sorted({recipe.policy.objective_for(p.layer) for p in recipe.passes} or {"decode_tokens_per_s"})  # what the verdicts will judge
        self._enter("baseline: measure")
        t0 = time.perf_counter()
        current, trace.calibration = self._steps.calibrate(engine, "baseline (A/A calibration, interleaved)", watch=watch)
        spent["measure_s"] = round(time.perf_counter() - t0, 2)
        self.quality.reference.outputs = current.outputs
        self._enter("baseline: quality")
        t0 = time.perf_counter()
        quality = self.quality.score(engine, current, "baseline", requests=self._requests, is_baseline=True)
        spent["quality_s"] = round(time.perf_counter() - t0, 2)
        checkpoint()  # a baseline past its deadline leaves the trace alone (the runner records the timeout)
        census = engine.census()
        trace.baseline = Step(pass_name="baseline", layer="-", params={}, status="baseline", reason=records.plan_text(plan),
                              metrics=self._metrics(current, quality), plan=plan.to_dict(), census=census,
                              timings={**timings, "warmup_s": round(current.warmup_s, 2), **spent})
        trace.baseline.metrics["roofline"] = self._steps.roofline(engine, current)
        self.kept = Kept(plan=plan, measurement=current, quality=quality, census=census)
        trace.baseline.metrics["weight_mb"] = self.kept.weight_mb

    def _try(self, p: Pass, ramp: Pass | None, step: Step, label: str, machine: Machine) -> str:
        """One step: from the journal when resuming, else attempted (:func:`.step_attempt.attempt`)
        within ``policy.timeout_s`` (:mod:`.deadline`). Whatever the step raises ends it ``failed``
        and the run goes on. Returns the verdict's outcome ("" when the step was not judged)."""
        if (outcome := self._from_journal(step, label)) is not None:
            return outcome
        assert self._steps is not None and self._trace.baseline is not None
        env = StepEnv(recipe=self.recipe, machine=machine, measurer=self._steps, baseline=self._trace.baseline,
                      build=lambda plan: self._build(plan, machine), refuse=self.refuse, quality=self._quality, metrics=self._metrics,
                      measured_quality=self.quality.measured, progress=self.progress, enter=self._enter, stage=lambda: self._stage, fail=self._fail,
                      before_build=lambda: self._rescore_reference(machine), clip=_clip)
        try:
            outcome, self.kept = run_with_deadline(lambda: attempt(env, p, ramp, step, label, self.kept), self.recipe.policy.timeout_s,
                                                   name=f"step {label}")
        except WorkerAbandoned as e:
            # The worker may still run: the kept state stays as before the step (it changes only by
            # what a step returns), and the next step gets a fresh measurer (the old one's engines are the worker's now).
            self._steps = self._new_measurer(machine, self._limits, like=self._steps)
            self._fail(step, label, e, self._stage)
            return ""
        except (Exception, SystemExit, StepTimeout) as e:  # noqa: BLE001 - raised past attempt's own handler (in its clean-up)
            if step.status != "failed":
                self._fail(step, label, e, self._stage)
            return ""
        return outcome

    # ------------------------------------------------------------------ failures
    def _fail(self, step: Step, label: str, e: BaseException, stage: str) -> None:  # which stage, what was raised, the last frames
        step.status = "failed"
        step.reason = records.failure_text(e, stage, self.recipe.policy.timeout_s)
        step.timings["traceback"] = records.traceback_text(e)  # type: ignore[assignment]
        self.progress(f"{label}: failed ({_clip(step.reason, 160)})")

    def _fail_baseline(self, e: BaseException) -> None:
        """The baseline failed: record it (trace.json finished, the failure as the baseline step) and end the run."""
        self._trace.baseline = records.failed_baseline(e, self._stage or "baseline", self.recipe.policy.timeout_s)
        self._trace.finished = True
        self._save()
        self.progress(f"baseline: failed ({_clip(self._trace.baseline.reason, 160)})")
        raise records.baseline_error(e, self._trace.baseline.reason, self.out_dir)

    # ------------------------------------------------------------------ helpers
    def _new_measurer(self, machine: Machine, limits: MachineLimits | None, *, like: StepMeasurer | None = None) -> StepMeasurer:
        """A StepMeasurer for this run (``like``: carrying over another's calibration and memory)."""
        say = self.progress
        steps = StepMeasurer(machine=machine, workload=self.recipe.workload, requests=self._requests, min_effect=self.recipe.policy.min_effect,
                             limits=limits, progress=self._say, runtimes=self.runtimes, build=self.build, wait_quiet_s=self.wait_quiet,
                             reprobe=self.limits is None, note=say.done if isinstance(say, Progress) else say)  # note: a line that stays on a terminal
        for name in MEASURER_STATE if like is not None else ():
            setattr(steps, name, getattr(like, name, None))
        return steps

    def _enter(self, stage: str) -> None:  # the step moves on to ``stage`` (named in its failure message); past its deadline it stops here
        checkpoint()
        self._stage = stage

    def _say(self, message: str) -> None:  # progress from inside a step; also where a step past its deadline stops (.deadline.checkpoint)
        checkpoint()
        self.progress(message)

    def _build(self, plan: Plan, machine: Machine) -> tuple[Engine, dict[str, float]]:
        """Build ``plan``, then let the runtime do its start-up work (``Engine.prepare``: compiling
        every shape the suite needs) before any clock runs. Returns the engine and the timings."""
        workload, t0 = self.recipe.workload, time.perf_counter()
        build = lambda: self.build(plan, machine=machine, progress=self.progress, max_new_tokens=workload.max_new_tokens)  # noqa: E731
        engine = in_own_thread(build, name="fractal-opt build")  # on a thread that ends: no OpenMP workers outlive it (core.threads)
        built_s = round(time.perf_counter() - t0, 2)
        prepared = in_own_thread(engine.prepare, self._requests, workload, name="fractal-opt build")
        return engine, {"build_s": built_s, **{name: round(seconds, 2) for name, seconds in prepared.items()}}

    def _skip(self, step: Step, label: str, reason: str) -> None:  # a step not tried, and why
        step.status, step.reason = "skipped", reason
        self.progress(f"{label}: skipped ({reason.removeprefix('check: ')})")

    def _quality(self, engine: Engine, m: Measurement, label: str) -> dict[str, Any]:
        """Quality of the engine against the baseline (:class:`.step_quality.StepQuality`)."""
        if self._machine is not None:
            self._rescore_reference(self._machine)  # resumed with every step from the journal (the final confirmation)
        base = self._trace.baseline
        baseline_eval = base.metrics.get("quality", {}).get("eval_items") if base is not None else None
        return self.quality.score(engine, m, label, requests=self._requests, baseline_eval=baseline_eval, is_baseline=base is None)

    def _metrics(self, m: Measurement, quality: dict[str, Any]) -> dict[str, Any]:  # keeping the telemetry the runtimes declare (.records.metrics)
        return records.metrics(m, quality, telemetry=[key for caps in self.runtimes for key in caps.telemetry])

    def _record(self, step: Step, outcome: str) -> None:
        self._trace.steps.append(step)
        position = len(self._trace.steps)
        self.journal.append_step(position, step, outcome=outcome, state=self.kept.to_record(self._steps))  # durable before the outputs show it
        self._finish()
        note_targets(self._trace, step)  # what is left of each target after this step
        self._save()

    def _finish(self) -> None:
        """The best plan so far (``trace.final``, ``provisional``): its last medians; no change against the baseline (:meth:`_confirm_final`)."""
        assert self.kept.measurement is not None and self._trace.baseline is not None
        now = self._metrics(self.kept.measurement, dict(self.kept.quality))
        now["weight_mb"] = self.kept.weight_mb
        kept = [f"{s.layer}/{s.pass_name}" for s in self._trace.steps if s.status == "kept"]
        self._trace.final = {"plan": self.kept.plan.to_dict(), "kept": kept, "metrics": now, "status": "provisional", "vs_baseline": {}}

    def _confirm_final(self, machine: Machine) -> None:
        """After the last step: the final plan and the baseline measured again, interleaved, by the rule of every step (:mod:`.confirm`);
        final-vs-baseline numbers come only from here. A final equal to the baseline is not measured; a failure is recorded."""
        assert self._steps is not None and self._trace.baseline is not None
        base, final = self.recipe.base_plan(), self.kept.plan
        kept = [s for s in self._trace.steps if s.status == "kept"]
        if not kept or confirm.same_plan(final, base):
            self._trace.final.update(confirm.unchanged())
            return
        if self.journal.restore_final(self._trace, reconfirm=self.reconfirm):  # resuming a finished run: nothing measured
            return
        objective_of = lambda layer: self.recipe.policy.objective_for(Layer.from_name(layer))  # noqa: E731
        objectives, traded = split_objectives(kept, objective_of)  # a later kept step may trade an earlier objective (.objectives)
        alone = measured_alone(kept, traded, objective_of)
        self.progress("final: measuring the final plan against the baseline again, interleaved")
        try:
            fields = confirm.confirm(self._steps, baseline_plan=base, final_plan=final, build=lambda plan: self._build(plan, machine)[0],
                                     objectives=objectives, weight_mb=(self._trace.baseline.metrics.get("weight_mb"), self.kept.weight_mb), alone=alone)
            annotate(fields, kept=kept, traded=traded, objective_of=objective_of, calibration=self._trace.calibration, min_effect=self.recipe.policy.min_effect, alone=alone)
        except (Exception, MemoryError) as e:  # the steps stand; only the final comparison is missing
            fields = confirm.failed(e)
            self.progress(f"final: the confirmation failed ({fields['confirmation']['error'][:120]})")
        self._trace.final.update(fields)
        confirm.settle(self._trace)  # one figure per metric for the final plan: the confirmation's
        self.journal.append_final(self._trace.final)

    def _save(self) -> None:
        self._trace.run["ended_at"] = now()  # the last moment known; the save after the last step is the end
        if self.out_dir is not None:
            write_run(self.out_dir, self.recipe, self._trace)

    # ------------------------------------------------------------------ resuming (the journal's records)
    def _restore_baseline(self, machine: Machine) -> bool:
        """Resuming: the baseline as the journal holds it (False when there is none to restore).
        The reference logits are not journaled; they are scored again when a step first needs them."""
        if (record := self.journal.restore_baseline(self._trace)) is None:
            return False
        self._limits = MachineLimits(**record["limits"]) if record.get("limits") else self.limits
        self._steps = self._new_measurer(machine, self._limits)
        self.quality.reference, self.quality.reference_outputs = None, record["reference_outputs"]
        self._restore(record["state"])
        return True

    def _from_journal(self, step: Step, label: str) -> str | None:
        """Resuming: ``step`` and the kept state after it from the journal; the record's outcome, or None (no more steps: this one runs)."""
        if (restored := self.journal.restore_step(len(self._trace.steps) + 1, step, label)) is None:
            return None
        outcome, state = restored
        self._restore(state)
        return outcome

    def _restore(self, state: dict[str, Any]) -> None:  # the kept state a journal record holds, and the measurer's memory with it
        self.kept, measurer = Kept.from_record(state)
        for name, value in measurer.items():
            setattr(self._steps, name, value)

    def _rescore_reference(self, machine: Machine) -> None:
        """Resuming: score the reference text again on the baseline plan, as the baseline did (the same model and
        machine, which the fingerprint vouches for), with the baseline's outputs from the journal. No-op when it is there."""
        if not self.quality.needs_reference():
            return
        assert self._steps is not None
        base = self.recipe.base_plan()
        self.progress("resuming: scoring the reference text on the baseline plan again (quality probes compare with it)")
        engine, _ = self._build(base, machine)
        self.quality.score_reference(engine, self.quality.reference_outputs)
        if base == self.kept.plan and self._steps.previous is None:
            self._steps.previous = engine  # the kept plan is still the baseline: its engine is the previous one
        else:
            engine.close()
            self.runtimes.evict_except({self.kept.plan.weights_key()})


def optimize(recipe: Recipe | str | Path | dict, *, out: str | Path | None = None, progress: bool = True, stop_at_target: bool = False,
             wait_quiet: float = 0.0, resume: bool = False, force: bool = False, runtimes: Runtimes | None = None) -> Result:
    """Optimize the model a recipe names; write trace.json, report.md and recipe.yaml to ``out``.

    ``resume=True`` continues the killed run in ``out`` from its journal; ``force=True`` replaces
    the run there (without either, a folder holding a run is refused: :class:`~fractal_opt.core.errors.ResumeError`).
    ``runtimes``: the runtimes the run may use (default: the process's registry, :data:`fractal_opt.runtimes.RUNTIMES`).

    Example:
        >>> import fractal_opt
        >>> result = fractal_opt.optimize("recipes/quickstart.yaml", out="fractal-out")  # doctest: +SKIP
        >>> result.plan.hardware.runtime                                                 # doctest: +SKIP
    """
    quiet_third_party()  # load bars and import-time warnings would bury the progress line (as in the CLI)
    return Pipeline(recipe, out_dir=out, progress=progress, stop_at_target=stop_at_target, wait_quiet=wait_quiet, resume=resume, force=force, runtimes=runtimes).run()


def _clip(text: str, width: int) -> str:  # a progress line stays one screen line; the whole reason is in the report
    return clip(text, width, tail=" … [report.md]", words=True)
