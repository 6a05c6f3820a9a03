"""How the pipeline measures a step: pre-flight, A/A calibration, interleaved A/B, roofline.

:class:`StepMeasurer` keeps the engine of the last kept plan, so each candidate is measured
interleaved with it (:func:`~fractal_opt.measure.measure_pair`) when both fit in the device's
memory; otherwise the previous model is released, the candidate is measured alone and compared
with the previous measurement back to back, and the trace says so (``comparison.mode``) and widens
the band by the calibration's drift. The pipeline calls it; it holds no policy of its own.

The A/A calibration also says whether this machine can resolve the policy's ``min_effect`` at all:
it adds rounds while the widest A/A interval of the watched metrics is wider than ``min_effect``
on a side (:func:`~fractal_opt.measure.noise.resolution`; up to :func:`calibration_rounds`), and records the machine's load and the other busy processes
seen when it started (:mod:`fractal_opt.measure.busy`); when the band is still too wide the record
says so and the report and the terminal print it ("this machine is busy: verdicts can only see
changes above 70%").

Memory per plan: interleaved rounds keep both models resident, so their peak RSS (or CUDA peak)
is the two plans' together. When the candidate's weights differ from the previous plan's, the
previous model is released after the interleaved rounds and the candidate serves one more round
alone (:meth:`StepMeasurer.solo_peak`): that round's peak is the candidate's ``peak_memory_mb``,
compared with the previous plan's own solo peak. It costs one suite pass per step that changes the
weights, plus a reload of the previous model when the step is rolled back; steps that share the
weights (scheduling, decoding, application passes) share the loaded model, so their interleaved peak
already is their own and no round is added.
"""

from __future__ import annotations


import gc
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.machine import Machine, resolve_device
from ..engine.protocol import Engine
from ..engine.registry import RUNTIMES, Runtimes
from ..measure.budget import load_config, shape_from_config
from ..measure.busy import BusySnapshot, snapshot, wait_quiet
from ..measure.machine_limits import probe_limits
from ..measure.metrics import METRICS, Measurement
from ..measure.noise import band, resolution
from ..measure.preflight import batch_size, preflight
from ..measure.roofline import ModelShape, dtype_bits, kv_bytes_per_token, step_roofline, unreliable_shares
from ..measure.runner import Runner, measure, measure_pair, paired_changes
from ..measure.screen import KeptNoise, screen_interval, screen_record
from ..tower.plan import Plan
from ..workloads.workload import Request, Workload

__all__ = ["CALIBRATION_MAX_ROUNDS", "Comparison", "StepMeasurer", "calibration_rounds", "read_shape"]

# Both models must fit in this share of the device to be measured side by side: the rest is for
# activations, the KV cache, the reference logits and the OS (RSS also counts file-backed pages).
_SIDE_BY_SIDE_SHARE = 0.8
# Characters per token when estimating a prompt's length before any tokenizer is loaded: English
# BPE averages ~4; 2 over-estimates on purpose, so the pre-flight errs towards "needs more memory".
_CHARS_PER_TOKEN = 2
# Rounds the A/A calibration may grow to when the workload sets no ``max_repeats``. One quickstart
# calibration round is two passes over the 6-request suite, ~21 s on the project's quiet 2-core CPU
# (baseline e2e 1.7 s per request); three extra rounds add ~1 minute to a ~7.5-minute run, which
# keeps the quickstart under 10 minutes. Each doubling of the rounds narrows the interval by ~1/sqrt(2).
CALIBRATION_MAX_ROUNDS = 6


def calibration_rounds(workload: Workload) -> int:
    """The most rounds the A/A calibration runs: the workload's ``max_repeats`` when it sets one,
    else :data:`CALIBRATION_MAX_ROUNDS` (never fewer than ``repeats``)."""
    return max(workload.repeats, workload.max_repeats or CALIBRATION_MAX_ROUNDS)


def read_shape(source: str) -> ModelShape | None:
    """The model's shape from its config, or None when no config can be read (offline hub id,
    exotic architecture): then there is no pre-flight and the matmul probe uses square shapes."""
    try:
        _, config = load_config(source)
        return shape_from_config(config, where=source)
    except Exception:
        return None


@dataclass
class Comparison:
    """One step's comparison: the fresh previous measurement, the candidate's, and the verdict inputs."""

    before: Measurement
    after: Measurement
    changes: dict[str, float | None]
    bands: dict[str, float]
    intervals: dict[str, list[float]]
    info: dict[str, Any] = field(default_factory=dict)  # mode, rounds, drift note, screen
    screened_out: bool = False  # the screen's interval could not beat the kept plan: no full rounds
    stopped_by_quality: bool = False  # the screen passed, then a quality guard tripped: no full rounds


class StepMeasurer:
    """Measurement for the pipeline: calibration, per-step comparison and roofline numbers."""

    def __init__(self, *, machine: Machine, workload: Workload, requests: Sequence[Request], min_effect: float,
                 limits: Any = None, progress: Callable[[str], None] = lambda m: None, runtimes: Runtimes | None = None,
                 build: Callable[..., Engine] | None = None,
                 note: Callable[[str], None] | None = None, wait_quiet_s: float = 0.0, reprobe: bool = False,
                 busy: Callable[[], BusySnapshot] | None = None):
        """``note`` prints a line that stays on the terminal (default: ``progress``); ``wait_quiet_s``:
        before calibrating, wait up to this long for other processes to leave the CPU (0 = no wait);
        ``reprobe``: the ceilings were probed for this run, so a step's share above 100% re-measures them (once per run);
        ``busy`` takes the load snapshot (tests; default :func:`fractal_opt.measure.busy.snapshot`);
        ``runtimes``: the registry asked whether a plan takes the whole device and told what to
        evict (default: the process's); ``build``: ``build(plan, *, machine, progress,
        max_new_tokens) -> Engine`` (default ``runtimes.build``; tests: a fake)."""
        self.machine = machine
        self.runtimes = runtimes or RUNTIMES
        self.build = build or self.runtimes.build
        self.workload = workload
        self.requests = list(requests)
        self.min_effect = min_effect
        self.limits = limits
        self.say = progress
        self.note = note or progress
        self.wait_quiet_s = wait_quiet_s
        self.reprobe = reprobe
        self.reprobed = False
        self.busy = busy or snapshot
        self.previous: Engine | None = None
        self.previous_solo_peak_mb: float | None = None  # the kept plan's own peak, measured without another model resident
        self.candidate_own_peak_mb: float | None = None  # the last compared candidate's own peak (for after_verdict)
        self.calibration: dict[str, float] = {}
        self.calibration_noise: dict[str, Any] = {}  # the A/A intervals and rounds: one round's noise, for the screen
        self.kept_noise = KeptNoise()  # the kept plan's own full comparisons: one round's noise once they give enough rounds
        self.prompt_tokens: int | None = None  # longest prompt, known after the baseline
        self._shapes: dict[str, ModelShape | None] = {}

    # ------------------------------------------------------------------ pre-flight
    def shape(self, source: str) -> ModelShape | None:
        if source not in self._shapes:
            self._shapes[source] = read_shape(source)
        return self._shapes[source]

    def preflight(self, plan: Plan) -> tuple[str | None, dict[str, Any]]:
        shape = self.shape(plan.source)
        if shape is None:
            return None, {"status": "no config: pre-flight skipped"}
        prompt = self.prompt_tokens or max(sum(len(c) for _, c in r.messages) for r in self.requests) // _CHARS_PER_TOKEN
        device = resolve_device(plan.hardware.device, self.machine)
        return preflight(plan, shape, context=prompt + self.workload.max_new_tokens, n_requests=len(self.requests),
                         capacity_bytes=self.machine.device_memory_bytes(device))

    def _fits_side_by_side(self, candidate: Plan, previous: Plan) -> bool:
        if self.runtimes.takes_whole_device(candidate) or self.runtimes.takes_whole_device(previous):
            return False  # a server that reserves the device (vLLM on a GPU) cannot start beside another model
        _, cand = self.preflight(candidate)
        if "weight_bytes" not in cand or not cand["capacity_bytes"]:
            return True  # nothing known against it; the engine cache holds two models anyway
        if self.previous is not None:
            held = self.previous.census()["weight_bytes"]
        else:
            _, prev = self.preflight(previous)
            held = prev["weight_bytes"] + prev["kv_bytes"]
        return held + cand["weight_bytes"] + cand["kv_bytes"] <= _SIDE_BY_SIDE_SHARE * cand["capacity_bytes"]

    # ------------------------------------------------------------------ calibration
    def calibrate(self, engine: Engine, label: str, *, watch: Sequence[str] = ("decode_tokens_per_s",)) -> tuple[Measurement, dict[str, Any]]:
        """The baseline measured against itself, interleaved (A/A): the change every metric shows
        when nothing changed. Returns the second measurement and the calibration record.

        Rounds alternate A B / B A as in every step. After ``workload.repeats`` rounds, rounds are
        added two at a time (one A B / B A pair) while the widest A/A interval of the ``watch`` metrics (the policy's objectives) is
        wider than ``min_effect`` on a side, up to :func:`calibration_rounds`. The record holds each
        metric's A/A change and interval, the rounds, the ``resolution`` (the smallest change the
        watched metrics can show) and ``busy`` (the load and other processes seen at the start);
        ``resolves`` is False when the band stayed wider than ``min_effect``.
        """
        if self.wait_quiet_s > 0:
            wait_quiet(max_wait_s=self.wait_quiet_s, progress=lambda m: self.say(f"{label}: {m}"))
        start = self.busy()
        if start.busy:
            self.say(f"{label}: other work is running ({start.describe()})")
        wl, cap = self.workload, calibration_rounds(self.workload)
        first, second = Runner(engine, wl, self.requests), Runner(engine, wl, self.requests)
        first.warm_up()
        second.warm_up()
        rounds, widest = 0, None
        while True:
            extended = f" (extended: A/A band ±{widest:.0%} is wider than min_effect {self.min_effect:.0%}; at most {cap})" if widest is not None else ""
            self.say(f"{label}: measuring, round {rounds + 1}/{cap if widest is not None else wl.repeats}{extended}")
            for runner in ((first, second) if rounds % 2 == 0 else (second, first)):
                runner.round()
            rounds += 1
            if rounds >= cap:
                break
            if rounds < wl.repeats or (rounds - wl.repeats) % 2:  # extend by A B / B A pairs, as measure_pair does
                continue
            watched = paired_changes(first.result(), second.result(), list(watch))
            widest = resolution(watched.values())
            if widest <= self.min_effect:
                break
        a, b = first.result(), second.result()
        intervals = paired_changes(a, b)
        self.calibration = {m: round(iv.change, 4) for m, iv in intervals.items()}
        self.calibration_noise = {"intervals": {m: iv.to_list() for m, iv in intervals.items()}, "rounds": len(b.repeats)}
        self.previous = engine
        self.previous_solo_peak_mb = b.median("peak_memory_mb")  # one engine twice: one model resident
        self.prompt_tokens = max((s.prompt_tokens for s in b.samples), default=None)
        per_metric = {m: round(resolution([intervals[m]]), 4) for m in watch if m in intervals}
        widest = max(per_metric.values(), default=0.0)
        record = {**self.calibration, "intervals": {m: iv.to_list() for m, iv in intervals.items()}, "rounds": len(b.repeats),
                  "max_rounds": cap, "min_effect": self.min_effect, "watched": list(watch), "resolution": per_metric,
                  "resolves": widest <= self.min_effect, "busy": start.to_dict()}
        if not record["resolves"]:
            why = "this machine is busy" if start.busy else "the measurement is noisy"
            self.note(f"{why}: verdicts can only see changes above {widest:.0%} (A/A calibration after {rounds} rounds, "
                      f"min_effect {self.min_effect:.0%}); at start: {start.describe()}")
        return b, record

    # ------------------------------------------------------------------ one step
    def before_build(self, candidate: Plan, previous: Plan) -> str:
        """Decide how the candidate will be measured: "interleaved" with the previous plan's engine
        (loaded again if a back-to-back step released it) when both fit in memory, else
        "back_to_back" (the previous model is released first, so the candidate has the memory)."""
        if self._fits_side_by_side(candidate, previous):
            if self.previous is None:
                self.previous = self.build(previous, machine=self.machine, progress=self.say, max_new_tokens=self.workload.max_new_tokens)
            return "interleaved"
        if self.previous is not None:
            self.previous.close()
            self.previous = None
            self.runtimes.clear_cache()
        return "back_to_back"

    def compare(self, candidate: Engine, current: Measurement, *, mode: str, objective: str, label: str, screen: bool = False,
                quality_first: Callable[[Comparison], bool] | None = None) -> Comparison:
        """The candidate against the kept plan. ``screen``: after the first round, stop unless the
        screen interval of ``objective`` can still beat the kept plan by min_effect (:mod:`~fractal_opt.measure.screen`);
        the comparison then says ``screened_out`` and holds that one round. ``quality_first``: asked
        with the one round's comparison once the screen passed; False (a quality guard tripped)
        stops there too, and the comparison says ``stopped_by_quality``."""
        def progress(m: str) -> None:
            self.say(f"{label}: measuring, {m}")

        screened: dict[str, Any] = {}

        def screen_round(before: Measurement, after: Measurement) -> bool:
            kept = self.kept_noise.noise(objective)
            interval = screen_interval(before, after, objective, calibration=self.calibration_noise, noise=kept)
            screened.update(screen_record(interval, objective, min_effect=self.min_effect, before=before, after=after),
                            noise="A/A calibration" if kept is None else f"the kept plan's comparisons ({kept[1]} degrees of freedom)")
            self.say(f"{label}: screen {objective} {_signed(screened.get('change'))} {_bounds(screened.get('interval'))}: "
                     + ("full rounds" if screened["passed"] else "cannot beat the kept plan by min_effect")
                     + (", the quality gate first (the answers' numbers change)" if screened["passed"] and quality_first else ""))
            if screened["passed"] and quality_first is not None and not quality_first(self._compared(before, after, {}, {})):
                screened["stopped_by_quality"] = True
                return False
            return bool(screened["passed"])

        if mode == "interleaved" and self.previous is not None:
            # The previous engine warmed up when it was measured first; its kernels and caches stay
            # warm (one warm-up per plan, as before interleaving), so only the candidate warms up.
            before, after = measure_pair(self.previous, candidate, self.workload, requests=self.requests, objective=objective,
                                         min_effect=self.min_effect, warm_previous=False, progress=progress,
                                         screen=screen_round if screen else None)
            info = {"mode": "interleaved", "rounds": len(after.repeats), **({"screen": screened} if screened else {})}
            drift = {}
            if screened.get("stopped_by_quality"):
                info["memory"] = "stopped by a quality guard after the screen: no round alone"
            elif screened and not screened["passed"]:
                info["memory"] = "screened out: no round alone (the interleaved round holds both models)"
            elif candidate.plan.weights_key() != self.previous.plan.weights_key():
                info["memory"] = self.solo_peak(candidate, before, after, progress)
        else:
            before, after = current, measure(candidate, self.workload, requests=self.requests, progress=progress)
            info = {"mode": "back_to_back", "rounds": len(after.repeats),
                    "note": "previous and candidate did not fit in memory together: measured back to back; the band includes 2 x the A/A drift"}
            drift = self.calibration
            info["memory"] = "measured alone (back to back)"
        # The candidate's own peak: its solo round's, or its rounds' when no other model was resident.
        self.candidate_own_peak_mb = after.median("peak_memory_mb")
        cmp = replace(self._compared(before, after, info, drift), screened_out=bool(screened) and not screened["passed"],
                      stopped_by_quality=bool(screened.get("stopped_by_quality")))
        if info["mode"] == "interleaved" and not (cmp.screened_out or cmp.stopped_by_quality):
            self.kept_noise.learn(cmp.intervals, rounds=info["rounds"])  # its rounds' spread: the next screens' noise
        return cmp

    def _compared(self, before: Measurement, after: Measurement, info: dict[str, Any], drift: dict[str, float]) -> Comparison:
        """The verdict's inputs from two measurements: paired changes, their intervals and bands."""
        intervals = paired_changes(before, after)
        changes = {m: (round(intervals[m].change, 6) if m in intervals else None) for m in METRICS}
        bands = {m: round(band(intervals.get(m), min_effect=self.min_effect, drift=drift.get(m)), 4) for m in METRICS}
        return Comparison(before=before, after=after, changes=changes, bands=bands, intervals={m: iv.to_list() for m, iv in intervals.items()}, info=info)

    def solo_peak(self, candidate: Engine, before: Measurement, after: Measurement, progress: Callable[[str], None]) -> str:
        """Release the previous model and serve one round of the candidate alone; its peak becomes
        the candidate's ``peak_memory_mb`` (and headroom) in every round of ``after``, and the
        previous plan's own solo peak that of ``before``, so the paired memory change compares the
        two plans' own footprints. The interleaved peaks are kept in ``extra``. Returns the note
        the trace stores under ``comparison.memory``."""
        assert self.previous is not None
        self.previous.close()
        self.previous = None
        self.runtimes.evict_except({candidate.plan.weights_key()})
        gc.collect()
        if candidate.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        progress("memory: one round alone (previous model released)")
        solo = Runner(candidate, self.workload, self.requests)
        solo.round()  # no warm-up: the candidate has served every interleaved round already
        peak = solo.repeats[0].get("peak_memory_mb")
        if peak is None:
            return "solo round gave no peak reading; peak_memory_mb is the interleaved rounds' (both models resident)"
        for m, own in ((after, peak), (before, self.previous_solo_peak_mb)):
            if own is None:
                continue
            m.extra["interleaved_peak_memory_mb"] = m.median("peak_memory_mb")
            for row in m.repeats:
                row["peak_memory_mb"] = own
                if row.get("memory_headroom_mb") is not None and solo.capacity_mb:
                    row["memory_headroom_mb"] = solo.capacity_mb - own
        return "peak_memory_mb from one round of each plan alone (interleaved rounds hold both models)"

    def after_verdict(self, kept: bool, candidate: Engine, plan: Plan, mode: str) -> None:
        """Keep the kept plan's engine as the next step's previous. After a rollback the previous
        engine is touched in the engine cache, so the rolled-back model is the one evicted next
        (back to back: everything is released and the previous is reloaded when next needed)."""
        if kept:
            self.kept_noise.reset()  # a new kept plan: its own comparisons will say how far a round strays
            if self.previous is not None and self.previous is not candidate:
                self.previous.close()
            self.previous = candidate
            self.previous_solo_peak_mb = self.candidate_own_peak_mb
            self.runtimes.evict_except({candidate.plan.weights_key()})
            return
        candidate.close()
        self.runtimes.evict_except({plan.weights_key()})
        if mode == "interleaved":  # (reloaded from disk when the solo round released it)
            self.previous = self.build(plan, machine=self.machine, progress=self.say, max_new_tokens=self.workload.max_new_tokens)
        else:
            self.previous = None
            self.runtimes.clear_cache()

    # ------------------------------------------------------------------ roofline
    def roofline(self, engine: Engine, m: Measurement) -> dict[str, Any]:
        """The step's roofline numbers (see :func:`fractal_opt.measure.roofline.step_roofline`).

        A share above 100% of a ceiling means the probe under-measured it: the ceilings are probed
        again (once per run, when ``reprobe``; each keeps its best reading) and the step recomputed;
        a share still above 100% stays out of the numbers, and ``note`` says "probe unreliable"."""
        out = self._roofline(engine, m)
        if unreliable_shares(out) and self.reprobe and not self.reprobed and self.limits is not None:
            self.reprobed = True
            lim = self.limits
            self.say(f"a step measured {max(unreliable_shares(out).values()):.0%} of a probed ceiling: probing the ceilings again")
            self.limits = probe_limits(lim.device, machine=self.machine, threads=lim.threads, shape=self.shape(engine.plan.source), refresh=True)
            out = self._roofline(engine, m)
            out["reprobed"] = {"bandwidth_bytes_per_s": self.limits.bandwidth_for(engine.plan.hardware.dtype),
                               "peak_flops": self.limits.flops_for(engine.plan.hardware.dtype)}
        if bad := unreliable_shares(out):
            out["note"] = "probe unreliable: " + ", ".join(f"{k.replace('_fraction', '')} {v:.0%} of the probed ceiling" for k, v in bad.items()) + " (not reported)"
        return out

    def _roofline(self, engine: Engine, m: Measurement) -> dict[str, Any]:
        plan = engine.plan
        shape = self.shape(plan.source)
        if shape is None or not m.samples:
            return {"bound": "unknown", "note": "no model config to compute bytes and FLOPs from"}
        census = engine.census()
        bits = dtype_bits(plan.hardware.dtype)
        w_read = census["weight_bytes"] - (0 if shape.tied_embeddings else shape.embedding_params * bits // 8)
        kv_tok = 0 if plan.model.kv_cache == "off" else kv_bytes_per_token(shape, kv_bits=bits)
        batch = batch_size(plan, len(self.requests))
        device = engine.device
        summary = m.summary()
        peak = summary.get("peak_memory_mb")
        lim = self.limits
        out = step_roofline(
            weight_read_bytes=w_read, kv_bytes_per_token=kv_tok, params=shape.params,
            prompt_tokens=statistics.median(s.prompt_tokens for s in m.samples), new_tokens=statistics.median(s.new_tokens for s in m.samples),
            batch=batch, decode_tokens_per_s=summary.get("decode_tokens_per_s"), prefill_ms=summary.get("prefill_ms"),
            peak_memory_bytes=peak * 2**20 if peak else None, capacity_bytes=self.machine.device_memory_bytes(device),
            bandwidth_bytes_per_s=lim.bandwidth_for(plan.hardware.dtype) if lim else None, peak_flops=lim.flops_for(plan.hardware.dtype) if lim else None,
        )
        out["batch"] = batch
        return out


def _signed(change: float | None) -> str:
    """``+12%`` / ``-3%`` (``?`` when the round gave no pair)."""
    return "?" if change is None else f"{change:+.0%}"


def _bounds(interval: Sequence[float] | None) -> str:
    """``[-12%, +7%]`` (nothing without an interval)."""
    return f"[{interval[0]:+.0%}, {interval[1]:+.0%}]" if interval else ""
