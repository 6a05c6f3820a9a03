"""Markdown for the measurement side of report.md: noise calibration, latency percentiles and the roofline.

Called by :meth:`fractal_opt.trace.Trace.to_markdown`; reads only what trace.json stores.
"""

from __future__ import annotations

from typing import Any

__all__ = ["calibration_lines", "measurement_lines"]

# The calibration metrics the report spells out (trace.json keeps all of them).
_CALIBRATED = ("decode_tokens_per_s", "ttft_ms", "prefill_ms", "e2e_ms", "throughput_tokens_per_s", "peak_memory_mb")


def _num(v: Any, fmt: str) -> str:
    return fmt.format(v) if isinstance(v, int | float) and not isinstance(v, bool) else "–"


def calibration_lines(calibration: dict[str, Any]) -> list[str]:
    """One paragraph: the A/A change of the main metrics with their 95% intervals."""
    if not calibration:
        return []
    intervals = calibration.get("intervals") or {}
    parts = []
    for m in _CALIBRATED:
        v = calibration.get(m)
        if not isinstance(v, int | float):
            continue
        iv = intervals.get(m)
        parts.append(f"{m} {v:+.1%}" + (f" [{iv[0]:+.1%}, {iv[1]:+.1%}]" if iv else ""))
    rounds = calibration.get("rounds")
    head = f"Noise calibration (baseline against itself, interleaved, {rounds} rounds; A/A change [95% interval]): " if rounds else "Noise calibration (baseline measured twice, A/A change): "
    return [head + ", ".join(parts) + ".", ""]


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
