"""Trace: the ledger of a run — per step the pass, the plan, the numbers, the verdict and why.

Renders to JSON (``trace.json``), Markdown (``report.md``), a terminal table, and a notebook
``_repr_html_``; :meth:`Trace.to_recipe` writes the kept passes as a recipe.
"""

from __future__ import annotations

import json
import math
import textwrap
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import FractalOptError
from .confirm_text import final_lines
from .labels import pass_label
from .report import calibration_lines, final_one_user_lines, measurement_lines, one_user_lines
from .report_answers import answers_lines
from .report_tables import guard_lines, load_table, time_lines, work_table
from .run_info import now, run_info, wall_time
from .targets import target_lines, target_summary

__all__ = ["SCHEMA_VERSION", "Step", "Trace", "TraceSchemaError"]

# The layout of trace.json. 1: no schema_version field (written before it existed); 2: adds
# schema_version, run (versions, start and end times, model fingerprint) and non_finite.
SCHEMA_VERSION = 2


class TraceSchemaError(FractalOptError, ValueError):
    """A trace.json this fractal_opt cannot read (written by a newer one, or not a trace)."""

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
    bands: dict[str, float] = field(default_factory=dict)  # threshold per metric used by the verdict (interval half-width, at least min_effect)
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

    def __repr__(self) -> str:
        why = self.reason.split(";")[0].strip()  # a verdict's first clause: the objective's move
        why = why if len(why) <= 64 else why[:63] + "…"
        return f"Step({self.layer}/{pass_label(self.pass_name, self.params, self.status)}: {self.status}" + (f", {why}" if why else "") + ")"

    def label(self) -> str:
        """The pass with its non-default parameters, as reports show it."""
        return pass_label(self.pass_name, self.params, self.status)

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
    searches: list[dict[str, Any]] = field(default_factory=list)  # a search pass's answer (concurrency: the highest level under the SLO)
    # versions, started_at / ended_at, model fingerprint (pipeline/run_info.py); None = record them now
    run: dict[str, Any] | None = None
    _end_stamped: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.run is None:
            self.run = run_info(self.recipe, self.machine)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """The trace as plain data. Each call while the run goes on stamps ``run.ended_at`` (the
        last moment known); the first call after ``finished`` is set stamps the end for good."""
        assert self.run is not None
        if not self._end_stamped:
            self.run["ended_at"] = now()
            self._end_stamped = self.finished
        return {
            "schema_version": SCHEMA_VERSION,
            "run": self.run,
            "recipe": self.recipe,
            "machine": self.machine,
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "calibration": self.calibration,
            "steps": [s.to_dict() for s in self.steps],
            "final": self.final,
            "finished": self.finished,
            "searches": self.searches,  # a search pass's answer (Pass.conclusion)
        }

    def to_json(self) -> str:
        """Strict JSON (no NaN / Infinity, which most JSON readers refuse): a non-finite number is
        written as null and listed, with its path and value, under ``non_finite``."""
        data = self.to_dict()
        non_finite: dict[str, str] = {}
        data = _finite(data, "", non_finite)
        if non_finite:
            data["non_finite"] = non_finite
        return json.dumps(data, indent=2, default=str, allow_nan=False)

    def to_html(self) -> str:
        """report.html: the whole run as one self-contained page (pipeline/report_html.py)."""
        from .report_html import render_html

        return render_html(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        """Read a trace.json's data. A trace without ``schema_version`` (version 1, before it was
        recorded) reads with a warning; one from a newer fractal_opt raises TraceSchemaError."""
        if not isinstance(data, dict) or "recipe" not in data:
            raise TraceSchemaError(f"not a fractal_opt trace: expected a JSON object with a 'recipe' key, got {type(data).__name__} "
                                   f"with keys {sorted(data)[:8] if isinstance(data, dict) else '–'}.")
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise TraceSchemaError(f"trace.json: schema_version {version!r} is not a version number (expected an integer, this fractal_opt writes {SCHEMA_VERSION}).")
        if version > SCHEMA_VERSION:
            raise TraceSchemaError(f"trace.json has schema_version {version}, newer than this fractal_opt reads ({SCHEMA_VERSION}); "
                                   f"it was written by fractal_opt {(data.get('run') or {}).get('versions', {}).get('fractal_opt', 'of a later version')}. "
                                   "Upgrade fractal-opt to read it.")
        if version < SCHEMA_VERSION:
            warnings.warn(f"trace.json has schema_version {version} (an older fractal_opt): read as is; it records no versions, "
                          "start and end times or model fingerprint.", UserWarning, stacklevel=2)
        trace = cls(
            run=data.get("run") or {},
            recipe=data["recipe"],
            machine=data.get("machine", {}),
            baseline=Step.from_dict(data["baseline"]) if data.get("baseline") else None,
            calibration=data.get("calibration", {}),
            steps=[Step.from_dict(s) for s in data.get("steps", [])],
            final=data.get("final", {}),
            finished=data.get("finished", False),
            searches=data.get("searches", []),
        )
        # A finished trace keeps its end time; an old one without run info gets none invented.
        trace._end_stamped = trace.finished or not trace.run
        return trace

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace.json file (:meth:`from_dict`), naming the file in any error."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise TraceSchemaError(f"{path}: cannot read a trace: {e}") from None
        try:
            return cls.from_dict(data)
        except TraceSchemaError as e:
            raise TraceSchemaError(f"{path}: {e}") from None

    def to_recipe(self):
        """The kept passes as a Recipe (same model, workload, policy and quality settings).

        When the kept plan leaves the thread count to its runtime (no threads step was kept), the
        recipe also pins the count the runtime reported it ran with (its census ``threads``), so
        the plan served and exported is the one measured, and a server beside other work runs a
        known count instead of whatever the next machine's default is."""
        from ..language.recipe import parse_recipe

        data = dict(self.recipe)
        kept: dict[str, list] = {}
        for s in self.steps:
            if s.status == "kept":
                kept.setdefault(s.layer, []).append({s.pass_name: s.params})
        final = self.final_step()
        if final is not None and (final.plan.get("hardware") or {}).get("threads") is None and (count := self.ran_threads()) is not None:
            kept.setdefault("hardware", []).append({"threads": {"count": count}})
        data["passes"] = kept
        return parse_recipe(data, where="trace", check_model=False)

    def final_step(self) -> Step | None:
        """The step whose plan is the kept plan: the last kept step, else the baseline."""
        kept = [s for s in self.steps if s.status == "kept"]
        return kept[-1] if kept else self.baseline

    def ran_threads(self) -> int | None:
        """The thread count the kept plan ran with, as its runtime reported it (the census
        ``threads`` of :meth:`final_step`); None when the runtime's census does not say."""
        final = self.final_step()
        count = final.census.get("threads") if final is not None else None
        return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None

    # ------------------------------------------------------------------ rendering
    def rows(self) -> list[list[str]]:
        """The tower table: one row per step, numbers with their change vs the previous plan."""
        rows = []
        for s in ([self.baseline] if self.baseline else []) + self.steps:
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

    def headers(self) -> list[str]:
        return ["layer", "pass", "status", *(h for _, h, _ in COLUMNS), "reason"]

    def to_markdown(self) -> str:
        lines = [f"# fractal_opt report: {self.recipe.get('name') or self.recipe.get('model')}", ""]
        m = self.machine
        if m:
            lines += [f"Machine: {m.get('cpu')}, {m.get('logical_cores')} logical / {m.get('physical_cores')} physical cores, "
                      f"{(m.get('memory_bytes') or 0) / 2**30:.1f} GiB RAM, GPUs: {', '.join(m.get('cuda_devices') or []) or 'none'}; "
                      f"torch {m.get('packages', {}).get('torch')}, transformers {m.get('packages', {}).get('transformers')}.", ""]
        if self.finished and (took := wall_time(self.run or {})):
            lines += [f"Wall time: {took} (this run on this machine, {self.run['started_at']} -> {self.run['ended_at']}).", ""]
        lines += time_lines(self.baseline, self.steps, calibration=self.calibration, final=self.final)  # --- where the time went (report_tables.py)
        wl = self.recipe.get("workload", {})
        lines += [f"Workload: suite `{wl.get('suite')}`, {wl.get('max_new_tokens')} new tokens max, {wl.get('repeats')} repeats after {wl.get('warmup')} warm-up. "
                  "Numbers are medians; (±%) is the change against the previous kept plan; KL and agreement are against the baseline.", ""]
        lines += calibration_lines(self.calibration, threads=self.ran_threads())
        lines += ["| " + " | ".join(self.headers()) + " |", "|" + "---|" * len(self.headers())]
        for row in self.rows():
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        lines.append("")
        lines += work_table([self.baseline] if self.baseline else [], self.steps)
        lines += load_table([self.baseline] if self.baseline else [], self.steps)
        lines += one_user_lines(self.baseline, self.steps)  # --- what one user gets per step (pipeline/one_user.py)
        lines += measurement_lines(([self.baseline] if self.baseline else []) + self.steps)
        lines += guard_lines(self.steps)  # --- the guards in force per step
        lines += final_lines(self.final)  # --- final vs baseline, only from the final confirmation (pipeline/confirm.py)
        lines += answers_lines(self)  # the baseline's and the final plan's answers side by side (report_answers.py)
        lines += final_one_user_lines(self.final)  # --- the same, for one user
        lines += [f"Search: {s['answer']} ({s['summary']})." for s in self.searches]  # --- a search pass's answer
        # --- targets (pipeline/targets.py): the gap per step and which were met
        lines += [""] + target_lines(self.recipe, self.baseline, self.steps, self.final) if self.recipe.get("targets") else []
        # --- end targets
        if not self.finished:
            lines.append("")
            lines.append("**This run did not finish**: the table shows the steps completed so far.")
        return "\n".join(lines) + "\n"

    def to_text(self, width: int = 120) -> str:
        """A table for a terminal ``width`` columns wide; each reason is wrapped under its row.

        What does not fit is left out, least telling first: long pass labels are cut, then
        columns dropped (named under the table), and a reason over two lines is cut; report.md
        holds everything in full.
        """
        headers = self.headers()[:-1]
        rows = self.rows()
        keep = list(range(len(headers)))

        def widths(cap: int) -> list[int]:
            return [min(cap, max(len(headers[i]), *(len(r[i]) for r in rows))) if i == 1 else max(len(headers[i]), *(len(r[i]) for r in rows))
                    for i in keep] if rows else [len(headers[i]) for i in keep]

        cap = 40
        dropped: list[str] = []
        while sum(widths(cap)) + 2 * (len(keep) - 1) > width:
            droppable = [i for i in keep if i >= 3 and headers[i] in TEXT_DROP_ORDER]
            if cap > 36:
                cap -= 2
            elif droppable:
                worst = max(droppable, key=lambda i: TEXT_DROP_ORDER.index(headers[i]))
                keep.remove(worst)
                dropped.append(headers[worst])
            elif cap > 12:
                cap -= 4
            else:
                break
        ws = widths(cap)
        out = ["  ".join(headers[i].ljust(w) for i, w in zip(keep, ws)).rstrip(), "  ".join("-" * w for w in ws)]
        for r in rows:
            out.append("  ".join(_fit(r[i], w).ljust(w) for i, w in zip(keep, ws)).rstrip())
            lines = textwrap.wrap(r[-1], width=max(width - 7, 20), break_long_words=True) or [""]
            if len(lines) > 2:
                lines = [lines[0], _fit(lines[1] + " " + " ".join(lines[2:]), max(width - 7, 20) - len(" [...report.md]")) + " [...report.md]"]
            out += ["    -> " + lines[0], *("       " + line for line in lines[1:])]
        if dropped:
            out += textwrap.wrap(f"(left out to fit {width} columns: {', '.join(reversed(dropped))}; report.md and report.html have every column)", width=width)
        out += ["", *target_summary(self.final)] if self.final.get("targets") else []  # targets: which were met
        return "\n".join(out)

    def _repr_html_(self) -> str:
        """In a notebook: the same content as report.html (styles scoped to the output)."""
        from .report_html import render_fragment

        return render_fragment(self)

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for s in self.steps:
            counts[s.status] = counts.get(s.status, 0) + 1
        tally = ", ".join(f"{n} {status.replace('_', ' ')}" for status, n in counts.items()) or "no step yet"
        claimed = self.final.get("status") in (None, "confirmed")  # deltas only from the final confirmation (pipeline/confirm.py)
        gains = ", ".join(f"{k} {v:+.1%}" for k, v in (self.final.get("vs_baseline") or {}).items() if isinstance(v, int | float)) if claimed else ""
        kept = ", ".join(self.final.get("kept") or []) or "none"
        return (f"Trace({self.recipe.get('name') or self.recipe.get('model')!s}: {len(self.steps)} steps ({tally}), "
                f"{'finished' if self.finished else 'not finished'}\n  kept: {kept}" + (f"\n  final vs baseline: {gains}" if gains else "") + ")")


# Terminal columns left out first when the table is too wide (report.md keeps them all).
TEXT_DROP_ORDER = ("e2e ms", "TTFT ms", "throughput tok/s", "KL", "agree", "weights MB", "peak MB", "prefill ms")


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _finite(value: Any, path: str, found: dict[str, str]) -> Any:
    """``value`` with every NaN / infinity replaced by None, each recorded in ``found`` by path."""
    if isinstance(value, float) and not math.isfinite(value):
        found[path or "."] = repr(value)
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), found) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value
