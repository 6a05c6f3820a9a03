"""The runner: baseline, then for each pass check -> apply -> build -> measure -> judge -> keep or roll back.

Rollback is free: a pass returns a new Plan, and rolling it back means keeping the previous one.
Every step is written to the output folder as it finishes (``trace.json``, ``report.md`` and
``recipe.yaml`` of the best plan so far), so a failed or killed run never loses work.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EngineError
from ..layers.scheduling import expand_ramps
from ..machine import Machine, resolve_device
from ..measure.machine_limits import probe_limits
from ..measure.runner import Measurement
from ..passes import Layer
from ..plan import Plan
from ..quality.evals import load_eval_set, score
from ..quality.probes import agreement, agreement_between, build_reference, model_probes
from ..recipe import Recipe, dump_recipe, load_recipe
from ..runtimes import Engine
from .step_measurement import StepMeasurer
from .trace import Step, Trace

__all__ = ["Pipeline", "Result", "optimize"]


@dataclass
class Result:
    """What a run produced: the final plan, the trace, and the tuned recipe."""

    plan: Plan
    trace: Trace
    recipe: Recipe
    out_dir: Path | None = None

    def _repr_html_(self) -> str:
        return self.trace._repr_html_()


class Progress:
    """A live status line on stderr (a plain line per update when stderr is not a terminal)."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.perf_counter() - self.t0:6.1f}s] {message}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:200])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self, message: str) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r\033[K")
        self(message)
        if self.enabled and self.tty:
            self.stream.write("\n")


class Pipeline:
    """Run a recipe: measure the baseline, then try each pass in tower order.

    Args:
        recipe: a Recipe, a path to a YAML recipe, YAML text or a dict.
        out_dir: where trace.json, report.md and recipe.yaml are written after every step (None = nowhere).
        progress: show a live status line on stderr.
        machine: a probed Machine (probed here when None).
    """

    def __init__(self, recipe: Recipe | str | Path | dict, *, out_dir: str | Path | None = None, progress: bool | Callable[[str], None] = True, machine: Machine | None = None):
        self.recipe = load_recipe(recipe)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress = progress if callable(progress) else Progress(bool(progress))
        self.machine = machine
        # Loaded now, so a bad eval set or probe fails before any model is loaded.
        self._eval_items = load_eval_set(self.recipe.quality.eval) if self.recipe.quality.eval else []
        self._probes = self.recipe.quality.load_probes()

    def run(self) -> Result:
        recipe = self.recipe
        say = self.progress
        machine = self.machine or Machine.probe()
        trace = Trace(recipe=recipe.to_dict(), machine=machine.to_dict())
        requests = recipe.workload.requests()
        # A concurrency ramp runs as one step per level (layers/scheduling.py: expand_ramps).
        schedule = expand_ramps(list(recipe.passes))
        total = len(schedule)

        # --- baseline, measured twice (A/A) to calibrate the noise of this machine and workload
        plan = recipe.base_plan()
        say("probing the machine's bandwidth and matmul ceilings (cached per machine)")
        limits = probe_limits(resolve_device(plan.hardware.device, machine), machine=machine)
        trace.machine["limits"] = limits.to_dict()
        steps = StepMeasurer(machine=machine, workload=recipe.workload, requests=requests, min_effect=recipe.policy.min_effect, limits=limits, progress=say)
        refused, _ = steps.preflight(plan)
        if refused:
            raise EngineError(f"the baseline cannot run on this machine: {refused}")
        say(f"baseline: loading {recipe.model}")
        t0 = time.perf_counter()
        engine = Engine.build(plan, machine=machine, progress=say, max_new_tokens=recipe.workload.max_new_tokens)
        build_s = time.perf_counter() - t0
        # The reference is scored before any measurement, so the memory it holds is part of every
        # measurement alike (baseline included) and cannot masquerade as a pass's memory cost.
        say("baseline: scoring the reference text")
        self._reference = build_reference(engine, {}, recipe.quality)
        self._model_probes: dict[tuple, dict[str, float]] = {}
        current, trace.calibration = steps.calibrate(engine, "baseline (A/A calibration, interleaved)")
        self._reference.outputs = current.outputs
        current_quality = self._quality(engine, current, "baseline")
        trace.baseline = Step(
            pass_name="baseline", layer="-", params={}, status="baseline",
            reason="plain transformers: " + _plan_text(plan),
            metrics=_metrics(current, current_quality), plan=plan.to_dict(), census=engine.census(),
            timings={"build_s": round(build_s, 2), "warmup_s": round(current.warmup_s, 2)},
        )
        trace.baseline.metrics["roofline"] = steps.roofline(engine, current)
        baseline_metrics = trace.baseline.metrics
        # The weights the plan holds, from the census: peak RSS cannot show a quantization's
        # saving while the previous plan's model is resident for interleaved measurement.
        baseline_metrics["weight_mb"] = self._weight_mb = round(trace.baseline.census["weight_bytes"] / 2**20, 1)
        self._save(trace, plan, recipe)

        # --- the passes, bottom up
        outcome = ""  # the last judged step's Verdict.outcome
        for index, (p, ramp) in enumerate(schedule, start=1):
            label = f"[{index}/{total}] {p.layer.section}/{p.describe()}"
            step = Step(pass_name=p.name, layer=p.layer.section, params=p.params(), status="", reason="")
            if ramp is not None and index > 1 and schedule[index - 2][1] == ramp and (stop := _ramp_stop(trace.steps[-1], outcome)):
                # Step up only from a level that held; the last kept level is the ramp's answer.
                step.status, step.reason = "skipped", f"concurrency ramp stopped: {stop}"
                say(f"{label}: skipped ({step.reason})")
                self._record(trace, step, plan, recipe, baseline_metrics, current, current_quality)
                continue
            outcome = ""
            reason = p.check(plan, machine)
            if reason is not None:
                step.status, step.reason = "skipped", f"check: {reason}"
                say(f"{label}: skipped ({reason})")
                self._record(trace, step, plan, recipe, baseline_metrics, current, current_quality)
                continue
            candidate = p.apply(plan).with_applied(p.name)
            refused, numbers = steps.preflight(candidate)
            if refused:
                step.status, step.reason, step.metrics = "skipped", refused, {"preflight": numbers}
                say(f"{label}: skipped ({refused})")
                self._record(trace, step, plan, recipe, baseline_metrics, current, current_quality)
                continue
            try:
                mode = steps.before_build(candidate, plan)
                say(f"{label}: building")
                t0 = time.perf_counter()
                engine = Engine.build(candidate, machine=machine, progress=say, max_new_tokens=recipe.workload.max_new_tokens)
                step.timings["build_s"] = round(time.perf_counter() - t0, 2)
                step.census = engine.census()
                if candidate.hardware.compile is not None:
                    # Start-up cost a user pays once: compile every shape the suite needs (full
                    # budget, so the static cache reaches its final size) before the clock runs.
                    say(f"{label}: compiling the decode step (start-up cost, shown as compile_s, excluded from the numbers)")
                    t0 = time.perf_counter()
                    engine.serve(requests, max_new_tokens=recipe.workload.max_new_tokens, seed=recipe.workload.seed)
                    step.timings["compile_s"] = round(time.perf_counter() - t0, 2)
                t0 = time.perf_counter()
                cmp = steps.compare(engine, current, mode=mode, objective=recipe.policy.objective_for(p.layer), label=label)
                current, after = cmp.before, cmp.after
                step.timings["warmup_s"] = round(after.warmup_s, 2)
                step.timings["measure_s"] = round(time.perf_counter() - t0, 2)
                quality = self._quality(engine, after, label)
                if p.layer is Layer.SCHEDULING and not candidate.application.do_sample:
                    # Path equivalence: with greedy decoding a serving path must not change a token.
                    quality.update(path_agreement=agreement_between(current.outputs, after.outputs))
            except (Exception, MemoryError) as e:  # a failing pass is recorded and rolled back; the run goes on
                step.status = "failed"
                step.reason = f"{type(e).__name__}: {e}".strip()[:500]
                step.timings["traceback"] = traceback.format_exc(limit=3)[-2000:]  # type: ignore[assignment]
                say(f"{label}: failed ({step.reason[:120]})")
                self._record(trace, step, plan, recipe, baseline_metrics, current, current_quality)
                continue
            step.metrics = _metrics(after, quality)
            step.metrics["weight_mb"] = round(step.census["weight_bytes"] / 2**20, 1)
            step.metrics.update(intervals=cmp.intervals, comparison=cmp.info, roofline=steps.roofline(engine, after))
            bands, changes = cmp.bands, cmp.changes
            before_values = {**_metrics(current, current_quality), "weight_mb": self._weight_mb}
            after_values = {**step.metrics, **quality}
            before_values.update(current_quality)
            if self._weight_mb:  # a census number: exact, so no noise band
                changes = {**changes, "weight_mb": step.metrics["weight_mb"] / self._weight_mb - 1}
            baseline_values = {**{k: v for k, v in baseline_metrics.items() if k != "quality"}, **baseline_metrics["quality"]}
            verdict = recipe.policy.judge(p.layer, before_values, after_values, changes, bands, baseline=baseline_values)
            step.changes, step.bands = verdict.changes, verdict.bands
            step.plan = candidate.to_dict()
            kept, step.reason, outcome = verdict.kept, verdict.reason, verdict.outcome
            if ramp is not None and outcome == "no_change":
                # A ramp searches for the highest level that holds (the issue's "last level where
                # no guard trips"): a level that trips nothing and costs no throughput is kept, so
                # the plan's limit is the level measured, not a larger default.
                kept, step.reason = True, f"holds, {step.reason}; no guard tripped (a concurrency ramp keeps the highest level that holds)"
            step.status = "kept" if kept else "rolled_back"
            if "compile_s" in step.timings:  # a start-up cost the numbers exclude: shown where the verdict is read
                step.reason += f" Start-up: compiling took {step.timings['compile_s']:.1f} s (excluded from the numbers above)."
            say(f"{label}: {step.status.replace('_', ' ')} ({step.reason[:150]})")
            steps.after_verdict(kept, engine, plan if not kept else candidate, mode)
            if kept:
                plan, current, current_quality = candidate, after, quality
                self._weight_mb = step.metrics["weight_mb"]
            self._record(trace, step, plan, recipe, baseline_metrics, current, current_quality)

        trace.finished = True
        self._finish(trace, plan, baseline_metrics, current, current_quality)
        self._save(trace, plan, recipe)
        if isinstance(self.progress, Progress):
            self.progress.done("done" + (f": results in {self.out_dir}" if self.out_dir else ""))
        return Result(plan=plan, trace=trace, recipe=trace.to_recipe(), out_dir=self.out_dir)

    # ------------------------------------------------------------------ helpers
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

    def _record(self, trace: Trace, step: Step, plan: Plan, recipe: Recipe, baseline_metrics, current: Measurement, quality) -> None:
        trace.steps.append(step)
        self._finish(trace, plan, baseline_metrics, current, quality)
        self._save(trace, plan, recipe)

    def _finish(self, trace: Trace, plan: Plan, baseline_metrics: dict, current: Measurement, quality) -> None:
        now = _metrics(current, quality or {})
        now["weight_mb"] = getattr(self, "_weight_mb", None)
        vs = {}
        for m in ("decode_tokens_per_s", "ttft_ms", "e2e_ms", "throughput_tokens_per_s", "weight_mb"):
            b, a = baseline_metrics.get(m), now.get(m)
            if b and a is not None:
                vs[m] = round(a / b - 1, 4)
        kept = [f"{s.layer}/{s.pass_name}" for s in trace.steps if s.status == "kept"]
        trace.final = {"plan": plan.to_dict(), "kept": kept, "metrics": now, "vs_baseline": vs}

    def _save(self, trace: Trace, plan: Plan, recipe: Recipe) -> None:
        if self.out_dir is None:
            return
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


def _ramp_stop(previous: Step, outcome: str) -> str | None:
    """Why a concurrency ramp stops after ``previous`` (its last level), or None to step up.

    A level holds when it is kept: throughput rose, or stayed within noise, and no guard tripped.
    A tripped guard, a worse objective, a failure or a skip ends the ramp.
    """
    if previous.status == "kept":
        return None
    why = {"guard": "a guard tripped", "worse": "throughput got worse", "unmeasured": "its objective could not be measured"}.get(outcome, "")
    what = {"rolled_back": "was rolled back", "failed": "failed", "skipped": "was skipped"}.get(previous.status, previous.status)
    return f"the previous level {what}" + (f" ({why})" if why and previous.status == "rolled_back" else "")


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
