"""The run's state as a value, and the one owner of its journal.

:class:`Kept` is what the runner goes on from after each step: the kept plan, its latest
measurement, its quality numbers and its census. It is frozen: keeping a step makes a new value,
rolling one back keeps the old one, and a step that had to be abandoned leaves it untouched.

:class:`RunJournal` is the only code that reads or writes ``journal.jsonl`` (the file format is
:mod:`.journal`'s): the runner asks it for the baseline and each step's record when resuming,
and hands it each finished step; a record holds the :class:`Kept` value after the step
(:meth:`Kept.to_record`), from which resuming rebuilds the same value (:meth:`Kept.from_record`).

A finished run's journal ends with its final confirmation, so resuming it measures nothing: the
steps and the confirmation come back from the journal and the run ends at once with the same
result (``reconfirm`` measures the confirmation again, appending a new ``final`` record).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import RecipeError, ResumeError
from ..core.machine import Machine
from ..language.recipe import Recipe
from ..measure.metrics import Measurement
from ..report.trace import Step, Trace
from ..tower.plan import Plan
from .journal import JOURNAL, Journal, fingerprint, measurement_from_dict, measurement_to_dict
from .outputs import OUTPUTS, check_writable

__all__ = ["MEASURER_STATE", "Kept", "RunJournal", "check_out"]

# The step measurer's state a resumed run carries on from (it depends on what was measured before).
MEASURER_STATE = ("calibration", "calibration_noise", "prompt_tokens", "previous_solo_peak_mb")


@dataclass(frozen=True)
class Kept:
    """The kept state of a run: the plan the next step starts from, what was last measured for it
    (the fresh previous measurement of the latest comparison), its quality numbers, its census.
    Values are never changed in place; :func:`dataclasses.replace` makes the next one."""

    plan: Plan
    measurement: Measurement | None = None
    quality: Mapping[str, Any] = field(default_factory=dict)
    census: Mapping[str, Any] = field(default_factory=dict)

    @property
    def weight_mb(self) -> float | None:
        """The plan's weights from its census, MB (peak RSS cannot show a quantization's saving
        while the previous plan's model is resident for interleaved measurement)."""
        weight = self.census.get("weight_bytes")
        return None if weight is None else round(weight / 2**20, 1)

    def to_record(self, measurer: Any = None) -> dict[str, Any]:
        """The journal's ``state``: every sample of the measurement (so a resumed comparison is
        exact), the quality numbers, the census, and the measurer's memory (:data:`MEASURER_STATE`)."""
        assert self.measurement is not None, "a journaled state has been measured"
        return {"plan": self.plan.to_dict(), "current": measurement_to_dict(self.measurement), "quality": dict(self.quality),
                "weight_mb": self.weight_mb, "census": dict(self.census), "measurer": {name: getattr(measurer, name, None) for name in MEASURER_STATE}}

    @classmethod
    def from_record(cls, state: Mapping[str, Any]) -> tuple[Kept, dict[str, Any]]:
        """The value :meth:`to_record` wrote, and the measurer's memory to restore."""
        census = state.get("census")
        if census is None:  # a record of a journal written before the census was journaled: its weights only
            census = {} if state["weight_mb"] is None else {"weight_bytes": state["weight_mb"] * 2**20}
        kept = cls(plan=Plan.from_dict(state["plan"]), measurement=measurement_from_dict(state["current"]), quality=dict(state["quality"]),
                   census=dict(census))
        measurer = {k: v for k, v in (state.get("measurer") or {}).items() if k in MEASURER_STATE}
        return kept, measurer


def check_out(out_dir: Path, *, resume: bool, force: bool) -> None:
    """Refuse an output folder before anything loads: a file, a folder that cannot be written,
    or one holding another run (unless resuming it or forced)."""
    if resume and force:
        raise RecipeError("resume and force exclude each other: --resume continues the run in the folder, --force starts a new one over it.")
    try:
        check_writable(out_dir)
        held = [name for name in (JOURNAL, *OUTPUTS) if (out_dir / name).exists()]
        folders = [name for name in held if not (out_dir / name).is_file()]
    except OSError as e:  # a path the OS refuses (too long a name, a loop of links)
        raise RecipeError(f"--out {str(out_dir)[:80]!r}: cannot be used as a folder: {e.strerror or e}. Give another --out.") from None
    if folders:  # a run's files are files: a folder in their place cannot be replaced or read
        raise ResumeError(f"--out {str(out_dir)!r}: {', '.join(folders)} there {'is a folder' if len(folders) == 1 else 'are folders'}, "
                          "where a run keeps a file. Remove or rename it, or give another --out. Nothing was changed.")
    if not held or force:
        return
    if not resume:
        raise ResumeError(f"--out {str(out_dir)!r} holds another run ({', '.join(held)}): use --resume to continue it, or --force to "
                          "replace it (in Python: resume=True / force=True), or give another --out. Nothing was changed.")
    if JOURNAL not in held:
        raise ResumeError(f"cannot resume {str(out_dir)!r}: it holds {', '.join(held)} but no {JOURNAL} (a run written before "
                          "journals, or by hand): use --force to replace it, or give another --out. Nothing was changed.")


class RunJournal:
    """The journal of one run: started fresh, or read back when resuming (after its fingerprint
    is checked), then appended to as the run goes. ``out_dir`` None: a run that writes nothing."""

    def __init__(self, out_dir: Path | None, *, progress: Callable[[str], None] = lambda m: None):
        self.out_dir = out_dir
        self.progress = progress
        self._file: Journal | None = None
        self.baseline: dict[str, Any] | None = None  # the journaled baseline record (resuming)
        self.final: dict[str, Any] | None = None  # the last final confirmation it holds (resuming)
        self._replay: dict[int, dict[str, Any]] = {}  # finished steps by position (1 = the first step)

    def open(self, recipe: Recipe, machine: Machine, *, resume: bool) -> None:
        """Start the journal, or (resuming) read it back after checking its fingerprint."""
        if self.out_dir is None:
            return
        journal = Journal(self.out_dir)
        fp = fingerprint(recipe, machine)
        if resume and journal.exists():
            records = journal.resume(fp)  # ResumeError when a line is malformed or the inputs changed: nothing written yet
            self.baseline = next((r for r in records if r.get("kind") == "baseline"), None)
            self.final = next((r for r in reversed(records) if r.get("kind") == "final"), None)
            if self.baseline is not None:
                self._replay = {r["position"]: r for r in records if r.get("kind") == "step"}
                done = f"{len(self._replay)} finished step{'' if len(self._replay) == 1 else 's'}"
                self.progress(f"resuming {self.out_dir}: the baseline and {done} come from {JOURNAL}")
            else:
                self.progress(f"resuming {self.out_dir}: no step had finished there; starting from the baseline")
        else:
            if resume:
                self.progress(f"nothing to resume in {self.out_dir}: starting a new run there")
            journal.start(fp)
        self._file = journal

    def restore_baseline(self, trace: Trace) -> dict[str, Any] | None:
        """Resuming: put the journaled baseline, its calibration and ceilings into ``trace``; returns
        its record (None when there is none: the baseline is measured)."""
        record = self.baseline
        if record is None:
            return None
        trace.baseline = Step.from_dict(record["step"])
        trace.baseline.timings["from_journal"] = True  # type: ignore[assignment]
        trace.calibration = record["calibration"]
        if record.get("limits"):
            trace.machine["limits"] = record["limits"]
        self.progress("baseline: from the journal (measured by the earlier run)")
        return record

    def restore_step(self, position: int, step: Step, label: str) -> tuple[str, dict[str, Any]] | None:
        """Resuming: fill ``step`` from the journal's record of step ``position`` (checked to be the
        same pass and parameters); returns its outcome and the state after it, or None when the
        journal holds no more steps: from here every step is measured."""
        record = self._replay.get(position)
        if record is None:
            self._replay.clear()
            return None
        if (record["step"]["pass"], record["step"]["params"]) != (step.pass_name, json.loads(json.dumps(step.params, default=str))):
            raise ResumeError(f"cannot resume {str(self.out_dir)!r}: step {position} in its {JOURNAL} is {record['step']['pass']} "
                              f"{record['step']['params']}, but this run's step {position} is {step.pass_name} {step.params} (the passes' "
                              "schedule changed). Use --force to start a new run there.")
        restored = Step.from_dict(record["step"])
        for f in dataclasses.fields(Step):
            setattr(step, f.name, getattr(restored, f.name))
        step.timings["from_journal"] = True  # type: ignore[assignment]
        step.reason += " (from the journal: measured by the earlier run)"
        self.progress(f"{label}: {step.status.replace('_', ' ')} (from the journal)")
        return str(record.get("outcome", "")), record["state"]

    def restore_final(self, trace: Trace, *, reconfirm: bool) -> bool:
        """Resuming a finished run: its final confirmation from the journal into ``trace`` (False
        when there is none, when a step was measured in this run, or ``reconfirm`` asks for a new one)."""
        if self.final is None or reconfirm or any(not s.timings.get("from_journal") for s in trace.steps):
            return False
        trace.final.update(self.final["final"])
        self.progress("final: the confirmation from the journal (measured by the earlier run; --reconfirm measures it again)")
        return True

    def append_baseline(self, step: Step, *, calibration: Any, limits: Any, reference_outputs: Any, state: dict[str, Any]) -> None:
        """The measured baseline, with what a resumed run needs to go on without measuring it."""
        if self._file is not None:
            self._file.append({"kind": "baseline", "step": step.to_dict(), "calibration": calibration, "limits": limits,
                               "reference_outputs": reference_outputs, "state": state})

    def append_step(self, position: int, step: Step, *, outcome: str, state: dict[str, Any]) -> None:
        """A finished step (one restored from the journal is there already)."""
        if self._replay.pop(position, None) is not None or self._file is None:
            return
        self._file.append({"kind": "step", "position": position, "outcome": outcome, "step": step.to_dict(), "state": state})

    def append_final(self, final: dict[str, Any]) -> None:
        """The final confirmation just measured, so a resume of this finished run measures nothing
        (a failed one is not journaled: resuming tries it again)."""
        if self._file is not None and "error" not in (final.get("confirmation") or {}):
            self._file.append({"kind": "final", "final": final})
