"""Trace: the ledger of a run, a plain record: per step the pass, the plan, the numbers, the verdict and why.

It stores and reads (``trace.json``: :meth:`Trace.to_json`, :meth:`Trace.from_dict`,
:meth:`Trace.load`) and writes the kept passes as a recipe (:meth:`Trace.to_recipe`); it renders
nothing. Every consumer reads it through :class:`fractal_opt.report.reader.Reader` (the final
plan's one figure per metric, the steps in order, the objectives, the answers), and the renderers
(:mod:`fractal_opt.report.terminal`, :mod:`.markdown`, :mod:`.html`) draw what the reader says.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import FractalOptError
from .labels import pass_label

__all__ = ["SCHEMA_VERSION", "Step", "Trace", "TraceSchemaError"]

# The layout of trace.json. 1: no schema_version field (written before it existed); 2: adds
# schema_version, run (versions, start and end times, model fingerprint) and non_finite.
SCHEMA_VERSION = 2


class TraceSchemaError(FractalOptError, ValueError):
    """A trace.json this fractal_opt cannot read (written by a newer one, or not a trace)."""

@dataclass
class Step:
    """One pass tried (or the baseline): what happened and why."""

    pass_name: str
    layer: str
    params: dict[str, Any]
    status: str  # baseline | kept | rolled_back | screened_out | skipped | failed
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
    # versions, started_at / ended_at, model fingerprint: the runner records them (pipeline/run_info.py)
    run: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """The trace as plain data, as trace.json holds it."""
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
