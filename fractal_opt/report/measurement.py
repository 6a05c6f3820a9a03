"""Markdown for the measurement side of report.md: noise calibration, latency percentiles, the roofline, and what one user gets.

Called by :func:`fractal_opt.report.markdown.report_md`; reads only what trace.json stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..measure.busier import measured_under
from . import one_user

__all__ = ["busy_warning", "calibration_lines", "measurement_lines", "one_user_lines", "resolution"]

# The calibration metrics the report spells out (trace.json keeps all of them).
_CALIBRATED = ("decode_tokens_per_s", "ttft_ms", "prefill_ms", "e2e_ms", "throughput_tokens_per_s", "peak_memory_mb")


def _num(v: Any, fmt: str) -> str:
    return fmt.format(v) if isinstance(v, int | float) and not isinstance(v, bool) else "–"


def resolution(interval: Sequence[float]) -> str:
    """``2.4%``: half the width of an A/A interval, the smallest change a number can show here (an
    A/A comparison estimates no change, so its interval is a resolution, not a bound on an estimate)."""
    return f"{(interval[1] - interval[0]) / 2:.1%}"


def busy_warning(calibration: dict[str, Any]) -> str | None:
    """The plain sentence a user must read first when the A/A calibration could not resolve the
    policy's ``min_effect`` ("This machine is busy: verdicts can only see changes above 70%"), with
    the load and the other busy processes seen when it started; when no other work was seen, it
    says the measurement itself is noisy instead. None when the calibration resolved ``min_effect``
    (or predates the check)."""
    if not calibration or calibration.get("resolves", True):
        return None
    per_metric = calibration.get("resolution") or {}
    widest = max(per_metric.values(), default=0.0)
    which = ", ".join(f"{m} ±{v:.0%}" for m, v in per_metric.items())
    busy = calibration.get("busy") or {}
    why = "This machine is busy" if busy.get("busy") else "The measurement is noisy"
    text = (f"{why}: verdicts can only see changes above {widest:.0%} "
            f"(A/A calibration, the baseline against itself: 95% intervals {which} after {calibration.get('rounds')} rounds; "
            f"min_effect is {calibration.get('min_effect', 0):.0%}).")
    if busy.get("text"):
        text += f" At the start: {busy['text']}."
    advice = " Re-run on a quiet machine, or with --wait-quiet." if busy.get("busy") else " More rounds (workload.max_repeats) or longer requests narrow the intervals."
    return text + advice


def calibration_lines(calibration: dict[str, Any], *, threads: int | None = None, warn: bool = True) -> list[str]:
    """The busy-machine warning (first, in bold, when there is one), then one paragraph: the A/A
    change of the main metrics with their 95% intervals, and the smallest change it can resolve;
    then the load the numbers were measured under with the plan's ``threads``
    (:func:`fractal_opt.measure.busier.measured_under`)."""
    if not calibration:
        return []
    out = []
    if warn and (warning := busy_warning(calibration)):  # report.md says it under the answer instead (warn=False)
        out += [f"**{warning}**", ""]
    intervals = calibration.get("intervals") or {}
    parts = []
    for m in _CALIBRATED:
        v = calibration.get(m)
        if not isinstance(v, int | float):
            continue
        iv = intervals.get(m)
        parts.append(f"{m} ±{resolution(iv)} (A/A {v:+.1%})" if iv else f"{m} {v:+.1%}")
    rounds = calibration.get("rounds")
    head = (f"Noise calibration (baseline against itself, interleaved, {rounds} rounds; the smallest change each number can show: half the "
            "width of its A/A 95% interval, which brackets no change): " if rounds else "Noise calibration (baseline measured twice, A/A change): ")
    tail = ""
    if calibration.get("resolves"):
        per_metric = calibration.get("resolution") or {}
        tail = f" It resolves changes of {calibration.get('min_effect', 0):.0%} (widest A/A interval ±{max(per_metric.values(), default=0.0):.1%} of the watched metrics)"
        busy = calibration.get("busy") or {}
        if busy.get("busy"):
            tail += f", though other work was running at the start ({busy.get('text')})"
        tail += "."
    under = measured_under(calibration.get("busy"), threads=threads)
    return [*out, head + ", ".join(parts) + "." + tail, "", *([under, ""] if under else [])]


def measurement_lines(steps: list[Any]) -> list[str]:
    """Latency percentiles, memory headroom and the roofline label of every measured step."""
    measured = [s for s in steps if s.metrics and "roofline" in s.metrics]
    if not measured:
        return []
    out = [
        "Latency, memory and roofline (percentiles pooled over requests and rounds; ITL = gaps between tokens; "
        "bandwidth and compute as a share of the probed ceilings; comparison = how the step was measured against the previous plan):", "",
        "| pass | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | e2e p99 ms | prefill tok/s | headroom MB | achieved GB/s | % bandwidth | % compute (prefill) | bound | comparison |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in measured:
        m, r = s.metrics, s.metrics.get("roofline") or {}
        label = "baseline" if s.status == "baseline" else f"{s.layer}/{s.pass_name}"
        ttft = "/".join(_num(m.get(f"ttft_ms_p{q}"), "{:.0f}") for q in (50, 90, 99))
        itl = "/".join(_num(m.get(f"itl_ms_p{q}"), "{:.1f}") for q in (50, 90, 99))
        cmp = m.get("comparison") or {}
        how = f"{cmp.get('mode', '').replace('_', ' ')}, {cmp.get('rounds')} rounds" if cmp else "A/A calibration"
        out.append(
            f"| {label} | {ttft} | {itl} | {_num(m.get('e2e_ms_p99'), '{:.0f}')} | {_num(m.get('prefill_tokens_per_s'), '{:.0f}')} | "
            f"{_num(m.get('memory_headroom_mb'), '{:.0f}')} | {_num(r.get('achieved_bandwidth_gbs'), '{:.2f}')} | {_num(r.get('bandwidth_fraction'), '{:.0%}')} | "
            f"{_num(r.get('compute_fraction'), '{:.0%}')} | {r.get('bound', '–')} | {how} |"
        )
    gpu = next((s.metrics.get("gpu") for s in measured if isinstance(s.metrics.get("gpu"), dict)), None)
    if gpu:
        status = gpu.get("status", "")
        if status == "ok":
            out += ["", f"GPU (NVML): SM utilization {_num(gpu.get('sm_utilization'), '{:.0f}')}%, power {_num(gpu.get('power_w'), '{:.0f}')} W, "
                    f"energy {_num(gpu.get('energy_j_per_token'), '{:.3f}')} J/token (last round of the last step)."]
        else:
            out += ["", f"GPU utilization, power and energy: {status}."]
    return [*out, ""]


def one_user_lines(baseline: Any, steps: Sequence[Any]) -> list[str]:
    """What one interactive user got from each measured step (:mod:`.one_user`): TTFT, streaming
    speed and the whole answer, the previous plan's numbers next to the step's. The baseline
    shows its own numbers; a skipped or failed step shows nothing. Empty when no step has them."""
    previous = one_user.previous_plans(baseline, steps)
    rows = []
    if baseline is not None and baseline.metrics and (text := one_user.summary(None, baseline.metrics)):
        rows.append(f"- baseline: {text}")
    for s, prev in zip(steps, previous):
        if prev is None or not (text := one_user.summary(prev.metrics, s.metrics)):
            continue
        rows.append(f"- {s.layer}/{s.label()}, {s.status.replace('_', ' ')}: {text} ({prev.source()})")
    if not rows:
        return []
    head = (f"What one user gets, per request as one user saw it {one_user.under([baseline, *steps])}. TTFT and answer are p50 over "
            "requests and rounds, streams is the median request's decode tokens/s; previous plan -> this step, each % computed from "
            "the two numbers next to it (the verdict's paired estimates are in the table above):")
    return [head, "", *rows, ""]
