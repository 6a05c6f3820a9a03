"""report.md's per-step tables: the work each step asked for, the guards in force, the steps under load."""

from __future__ import annotations

from typing import Any

Step = Any  # pipeline.trace.Step (not imported: trace imports this module)

__all__ = ["guard_lines", "load_table", "work_table"]


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

