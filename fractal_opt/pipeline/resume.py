"""The runner's journal and resume: an output folder refused or continued, every finished step
appended to ``journal.jsonl`` (:mod:`.journal`), and a resumed run restored from it.

:class:`Resumable` is the part of :class:`.runner.Pipeline` that reads and writes the journal; it
works on the pipeline's own state (the attributes annotated below), which the pipeline sets up.

A finished run's journal ends with its final confirmation, so resuming it measures nothing: the
steps and the confirmation come back from the journal and the run ends at once with the same
result (``reconfirm`` measures the confirmation again, appending a new ``final`` record).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import runtimes
from ..errors import RecipeError, ResumeError
from ..machine import Machine
from ..measure.machine_limits import MachineLimits
from ..measure.metrics import Measurement
from ..plan import Plan
from ..quality.probes import build_reference
from ..recipe import Recipe
from .journal import JOURNAL, Journal, fingerprint, measurement_from_dict, measurement_to_dict
from .outputs import OUTPUTS, check_writable
from .step_measurement import StepMeasurer
from .trace import Step, Trace

__all__ = ["MEASURER_STATE", "Resumable"]

# The step measurer's state a resumed run carries on from (it depends on what was measured before).
MEASURER_STATE = ("calibration", "prompt_tokens", "previous_solo_peak_mb")


class Resumable:
    """Journal and resume for :class:`.runner.Pipeline` (its attributes, set in its ``__init__``
    and ``run``)."""

    recipe: Recipe
    out_dir: Path | None
    resume: bool
    force: bool
    limits: MachineLimits | None
    progress: Callable[[str], None]
    _trace: Trace
    _plan: Plan
    _current: Measurement | None
    _current_quality: dict[str, Any]
    _weight_mb: float | None
    _steps: StepMeasurer | None
    _limits: MachineLimits | None
    _reference: Any
    _reference_outputs: Any
    _outcome: str
    _journal: Journal | None
    _journaled_baseline: dict[str, Any] | None
    _replay: dict[int, dict[str, Any]]
    _journaled_final: dict[str, Any] | None = None  # the last final confirmation the journal holds (resuming)
    reconfirm: bool = False  # resuming a finished run: measure its final confirmation again (run --reconfirm)

    # What the pipeline provides (runner.Pipeline defines these).
    def _save(self) -> None:
        raise NotImplementedError

    def _new_measurer(self, machine: Machine, limits: MachineLimits | None, *, like: StepMeasurer | None = None) -> StepMeasurer:
        raise NotImplementedError

    def _build(self, plan: Plan, machine: Machine) -> tuple[Any, dict[str, float]]:
        raise NotImplementedError

    def _check_out(self) -> None:
        """Refuse an output folder before anything loads: a file, a folder that cannot be written,
        or one holding another run (unless resuming it or forced)."""
        assert self.out_dir is not None
        if self.resume and self.force:
            raise RecipeError("resume and force exclude each other: --resume continues the run in the folder, --force starts a new one over it.")
        try:
            check_writable(self.out_dir)
            held = [name for name in (JOURNAL, *OUTPUTS) if (self.out_dir / name).exists()]
            folders = [name for name in held if not (self.out_dir / name).is_file()]
        except OSError as e:  # a path the OS refuses (too long a name, a loop of links)
            raise RecipeError(f"--out {str(self.out_dir)[:80]!r}: cannot be used as a folder: {e.strerror or e}. Give another --out.") from None
        if folders:  # a run's files are files: a folder in their place cannot be replaced or read
            raise ResumeError(f"--out {str(self.out_dir)!r}: {', '.join(folders)} there {'is a folder' if len(folders) == 1 else 'are folders'}, "
                              "where a run keeps a file. Remove or rename it, or give another --out. Nothing was changed.")
        if not held or self.force:
            return
        if not self.resume:
            raise ResumeError(f"--out {str(self.out_dir)!r} holds another run ({', '.join(held)}): use --resume to continue it, or --force to "
                              "replace it (in Python: resume=True / force=True), or give another --out. Nothing was changed.")
        if JOURNAL not in held:
            raise ResumeError(f"cannot resume {str(self.out_dir)!r}: it holds {', '.join(held)} but no {JOURNAL} (a run written before "
                              "journals, or by hand): use --force to replace it, or give another --out. Nothing was changed.")

    def _open_journal(self, machine: Machine) -> None:
        """Start the journal, or (resuming) read it back after checking its fingerprint, then mark
        the run in progress: from here trace.json says ``finished: false``, before any model loads."""
        self._journal, self._journaled_baseline, self._replay = None, None, {}
        if self.out_dir is None:
            return
        journal = Journal(self.out_dir)
        fp = fingerprint(self.recipe, machine)
        if self.resume and journal.exists():
            records = journal.resume(fp)  # ResumeError when a line is malformed or the inputs changed: nothing written yet
            self._journaled_baseline = next((r for r in records if r.get("kind") == "baseline"), None)
            self._journaled_final = next((r for r in reversed(records) if r.get("kind") == "final"), None)
            if self._journaled_baseline is not None:
                self._replay = {r["position"]: r for r in records if r.get("kind") == "step"}
                done = f"{len(self._replay)} finished step{'' if len(self._replay) == 1 else 's'}"
                self.progress(f"resuming {self.out_dir}: the baseline and {done} come from {JOURNAL}")
            else:
                self.progress(f"resuming {self.out_dir}: no step had finished there; starting from the baseline")
        else:
            if self.resume:
                self.progress(f"nothing to resume in {self.out_dir}: starting a new run there")
            journal.start(fp)
        self._journal = journal
        self._save()

    def _journal_baseline(self) -> None:
        """Append the measured baseline, with what a resumed run needs to go on without measuring it."""
        if self._journal is None:
            return
        assert self._trace.baseline is not None and self._reference is not None
        self._journal.append({"kind": "baseline", "step": self._trace.baseline.to_dict(), "calibration": self._trace.calibration,
                              "limits": self._trace.machine.get("limits"), "reference_outputs": self._reference.outputs,
                              "state": self._state_record()})

    def _restore_baseline(self, machine: Machine) -> bool:
        """Resuming: the baseline as the journal holds it (False when there is none to restore).
        The reference logits are not journaled; they are scored again when a step first needs them."""
        record = self._journaled_baseline
        if record is None:
            return False
        trace = self._trace
        trace.baseline = Step.from_dict(record["step"])
        trace.baseline.timings["from_journal"] = True  # type: ignore[assignment]
        trace.calibration = record["calibration"]
        if record.get("limits"):
            trace.machine["limits"] = record["limits"]
            self._limits = MachineLimits(**record["limits"])
        else:
            self._limits = self.limits
        self._steps = self._new_measurer(machine, self._limits)
        self._reference, self._reference_outputs = None, record["reference_outputs"]
        self._restore_state(record["state"])
        self.progress("baseline: from the journal (measured by the earlier run)")
        return True

    def _rescore_reference(self, machine: Machine) -> None:
        """Resuming: score the reference text again on the baseline plan, as the baseline did (the
        same model and machine, which the fingerprint vouches for), with the baseline's outputs
        from the journal. No-op when the reference is there already."""
        if self._reference is not None or self._reference_outputs is None:
            return
        assert self._steps is not None
        base = self.recipe.base_plan()
        self.progress("resuming: scoring the reference text on the baseline plan again (quality probes compare with it)")
        engine, _ = self._build(base, machine)
        reference = build_reference(engine, {}, self.recipe.quality)
        reference.outputs = self._reference_outputs
        self._reference = reference
        if base == self._plan and self._steps.previous is None:
            self._steps.previous = engine  # the kept plan is still the baseline: its engine is the previous one
        else:
            engine.close()
            runtimes.evict_except({self._plan.weights_key()})

    def _from_journal(self, step: Step, label: str) -> str | None:
        """Resuming: fill ``step`` from its journal record and restore the state after it; returns
        the record's outcome, or None when the journal holds no more steps (this one runs)."""
        position = len(self._trace.steps) + 1
        record = self._replay.get(position)
        if record is None:
            self._replay.clear()  # from here every step is measured in this run
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
        self._restore_state(record["state"])
        self.progress(f"{label}: {step.status.replace('_', ' ')} (from the journal)")
        return str(record.get("outcome", ""))

    def _journal_step(self, step: Step) -> None:
        """Append the step just recorded (a step restored from the journal is there already)."""
        position, outcome, self._outcome = len(self._trace.steps), self._outcome, ""
        if self._replay.pop(position, None) is not None or self._journal is None:
            return
        self._journal.append({"kind": "step", "position": position, "outcome": outcome, "step": step.to_dict(), "state": self._state_record()})

    def _restore_final(self) -> bool:
        """Resuming a finished run: its final confirmation from the journal (False when there is
        none, when a step was measured in this run, or when ``reconfirm`` asks for a new one)."""
        record = self._journaled_final
        if record is None or self.reconfirm or any(not s.timings.get("from_journal") for s in self._trace.steps):
            return False
        self._trace.final.update(record["final"])
        self.progress("final: the confirmation from the journal (measured by the earlier run; --reconfirm measures it again)")
        return True

    def _journal_final(self) -> None:
        """Append the final confirmation just measured, so a resume of this finished run measures nothing."""
        if self._journal is not None and "error" not in (self._trace.final.get("confirmation") or {}):  # a failed one is tried again on resume
            self._journal.append({"kind": "final", "final": self._trace.final})

    def _state_record(self) -> dict[str, Any]:
        """What the runner goes on from after a step: the kept plan, its latest measurement
        (every sample, so a resumed comparison is exact), its quality and weights, the measurer's memory."""
        assert self._current is not None
        measurer = {name: getattr(self._steps, name, None) for name in MEASURER_STATE}
        return {"plan": self._plan.to_dict(), "current": measurement_to_dict(self._current), "quality": self._current_quality,
                "weight_mb": self._weight_mb, "measurer": measurer}

    def _restore_state(self, state: dict[str, Any]) -> None:
        self._plan = Plan.from_dict(state["plan"])
        self._current = measurement_from_dict(state["current"])
        self._current_quality = dict(state["quality"])
        self._weight_mb = state["weight_mb"]
        for name, value in (state.get("measurer") or {}).items():
            if name in MEASURER_STATE:
                setattr(self._steps, name, value)
