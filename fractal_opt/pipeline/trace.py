"""Trace: the ledger of a run — per step the pass, the plan, the numbers, the verdict and why.

Renders to JSON (``trace.json``), Markdown (``report.md``), a terminal table, and a notebook
``_repr_html_``; :meth:`Trace.to_recipe` writes the kept passes as a recipe.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .report import calibration_lines, measurement_lines

__all__ = ["Step", "Trace"]

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


@dataclass
class Step:
    """One pass tried (or the baseline): what happened and why."""

    pass_name: str
    layer: str
    params: dict[str, Any]
    status: str  # baseline | kept | rolled_back | skipped | failed
    reason: str
    metrics: dict[str, Any] = field(default_factory=dict)  # medians + "quality" + "spread"
    changes: dict[str, float] = field(default_factory=dict)  # relative change vs the previous kept plan
    bands: dict[str, float] = field(default_factory=dict)  # noise band per metric used by the verdict
    plan: dict[str, Any] = field(default_factory=dict)
    census: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # build_s, warmup_s, measure_s

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["pass"] = data.pop("pass_name")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Step:
        data = dict(data)
        data["pass_name"] = data.pop("pass")
        return cls(**data)

    def value(self, key: str) -> Any:
        if key in self.metrics:
            return self.metrics[key]
        return self.metrics.get("quality", {}).get(key)


@dataclass
class Trace:
    """Everything a run did, in order. ``final`` is the best plan found so far."""

    recipe: dict[str, Any]
    machine: dict[str, Any] = field(default_factory=dict)
    baseline: Step | None = None
    calibration: dict[str, Any] = field(default_factory=dict)  # A/A changes per metric
    steps: list[Step] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    finished: bool = False

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "machine": self.machine,
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "calibration": self.calibration,
            "steps": [s.to_dict() for s in self.steps],
            "final": self.final,
            "finished": self.finished,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        return cls(
            recipe=data["recipe"],
            machine=data.get("machine", {}),
            baseline=Step.from_dict(data["baseline"]) if data.get("baseline") else None,
            calibration=data.get("calibration", {}),
            steps=[Step.from_dict(s) for s in data.get("steps", [])],
            final=data.get("final", {}),
            finished=data.get("finished", False),
        )

    def to_recipe(self):
        """The kept passes as a Recipe (same model, workload, policy and quality settings)."""
        from ..recipe import parse_recipe

        data = dict(self.recipe)
        kept: dict[str, list] = {}
        for s in self.steps:
            if s.status == "kept":
                kept.setdefault(s.layer, []).append({s.pass_name: s.params})
        data["passes"] = kept
        return parse_recipe(data, where="trace", check_model=False)

    # ------------------------------------------------------------------ rendering
    def rows(self) -> list[list[str]]:
        """The tower table: one row per step, numbers with their change vs the previous plan."""
        rows = []
        for s in ([self.baseline] if self.baseline else []) + self.steps:
            row = [s.layer, _pass_label(s), s.status]
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

    def headers(self) -> list[str]:
        return ["layer", "pass", "status", *(h for _, h, _ in COLUMNS), "reason"]

    def to_markdown(self) -> str:
        lines = [f"# fractal_opt report: {self.recipe.get('name') or self.recipe.get('model')}", ""]
        m = self.machine
        if m:
            lines += [f"Machine: {m.get('cpu')}, {m.get('logical_cores')} logical / {m.get('physical_cores')} physical cores, "
                      f"{(m.get('memory_bytes') or 0) / 2**30:.1f} GiB RAM, GPUs: {', '.join(m.get('cuda_devices') or []) or 'none'}; "
                      f"torch {m.get('packages', {}).get('torch')}, transformers {m.get('packages', {}).get('transformers')}.", ""]
        wl = self.recipe.get("workload", {})
        lines += [f"Workload: suite `{wl.get('suite')}`, {wl.get('max_new_tokens')} new tokens max, {wl.get('repeats')} repeats after {wl.get('warmup')} warm-up. "
                  "Numbers are medians; (±%) is the change against the previous kept plan; KL and agreement are against the baseline.", ""]
        lines += calibration_lines(self.calibration)
        lines += ["| " + " | ".join(self.headers()) + " |", "|" + "---|" * len(self.headers())]
        for row in self.rows():
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        lines.append("")
        lines += _work_table([self.baseline] if self.baseline else [], self.steps)
        lines += _load_table([self.baseline] if self.baseline else [], self.steps)
        lines += measurement_lines(([self.baseline] if self.baseline else []) + self.steps)
        if self.final:
            kept = self.final.get("kept") or []
            lines.append(f"Final plan: {', '.join(kept) if kept else 'the baseline (no pass was kept)'}.")
            gains = self.final.get("vs_baseline") or {}
            if gains:
                lines.append("Final vs baseline: " + ", ".join(f"{k} {v:+.1%}" for k, v in gains.items()) + ".")
        if not self.finished:
            lines.append("")
            lines.append("**This run did not finish**: the table shows the steps completed so far.")
        return "\n".join(lines) + "\n"

    def to_text(self, width: int = 160) -> str:
        """A fixed-width table for the terminal (the reason column wraps under the row)."""
        headers = self.headers()[:-1]
        rows = self.rows()
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
        out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
        out.append("  ".join("-" * w for w in widths))
        for r in rows:
            out.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)))
            out.append("    -> " + r[-1])
        return "\n".join(out)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers())
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in self.rows())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _pass_label(step: Step) -> str:
    if step.status == "baseline":
        return "baseline"
    inner = ", ".join(f"{k}={v}" for k, v in step.params.items())
    return f"{step.pass_name}({inner})"


def _work_table(baseline: list[Step], steps: list[Step]) -> list[str]:
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
            _pass_label(s), s.status,
            f"{m['new_tokens']:.0f}" if isinstance(m.get("new_tokens"), int | float) else "–",
            f"{m.get('hit_cap') or 0:.0%}", f"{m.get('cache_hit_rate') or 0:.0%}", f"{m.get('prompt_tokens_saved') or 0:.0f}",
            f"{acc:.2f}" if isinstance(acc, int | float) else "–",
        ]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return [*out, ""]


def _load_table(baseline: list[Step], steps: list[Step]) -> list[str]:
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
        cells = [_pass_label(s), s.status, str(info.get("clients", "–")), f"{tps:.1f}" if isinstance(tps, int | float) else "–",
                 trio(m, "ttft_ms"), trio(m, "itl_ms"), " / ".join(str(ended[k]) for k in ("done", "timeout", "cancelled", "rejected"))]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return [*out, ""]

