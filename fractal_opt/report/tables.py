"""The per-step tables of report.md and the terminal: the tower (every step with its numbers), the
work each step asked for, the guards in force, the steps under load, where the time went."""

from __future__ import annotations

from typing import Any

from .trace import Step

__all__ = ["COLUMNS", "TIME_PARTS", "guard_lines", "load_table", "time_line", "time_lines", "tower_headers", "tower_rows", "work_table"]

# Columns of the tower table: (metric key, header, format). Quality keys live under "quality".
COLUMNS = (
    ("decode_tokens_per_s", "decode tok/s", "{:.1f}"),
    ("ttft_ms", "TTFT ms", "{:.0f}"),
    ("prefill_ms", "prefill ms", "{:.0f}"),
    ("e2e_ms", "e2e ms", "{:.0f}"),
    ("throughput_tokens_per_s", "throughput tok/s", "{:.1f}"),
    ("peak_memory_mb", "peak MB", "{:.0f}"),
    ("weight_mb", "weights MB", "{:.0f}"),
    ("kl_mean", "KL", "{:.4f}"),
    ("agreement", "agree", "{:.2f}"),
)


def tower_headers() -> list[str]:
    return ["layer", "pass", "status", *(h for _, h, _ in COLUMNS), "reason"]


def tower_rows(steps: list[Step]) -> list[list[str]]:
    """The tower table: one row per step (the baseline first), numbers with their change vs the previous plan."""
    rows = []
    for s in steps:
        row = [s.layer, s.label(), s.status]
        for key, _, fmt in COLUMNS:
            v = s.value(key)
            cell = fmt.format(v) if isinstance(v, int | float) else "–"
            ch = s.changes.get(key)
            if ch is not None and s.status != "baseline" and key not in ("kl_mean", "agreement"):
                cell += f" ({ch:+.0%})"
            row.append(cell)
        row.append(s.reason)
        rows.append(row)
    return rows


def work_table(baseline: list[Step], steps: list[Step]) -> list[str]:
    """Markdown lines: how much work each measured step asked for (application-layer effects).

    Tokens generated per request, the share of requests stopped by the token cap (a cap that cuts
    answers short shows here and in the accuracy column), response-cache hits and prompt tokens
    removed by a prompt budget. Empty when no step changed any of them from zero.
    """
    measured = [s for s in baseline + steps if s.metrics]
    keys = ("hit_cap", "cache_hit_rate", "prompt_tokens_saved")
    if not any(s.metrics.get(k) for s in measured for k in keys):
        return []
    out = ["Work per request (medians; hit cap and cache hits are shares of requests; accuracy on the eval set when one is given):", "",
           "| pass | status | new tokens | hit cap | cache hits | prompt tokens saved | accuracy |", "|---|---|---|---|---|---|---|"]
    for s in measured:
        m = s.metrics
        acc = s.value("accuracy")
        cells = [
            s.label(), s.status,
            f"{m['new_tokens']:.0f}" if isinstance(m.get("new_tokens"), int | float) else "–",
            f"{m.get('hit_cap') or 0:.0%}", f"{m.get('cache_hit_rate') or 0:.0%}", f"{m.get('prompt_tokens_saved') or 0:.0f}",
            f"{acc:.2f}" if isinstance(acc, int | float) else "–",
        ]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return [*out, ""]


def guard_lines(steps: list[Step]) -> list[str]:
    """Markdown lines: the guards each judged step was held to, steps with
    the same guards on one line. Empty when no step was judged."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for s in steps:
        guards = s.metrics.get("guards") if s.metrics else None
        if isinstance(guards, list):
            groups.setdefault(tuple(guards), []).append(f"{s.layer}/{s.label()}")
    if not groups:
        return []
    out = ["Guards in force (a guard with no number to judge, such as accuracy without an eval set, is left out):", ""]
    out += [f"- {', '.join(names)}: {', '.join(guards) or 'none'}" for guards, names in groups.items()]
    return [*out, ""]


def load_table(baseline: list[Step], steps: list[Step]) -> list[str]:
    """Markdown lines: each measured step under the workload's load profile (scheduling passes are
    judged there): aggregate tokens/s, TTFT and ITL p50 / p90 / p99, and how the requests ended.
    Empty when the workload has no load profile."""
    measured = [s for s in baseline + steps if s.metrics and s.metrics.get("load")]
    if not measured:
        return []
    load = measured[0].metrics["load"]
    rate = f", {load.get('rate')}/s" if load.get("mode") == "poisson" else ""
    out = [f"Under load ({load.get('mode')}{rate}, {load.get('requests')} requests per round; TTFT as a streaming caller sees it, queueing included):", "",
           "| pass | status | clients | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | done / timeout / cancelled / rejected |",
           "|---|---|---|---|---|---|---|"]

    def trio(m: dict, name: str) -> str:
        vals = [m.get(f"{name}_p{q}") for q in (50, 90, 99)]
        return " / ".join(f"{v:.0f}" if isinstance(v, int | float) else "–" for v in vals)

    for s in measured:
        m, info = s.metrics, s.metrics["load"]
        ended = {k: sum(r.get(k, 0) for r in info.get("rounds", [])) for k in ("done", "timeout", "cancelled", "rejected")}
        tps = m.get("throughput_tokens_per_s")
        cells = [s.label(), s.status, str(info.get("clients", "–")), f"{tps:.1f}" if isinstance(tps, int | float) else "–",
                 trio(m, "ttft_ms"), trio(m, "itl_ms"), " / ".join(str(ended[k]) for k in ("done", "timeout", "cancelled", "rejected"))]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return [*out, ""]



# Where a step's time went, in the order it is spent; each key is a ``Step.timings`` entry (seconds).
# measure_s holds the warm-ups (both plans' when interleaved) and the rounds; warmup_s is this plan's warm-up within it.
TIME_PARTS = (("build_s", "build"), ("compile_s", "compile"), ("reference_s", "reference"), ("measure_s", "measure"), ("quality_s", "quality"))


def _seconds(timings: dict[str, Any] | None, key: str) -> float | None:
    value = (timings or {}).get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def time_line(timings: dict[str, Any] | None, *, rounds: Any = None) -> str | None:
    """``time: build 3.1 s, measure 38.0 s (4 rounds, warm-ups included: this plan's 1.2 s), quality 24.5 s``,
    from a step's recorded timings only (a part it did not record is left out); None when it recorded none."""
    parts = []
    for key, name in TIME_PARTS:
        if (s := _seconds(timings, key)) is None:
            continue
        text = f"{name} {s:.1f} s"
        if key == "measure_s":
            bits = [f"{rounds} rounds"] if isinstance(rounds, int | str) else []
            if (warm := _seconds(timings, "warmup_s")) is not None:
                bits.append(f"warm-ups included: this plan's {warm:.1f} s")
            text += f" ({', '.join(bits)})" if bits else ""
        parts.append(text)
    return "time: " + ", ".join(parts) if parts else None


def time_lines(baseline: Step | None, steps: list[Step], *, calibration: dict[str, Any], final: dict[str, Any]) -> list[str]:
    """Markdown lines: where the run's time went, in all and per step (``Step.timings``, the final
    confirmation's ``confirmation.timings``); every number is one the trace recorded. Empty when none is."""
    rows: list[tuple[str, dict[str, Any], Any]] = []
    if baseline is not None:
        rows.append(("baseline (A/A calibration)", baseline.timings, calibration.get("rounds")))
    rows += [(f"{s.layer}/{s.label()}", s.timings, (s.metrics.get("comparison") or {}).get("rounds")) for s in steps if s.metrics or s.timings]
    conf = (final or {}).get("confirmation") or {}
    if conf.get("timings"):
        loads = conf.get("at_loads") or []
        rounds = " + ".join(f"{e.get('rounds')} ({e.get('label')})" for e in loads) if loads else conf.get("rounds")
        rows.append(("final vs baseline", conf["timings"], rounds))
    lines = [(name, line) for name, timings, rounds in rows if (line := time_line(timings, rounds=rounds)) is not None]
    if not lines:
        return []
    totals = {key: sum(_seconds(t, key) or 0.0 for _, t, _ in rows) for key, _ in TIME_PARTS}
    split = ", ".join(f"{name} {totals[key]:.1f} s" for key, name in TIME_PARTS if any(_seconds(t, key) is not None for _, t, _ in rows))
    out = [f"Where the time went: {sum(totals.values()):.1f} s in these stages ({split}); the rest of the wall time went outside them "
           "(e.g. probing the machine, loading a released plan again). Per step (measure: the warm-ups and the rounds, of both plans when interleaved):", ""]
    return [*out, *(f"- {name}: {line}" for name, line in lines), ""]
