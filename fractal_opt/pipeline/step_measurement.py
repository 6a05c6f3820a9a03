"""How the pipeline measures a step: pre-flight, A/A calibration, interleaved A/B, roofline.

:class:`StepMeasurer` keeps the engine of the last kept plan, so each candidate is measured
interleaved with it (:func:`~fractal_opt.measure.measure_pair`) when both fit in the device's
memory; otherwise the previous model is released, the candidate is measured alone and compared
with the previous measurement back to back, and the trace says so (``comparison.mode``) and widens
the band by the calibration's drift. The pipeline calls it; it holds no policy of its own.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import runtimes
from ..engine.protocol import Engine
from ..machine import Machine, resolve_device
from ..measure.budget import load_config, shape_from_config
from ..measure.metrics import METRICS, Measurement
from ..measure.noise import band
from ..measure.preflight import batch_size, preflight
from ..measure.roofline import ModelShape, dtype_bits, kv_bytes_per_token, step_roofline
from ..measure.runner import measure, measure_pair, paired_changes
from ..plan import Plan
from ..workload import Request, Workload

__all__ = ["Comparison", "StepMeasurer"]

# Both models must fit in this share of the device to be measured side by side: the rest is for
# activations, the KV cache, the reference logits and the OS (RSS also counts file-backed pages).
_SIDE_BY_SIDE_SHARE = 0.8
# Characters per token when estimating a prompt's length before any tokenizer is loaded: English
# BPE averages ~4; 2 over-estimates on purpose, so the pre-flight errs towards "needs more memory".
_CHARS_PER_TOKEN = 2


@dataclass
class Comparison:
    """One step's comparison: the fresh previous measurement, the candidate's, and the verdict inputs."""

    before: Measurement
    after: Measurement
    changes: dict[str, float | None]
    bands: dict[str, float]
    intervals: dict[str, list[float]]
    info: dict[str, Any] = field(default_factory=dict)  # mode, rounds, drift note


class StepMeasurer:
    """Measurement for the pipeline: calibration, per-step comparison and roofline numbers."""

    def __init__(self, *, machine: Machine, workload: Workload, requests: Sequence[Request], min_effect: float,
                 limits: Any = None, progress: Callable[[str], None] = lambda m: None, build: Callable[..., Engine] | None = None):
        self.machine = machine
        self.build = build or runtimes.build  # build(plan, *, machine, progress, max_new_tokens) -> Engine (tests: a fake)
        self.workload = workload
        self.requests = list(requests)
        self.min_effect = min_effect
        self.limits = limits
        self.say = progress
        self.previous: Engine | None = None
        self.calibration: dict[str, float] = {}
        self.prompt_tokens: int | None = None  # longest prompt, known after the baseline
        self._shapes: dict[str, ModelShape | None] = {}

    # ------------------------------------------------------------------ pre-flight
    def shape(self, source: str) -> ModelShape | None:
        if source not in self._shapes:
            try:
                _, config = load_config(source)
                self._shapes[source] = shape_from_config(config, where=source)
            except Exception:  # no readable config (offline hub id, exotic architecture): no pre-flight
                self._shapes[source] = None
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
        if runtimes.takes_whole_device(candidate) or runtimes.takes_whole_device(previous):
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
    def calibrate(self, engine: Engine, label: str) -> tuple[Measurement, dict[str, Any]]:
        """The baseline measured against itself, interleaved (A/A): the change every metric shows
        when nothing changed. Returns the second measurement and the calibration record."""
        first, second = measure_pair(engine, engine, self.workload, requests=self.requests, min_effect=self.min_effect,
                                     progress=lambda m: self.say(f"{label}: measuring, {m}"))
        intervals = paired_changes(first, second)
        self.calibration = {m: round(iv.change, 4) for m, iv in intervals.items()}
        self.previous = engine
        self.prompt_tokens = max((s.prompt_tokens for s in second.samples), default=None)
        record = {**self.calibration, "intervals": {m: iv.to_list() for m, iv in intervals.items()}, "rounds": len(second.repeats)}
        return second, record

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
            runtimes.clear_cache()
        return "back_to_back"

    def compare(self, candidate: Engine, current: Measurement, *, mode: str, objective: str, label: str) -> Comparison:
        def progress(m: str) -> None:
            self.say(f"{label}: measuring, {m}")

        if mode == "interleaved" and self.previous is not None:
            # The previous engine warmed up when it was measured first; its kernels and caches stay
            # warm (one warm-up per plan, as before interleaving), so only the candidate warms up.
            before, after = measure_pair(self.previous, candidate, self.workload, requests=self.requests, objective=objective,
                                         min_effect=self.min_effect, warm_previous=False, progress=progress)
            info = {"mode": "interleaved", "rounds": len(after.repeats)}
            drift = {}
        else:
            before, after = current, measure(candidate, self.workload, requests=self.requests, progress=progress)
            info = {"mode": "back_to_back", "rounds": len(after.repeats),
                    "note": "previous and candidate did not fit in memory together: measured back to back; the band includes 2 x the A/A drift"}
            drift = self.calibration
        intervals = paired_changes(before, after)
        changes = {m: (round(intervals[m].change, 6) if m in intervals else None) for m in METRICS}
        bands = {m: round(band(intervals.get(m), min_effect=self.min_effect, drift=drift.get(m)), 4) for m in METRICS}
        return Comparison(before=before, after=after, changes=changes, bands=bands, intervals={m: iv.to_list() for m, iv in intervals.items()}, info=info)

    def after_verdict(self, kept: bool, candidate: Engine, plan: Plan, mode: str) -> None:
        """Keep the kept plan's engine as the next step's previous. After a rollback the previous
        engine is touched in the engine cache, so the rolled-back model is the one evicted next
        (back to back: everything is released and the previous is reloaded when next needed)."""
        if kept:
            if self.previous is not None and self.previous is not candidate:
                self.previous.close()
            self.previous = candidate
            runtimes.evict_except({candidate.plan.weights_key()})
            return
        candidate.close()
        runtimes.evict_except({plan.weights_key()})
        if mode == "interleaved":
            self.previous = self.build(plan, machine=self.machine, progress=self.say, max_new_tokens=self.workload.max_new_tokens)
        else:
            self.previous = None
            runtimes.clear_cache()

    # ------------------------------------------------------------------ roofline
    def roofline(self, engine: Engine, m: Measurement) -> dict[str, Any]:
        """The step's roofline numbers (see :func:`fractal_opt.measure.roofline.step_roofline`)."""
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
            bandwidth_bytes_per_s=lim.bandwidth_bytes_per_s if lim else None, peak_flops=lim.flops_for(plan.hardware.dtype) if lim else None,
        )
        out["batch"] = batch
        return out
