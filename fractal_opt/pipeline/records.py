"""What a step's record says: its metrics from a measurement, and a failure in words.

Pure functions of what the runner measured or caught, so the trace's wording has one home.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from typing import Any

from ..core.errors import ModelSourceError, RecipeError, RunFailed
from ..measure.metrics import Measurement
from ..report.trace import Step
from ..tower.passes import Pass
from ..tower.plan import Plan
from .deadline import StepTimeout, WorkerAbandoned

__all__ = ["MEASURED_EXTRA", "baseline_error", "contention_note", "failed_baseline", "failure_text", "gate_stage", "metrics", "plan_text", "startup_note",
           "traceback_text"]

# What the measurement itself adds to ``Measurement.extra`` that the trace keeps (GPU telemetry,
# "unavailable" on CPU; the device's capacity; load: the profile and per-round request counts;
# cost: where the energy and price per token came from). The runtimes' own keys come from their
# capabilities (``Capabilities.telemetry``).
MEASURED_EXTRA = ("gpu", "cuda_max_reserved_mb", "capacity_mb", "load", "cost")


def metrics(m: Measurement, quality: dict[str, Any], *, telemetry: Iterable[str] = ()) -> dict[str, Any]:
    """A step's metrics: the measurement's summary, spreads, memory source, the kept telemetry, its quality."""
    out: dict[str, Any] = dict(m.summary())
    out["spread"] = m.spreads()
    out["memory_source"] = m.memory_source
    keep = (*MEASURED_EXTRA, *telemetry)
    out.update({k: v for k, v in m.extra.items() if k in keep})
    out["quality"] = dict(quality)
    return out


def gate_stage(e: BaseException, p: Pass) -> str:
    """Which of the pass's methods raised inside the gate (:func:`.gate.skip_reason` calls
    ``unavailable``, ``check`` and ``apply``, the last to see whether the pass changes anything)."""
    methods = {getattr(type(p), name).__code__: name for name in ("unavailable", "check", "apply") if hasattr(getattr(type(p), name), "__code__")}
    stage, tb = "check", e.__traceback__
    while tb is not None:
        stage = methods.get(tb.tb_frame.f_code, stage)
        tb = tb.tb_next
    return stage


def failure_text(e: BaseException, stage: str, timeout_s: float | None) -> str:
    """A failed step's reason: ``timeout after ...`` or ``<stage>: <Error>: <message>``."""
    if isinstance(e, StepTimeout):
        return f"timeout after {timeout_s:g} s (policy.timeout_s), in {stage}: the step was stopped"[:500]
    if isinstance(e, WorkerAbandoned):
        return f"{e} (it was in {stage})"[:500]
    if isinstance(e, SystemExit):
        return f"{stage}: SystemExit({e.code!r}): a step cannot end the run"[:500]
    return f"{stage}: {type(e).__name__}: {e}".strip()[:500]


def traceback_text(e: BaseException) -> str:
    """The last frames of ``e``, as the trace keeps them (at most 2,000 characters)."""
    return "".join(traceback.format_exception(e, limit=-4))[-2000:]


def plan_text(plan: Plan) -> str:
    """The baseline's plan in one line: its runtime, dtype, attention, threads, KV cache and serving."""
    hw = plan.hardware
    return (f"plain {hw.runtime}: {hw.dtype}, {hw.attention} attention, {hw.threads or 'default'} threads, {plan.model.kv_cache} KV cache, "
            f"{plan.scheduling.batching} serving")


def startup_note(timings: dict[str, Any]) -> str:
    """The start-up work ``Engine.prepare`` timed that the numbers exclude, as a sentence for the
    verdict's reason ("" when there was none worth saying)."""
    if "compile_s" not in timings:
        return ""
    return f" Start-up: compiling took {timings['compile_s']:.1f} s (excluded from the numbers above)."


def contention_note(*measurements: Measurement) -> str:
    """Rounds the runner served again because another process of the run used the CPU
    (:mod:`fractal_opt.measure.isolation`), as a sentence for the verdict's reason ("" when none
    was): how many, the largest share of the measured engine's CPU time a discarded try saw, and
    how many rounds stayed contended after the last re-run."""
    rows = [row for m in measurements for row in m.repeats if row.get("reruns")]
    if not rows:
        return ""
    tries = [c for row in rows for c in row.get("rerun_contention", [])]
    shares = [c["share"] for c in tries if c.get("share") is not None]
    used = (f"another process of the run used {max(shares):.0%} of the measured engine's CPU time" if shares
            else "another process of the run used CPU time while the measured engine used none")
    still = sum(1 for row in rows if row.get("contended"))
    left = f"; {still} still contended after {max(row['reruns'] for row in rows)} re-runs (flagged in its rows)" if still else ""
    return f" {len(rows)} round{'s' if len(rows) > 1 else ''} re-run: {used}{left}."


def failed_baseline(e: BaseException, stage: str, timeout_s: float | None) -> Step:
    """The baseline step of a run whose baseline failed: status failed, why, the last frames."""
    return Step(pass_name="baseline", layer="-", params={}, status="failed", reason=failure_text(e, stage, timeout_s),
                timings={"traceback": traceback_text(e)})  # type: ignore[dict-item]


def baseline_error(e: BaseException, reason: str, out_dir: Any) -> BaseException:
    """What ends a run whose baseline failed: bad input keeps its own error (and exit code); anything else is RunFailed."""
    if isinstance(e, RecipeError | ModelSourceError):
        return e
    where = f" {out_dir / 'trace.json'} records it." if out_dir is not None else ""
    error = RunFailed(f"the baseline failed, so no pass was tried: {reason}.{where}")
    error.__cause__ = e
    return error
