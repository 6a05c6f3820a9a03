"""The runner: baseline, then for each pass check -> apply -> build -> measure -> judge -> keep or roll back.

Rollback is free: a pass returns a new Plan, and rolling it back means keeping the previous one.
Every step is written to the output folder as it finishes (``trace.json``, ``report.md`` and
``recipe.yaml`` of the best plan so far), so a failed or killed run never loses work.

The runner knows no particular pass or runtime. It asks a pass through its protocol (``expand``,
``unavailable``, ``check``, ``apply``; :mod:`.gate`), a runtime through the Engine protocol
(``refuse``, ``prepare``, ``serve``, ``census``), and the recipe's policy for the verdict.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import runtimes
from ..engine.protocol import Engine
from ..errors import EngineError
from ..machine import Machine, resolve_device
from ..measure.machine_limits import MachineLimits, probe_limits
from ..measure.metrics import Measurement
from ..passes import Pass
from ..plan import Plan
from ..quality.evals import load_eval_set, score
from ..quality.probes import agreement, agreement_between, build_reference, model_probes
from ..recipe import Recipe, dump_recipe, load_recipe
from ..workload import Request
from .gate import expand_ramps, skip_reason
from .progress import Progress
from .step_measurement import Comparison, StepMeasurer
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
        return self.trace._repr_html_()


class Pipeline:
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
    ):
        self.recipe = load_recipe(recipe)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress = progress if callable(progress) else Progress(bool(progress))
        self.machine = machine
        self.build = build or runtimes.build
        self.refuse = refuse or runtimes.refuse
        self.limits = limits
        # Loaded now, so a bad eval set or probe fails before any model is loaded.
        self._eval_items = load_eval_set(self.recipe.quality.eval) if self.recipe.quality.eval else []
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

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        machine = self.machine or Machine.probe()
        self._trace = Trace(recipe=self.recipe.to_dict(), machine=machine.to_dict())
        self._model_probes = {}
        self._requests = self.recipe.workload.requests()
        schedule = expand_ramps(list(self.recipe.passes))
        self._baseline(machine)
        last_ramp: Pass | None = None
        last_outcome = ""  # the last judged step's Verdict.outcome ("" when it was not judged)
        for index, (p, ramp) in enumerate(schedule, start=1):
            label = f"[{index}/{len(schedule)}] {p.layer.section}/{p.describe()}"
            step = Step(pass_name=p.name, layer=p.layer.section, params=p.params(), status="", reason="")
            previous = self._trace.steps[-1] if self._trace.steps else None
            if ramp is not None and ramp is last_ramp and previous is not None and (stop := ramp.stop(previous.status, last_outcome)):
                # A ramp steps up only from a level that held; its last kept level is its answer.
                self._skip(step, label, f"{ramp.name} ramp stopped: {stop}")
            else:
                last_outcome = self._try(p, ramp, step, label, machine)
            last_ramp = ramp
            self._record(step)

        self._trace.finished = True
        self._save()
        if isinstance(self.progress, Progress):
            self.progress.done("done" + (f": results in {self.out_dir}" if self.out_dir else ""))
        return Result(plan=self._plan, trace=self._trace, recipe=self._trace.to_recipe(), out_dir=self.out_dir)

    def _baseline(self, machine: Machine) -> None:
        """Build and measure the recipe's base plan twice (A/A) to calibrate this machine's noise."""
        recipe, say, trace = self.recipe, self.progress, self._trace
        plan = self._plan = recipe.base_plan()
        limits = self.limits
        if limits is None:
            say("probing the machine's bandwidth and matmul ceilings (cached per machine)")
            limits = probe_limits(resolve_device(plan.hardware.device, machine), machine=machine)
        trace.machine["limits"] = limits.to_dict()
        self._steps = StepMeasurer(machine=machine, workload=recipe.workload, requests=self._requests, min_effect=recipe.policy.min_effect,
                                   limits=limits, progress=say, build=self.build)
        refused, _ = self._steps.preflight(plan)
        if refused:
            raise EngineError(f"the baseline cannot run on this machine: {refused}")
        say(f"baseline: loading {recipe.model}")
        engine, timings = self._build(plan, machine)
        # The reference is scored before any measurement, so the memory it holds is part of every
        # measurement alike (baseline included) and cannot masquerade as a pass's memory cost.
        say("baseline: scoring the reference text")
        self._reference = build_reference(engine, {}, recipe.quality)
        current, trace.calibration = self._steps.calibrate(engine, "baseline (A/A calibration, interleaved)")
        self._reference.outputs = current.outputs
        quality = self._quality(engine, current, "baseline")
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
        self._finish()
        self._save()

    def _try(self, p: Pass, ramp: Pass | None, step: Step, label: str, machine: Machine) -> str:
        """One pass: skip it, or build, measure and judge it; returns the verdict's outcome ("" unjudged)."""
        if (reason := skip_reason(p, self._plan, machine, refuse=self.refuse)) is not None:
            self._skip(step, label, reason)
            return ""
        assert self._steps is not None and self._current is not None
        candidate = p.apply(self._plan).with_applied(p.name)
        refused, numbers = self._steps.preflight(candidate)
        if refused:
            step.metrics = {"preflight": numbers}
            self._skip(step, label, refused)
            return ""
        try:
            mode = self._steps.before_build(candidate, self._plan)
            self.progress(f"{label}: building")
            engine, timings = self._build(candidate, machine)
            step.timings.update(timings)
            step.census = engine.census()
            t0 = time.perf_counter()
            cmp = self._steps.compare(engine, self._current, mode=mode, objective=self.recipe.policy.objective_for(p.layer), label=label)
            self._current = cmp.before
            step.timings["warmup_s"] = round(cmp.after.warmup_s, 2)
            step.timings["measure_s"] = round(time.perf_counter() - t0, 2)
            quality = self._quality(engine, cmp.after, label)
            if "path_agreement" in self._guarded(p) and not candidate.application.do_sample:
                # Path equivalence: with greedy decoding a serving path must not change a token.
                quality.update(path_agreement=agreement_between(self._current.outputs, cmp.after.outputs))
        except (Exception, MemoryError) as e:  # a failing pass is recorded and rolled back; the run goes on
            step.status = "failed"
            step.reason = f"{type(e).__name__}: {e}".strip()[:500]
            step.timings["traceback"] = traceback.format_exc(limit=3)[-2000:]  # type: ignore[assignment]
            self.progress(f"{label}: failed ({step.reason[:120]})")
            return ""
        return self._judge(p, ramp, step, label, candidate, engine, cmp, quality, mode)

    def _judge(self, p: Pass, ramp: Pass | None, step: Step, label: str, candidate: Plan, engine: Engine, cmp: Comparison,
               quality: dict[str, Any], mode: str) -> str:
        """Judge a measured step against the kept plan; keep it or roll it back. Returns the outcome."""
        assert self._steps is not None and self._trace.baseline is not None
        after = cmp.after
        step.metrics = _metrics(after, quality)
        step.metrics["weight_mb"] = round(step.census["weight_bytes"] / 2**20, 1)
        step.metrics.update(intervals=cmp.intervals, comparison=cmp.info, roofline=self._steps.roofline(engine, after))
        before_values = {**_metrics(cmp.before, self._current_quality), "weight_mb": self._weight_mb, **self._current_quality}
        after_values = {**step.metrics, **quality}
        changes = cmp.changes
        if self._weight_mb:  # a census number: exact, so no noise band
            changes = {**changes, "weight_mb": step.metrics["weight_mb"] / self._weight_mb - 1}
        baseline_metrics = self._trace.baseline.metrics
        baseline_values = {**{k: v for k, v in baseline_metrics.items() if k != "quality"}, **baseline_metrics["quality"]}
        verdict = self.recipe.policy.judge(p.layer, before_values, after_values, changes, cmp.bands, baseline=baseline_values)
        step.changes, step.bands = verdict.changes, verdict.bands
        step.plan = candidate.to_dict()
        kept, step.reason = verdict.kept, verdict.reason
        if ramp is not None and (note := ramp.holds(verdict.outcome)):
            kept, step.reason = True, f"holds, {step.reason}; {note}"
        step.status = "kept" if kept else "rolled_back"
        if "compile_s" in step.timings:  # a start-up cost the numbers exclude: shown where the verdict is read
            step.reason += f" Start-up: compiling took {step.timings['compile_s']:.1f} s (excluded from the numbers above)."
        self.progress(f"{label}: {step.status.replace('_', ' ')} ({step.reason[:150]})")
        self._steps.after_verdict(kept, engine, candidate if kept else self._plan, mode)
        if kept:
            self._plan, self._current, self._current_quality = candidate, after, quality
            self._weight_mb = step.metrics["weight_mb"]
        return verdict.outcome

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
        key = engine.plan.numerics_key()
        if key not in self._model_probes:
            self.progress(f"{label}: KL / perplexity on the reference text")
            self._model_probes[key] = model_probes(self._reference, engine)
        out: dict[str, Any] = {**self._model_probes[key], **agreement(self._reference, m.outputs)}
        if self._eval_items:
            self.progress(f"{label}: eval set {quality_cfg.eval!r}")
            out.update(score(engine, self._eval_items, max_new_tokens=quality_cfg.eval_max_new_tokens))
        for name, probe in self._probes.items():
            values = probe(engine)
            if not isinstance(values, dict):
                raise TypeError(f"custom probe {name!r} must return a dict of named numbers, got {type(values).__name__}")
            out.update({f"{name}.{k}": float(v) for k, v in values.items()})
        return out

    def _record(self, step: Step) -> None:
        self._trace.steps.append(step)
        self._finish()
        self._save()

    def _finish(self) -> None:
        """The best plan so far against the baseline (``trace.final``)."""
        assert self._current is not None and self._trace.baseline is not None
        baseline_metrics = self._trace.baseline.metrics
        now = _metrics(self._current, self._current_quality)
        now["weight_mb"] = self._weight_mb
        vs = {}
        for m in ("decode_tokens_per_s", "ttft_ms", "e2e_ms", "throughput_tokens_per_s", "weight_mb"):
            b, a = baseline_metrics.get(m), now.get(m)
            if b and a is not None:
                vs[m] = round(a / b - 1, 4)
        kept = [f"{s.layer}/{s.pass_name}" for s in self._trace.steps if s.status == "kept"]
        self._trace.final = {"plan": self._plan.to_dict(), "kept": kept, "metrics": now, "vs_baseline": vs}

    def _save(self) -> None:
        if self.out_dir is None:
            return
        recipe, trace = self.recipe, self._trace
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.out_dir / "trace.json", trace.to_json())
        _atomic_write(self.out_dir / "report.md", trace.to_markdown())
        header = (
            f"# Tuned by fractal_opt from {recipe.name or recipe.model}: the kept passes only.\n"
            "# Load it in an app with fractal_opt.Engine.from_recipe(\"recipe.yaml\").\n"
        )
        _atomic_write(self.out_dir / "recipe.yaml", dump_recipe(trace.to_recipe(), header=header))


def _metrics(m: Measurement, quality: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(m.summary())
    out["spread"] = m.spreads()
    out["memory_source"] = m.memory_source
    out.update({k: v for k, v in m.extra.items() if k in ("gpu", "cuda_max_reserved_mb", "capacity_mb", "load")})  # GPU telemetry: "unavailable" on CPU; load: the profile and per-round request counts
    out["quality"] = dict(quality)
    return out


def _plan_text(plan: Plan) -> str:
    hw = plan.hardware
    return f"{hw.dtype}, {hw.attention} attention, {hw.threads or 'default'} threads, {plan.model.kv_cache} KV cache, {plan.scheduling.batching} serving"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def optimize(recipe: Recipe | str | Path | dict, *, out: str | Path | None = None, progress: bool = True) -> Result:
    """Optimize the model a recipe names; write trace.json, report.md and recipe.yaml to ``out``.

    Example:
        >>> import fractal_opt
        >>> result = fractal_opt.optimize("recipes/quickstart.yaml", out="fractal-out")  # doctest: +SKIP
        >>> result.plan.scheduling.batching                                              # doctest: +SKIP
        'static'
    """
    return Pipeline(recipe, out_dir=out, progress=progress).run()
