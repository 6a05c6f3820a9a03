"""The run's journal: one fsynced JSON line per finished step, so a killed run can be resumed.

``journal.jsonl`` in the run folder starts with a header holding the run's fingerprint (the
recipe, the base plan, the model files and the machine); then one record for the baseline and one
per finished step, each with what the runner needs to go on from there: the step as the trace
holds it, the verdict's outcome (ramps decide their next level from it), and the state after the
step (the kept plan, its latest measurement, its quality numbers and weights). A line is appended
and fsynced before the step counts as finished, so a kill loses at most the step in progress;
a torn last line (killed mid-write: no newline yet) is dropped on reading, and cut off the file
on resuming, byte for byte, so no whole record is ever rewritten. After the last step comes one
``final`` record: the final confirmation, so resuming a finished run measures nothing again.

Every other malformed line (not JSON, not an object, a record missing what resuming reads, a
step out of order) refuses the resume (:class:`~fractal_opt.core.errors.ResumeError`, exit 2) naming
the line: a journal is never read past a bad line, and never rewritten around one, because the
records after it are as valid as those before.

Resuming (``fractal-opt run RECIPE --out DIR --resume``) compares the fingerprint with the one
in the header and refuses, naming what changed, when they differ: numbers measured with another
recipe, model or machine cannot be mixed into one comparison.

Example:
    >>> a = {"recipe": {"policy": {"min_effect": 0.05}}, "machine": {"cpu": "x"}}
    >>> b = {"recipe": {"policy": {"min_effect": 0.1}}, "machine": {"cpu": "x"}}
    >>> differences(a, b)
    ['recipe: policy.min_effect 0.05 -> 0.1']
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..core.errors import ResumeError
from ..core.machine import Machine
from ..language.recipe import Recipe
from ..measure.metrics import Measurement, Sample
from ..report.trace import Step
from ..tower.plan import Plan
from .outputs import write_outputs

__all__ = ["JOURNAL", "Journal", "differences", "fingerprint", "measurement_from_dict", "measurement_to_dict", "record_problem"]

JOURNAL = "journal.jsonl"
VERSION = 1  # of the journal's records; a journal of another version cannot be resumed
# Model files up to this size are hashed (config, tokenizer, GGUF header-sized files); larger ones
# (the weights) are known by size and modification time, which costs nothing to read.
_HASH_BELOW = 1 << 20
_MAX_FILES = 2000
# Recipe fields that change no number a run records, so changing them does not block a resume
# (a longer timeout is how one resumes a run whose next step needs more time).
_NOT_FINGERPRINTED = {"policy": ("timeout_s",)}


def fingerprint(recipe: Recipe, machine: Machine) -> dict[str, Any]:
    """What a run's numbers depend on, as plain JSON: compared field by field on resume. (The
    code of custom probes is not hashed: a probe edited between kill and resume goes unnoticed.)"""
    data = recipe.to_dict()
    for section, names in _NOT_FINGERPRINTED.items():
        data[section] = {k: v for k, v in (data.get(section) or {}).items() if k not in names}
    return _plain({"journal": VERSION, "recipe": data, "inputs": _inputs(recipe), "base plan": recipe.base_plan().to_dict(),
                   "model files": model_files(recipe.model), "machine": machine.to_dict()})


def _inputs(recipe: Recipe) -> dict[str, str]:
    """What the recipe names by path and a run reads: the suite's requests and the eval set's text, hashed."""
    requests = [[r.id, [list(m) for m in r.messages]] for r in recipe.workload.requests()]
    out = {"requests": hashlib.sha256(json.dumps(requests).encode()).hexdigest()[:16]}
    if recipe.quality.eval and Path(recipe.quality.eval).is_file():
        out["eval set"] = hashlib.sha256(Path(recipe.quality.eval).read_bytes()).hexdigest()[:16]
    return out


def model_files(spec: str) -> dict[str, Any]:
    """The model's files: name -> size and a sha256 (small files) or modification time (the
    weights, too large to hash on every start). A hub id names no local files: it stands for itself."""
    from ..weights.models import local_files, resolve

    try:
        path = resolve(spec).path
    except Exception:  # noqa: BLE001 - an unresolvable model fails later, with its own message
        path = None
    if path is None:
        return {"id": spec}
    path = Path(path)
    files = local_files(path)
    out: dict[str, Any] = {}
    for f in files[:_MAX_FILES]:
        st = f.stat()
        entry: dict[str, Any] = {"size": st.st_size}
        if st.st_size < _HASH_BELOW:
            entry["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
        else:
            entry["mtime_ns"] = st.st_mtime_ns
        out[f.name if f == path else str(f.relative_to(path))] = entry
    if len(files) > _MAX_FILES:
        out["..."] = f"{len(files) - _MAX_FILES} more files"
    return out


def differences(old: dict[str, Any], new: dict[str, Any], *, limit: int = 6) -> list[str]:
    """What changed between two fingerprints, one line per field (``recipe: policy.x 1 -> 2``)."""
    out = []
    for part in sorted(set(old) | set(new)):
        a, b = _flatten(old.get(part)), _flatten(new.get(part))
        for key in sorted(set(a) | set(b)):
            if a.get(key, "<none>") != b.get(key, "<none>"):
                out.append(f"{part}: {key + ' ' if key else ''}{_short(a.get(key, '<none>'))} -> {_short(b.get(key, '<none>'))}")
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


class Journal:
    """The journal file of one run folder."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / JOURNAL

    def exists(self) -> bool:
        return self.path.is_file()

    def read(self) -> list[dict[str, Any]]:
        """Every whole record, in order, each checked (:func:`record_problem`); a torn last line is left out.

        Raises:
            ResumeError: a line that is not a whole, well-formed record, naming it.
        """
        return [record for _, record in self._lines()[0]]

    def start(self, fp: dict[str, Any]) -> None:
        """A fresh journal holding only the header: the run in this folder has begun."""
        self.rewrite([{"kind": "run", "fingerprint": fp}])

    def resume(self, fp: dict[str, Any]) -> list[dict[str, Any]]:
        """The records of the run to resume, after checking its fingerprint against ``fp``. A torn
        last line is cut off the file (the bytes after the last newline), nothing else is touched.

        Raises:
            ResumeError: a malformed line (naming it), or a fingerprint that differs (naming what changed).
        """
        lines, whole = self._lines()
        if not lines:
            raise ResumeError(f"cannot resume {str(self.path.parent)!r}: {JOURNAL} there has no readable header. Use --force to start a new run there.")
        old = lines[0][1]["fingerprint"]
        if old != fp:
            changed = "; ".join(differences(old, fp))
            raise ResumeError(f"cannot resume {str(self.path.parent)!r}: the run there was made with other inputs ({changed}). "
                              "Numbers from different inputs cannot be compared; use --force to start a new run there, or another --out.")
        if whole < self.path.stat().st_size:
            os.truncate(self.path, whole)  # the torn line only: the next append starts on a line of its own
        return [record for _, record in lines[1:]]

    def append(self, record: dict[str, Any]) -> None:
        """Add one record and make it durable before returning."""
        line = json.dumps(record, default=str, allow_nan=True, separators=(",", ":")) + "\n"
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(r, default=str, allow_nan=True, separators=(",", ":")) + "\n" for r in records)
        write_outputs(self.path.parent, {JOURNAL: text})

    def _lines(self) -> tuple[list[tuple[int, dict[str, Any]]], int]:
        """``[(line number, record)]`` of the whole lines, each checked, and the bytes they span."""
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raise ResumeError(f"cannot resume {str(self.path.parent)!r}: {JOURNAL} cannot be read: {e.strerror or e}. Use --force to start a new run there.") from None
        whole = raw.rfind(b"\n") + 1  # after it: a line the run was killed while writing
        out: list[tuple[int, dict[str, Any]]] = []
        previous: dict[str, Any] | None = None
        for number, line in enumerate(raw[:whole].split(b"\n")[:-1], start=1):
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:  # RecursionError: nesting the C decoder refuses
                problem = f"is not valid JSON ({type(e).__name__}: {str(e)[:80]})"
            else:
                problem = record_problem(record, first=number == 1, previous=previous)
            if problem is not None:
                msg = (f"cannot resume {str(self.path.parent)!r}: {JOURNAL} line {number} {problem}. The journal is left as it is: repair or "
                       "remove that line (every line after it is a record of its own), or use --force to start a new run there.")
                raise ResumeError(msg)
            out.append((number, record))
            previous = record
        return out, whole


def record_problem(record: Any, *, first: bool, previous: dict[str, Any] | None) -> str | None:
    """What is wrong with one journal record (after ``previous``), in words, or None.

    Checks what resuming reads: the header's fingerprint; a baseline or step record's step (it must
    read back as a trace :class:`~.trace.Step`) and state (plan and measurement); steps numbered
    1, 2, 3, ... after the baseline; the final confirmation after them.
    """
    if not isinstance(record, dict):
        return f"is a JSON {_json_type(record)}, not a record object"
    kind = record.get("kind")
    if first:
        if kind != "run" or not isinstance(record.get("fingerprint"), dict):
            return 'is not the run\'s header ({"kind": "run", "fingerprint": {...}})'
        return None
    before = None if previous is None else previous.get("kind")
    if kind == "baseline":
        return "is a second baseline" if before != "run" else _state_problem(record)
    if kind == "step":
        position, expected = record.get("position"), previous.get("position", 0) + 1 if before == "step" else 1
        if before not in ("baseline", "step"):
            return "is a step after the final confirmation" if before == "final" else "is a step before the baseline"
        if not isinstance(position, int) or isinstance(position, bool) or position != expected:
            return f"is a step with position {position!r}, expected {expected}"
        return _state_problem(record)
    if kind == "final":
        if before not in ("baseline", "step", "final"):
            return "is a final confirmation before the baseline"
        return None if isinstance(record.get("final"), dict) else "is a final record without its 'final' object"
    return f"has kind {kind!r}, expected one of ['baseline', 'step', 'final'] after the header"


def _state_problem(record: dict[str, Any]) -> str | None:
    """A baseline or step record's step and state, read back as resuming reads them."""
    state = record.get("state") if isinstance(record.get("state"), dict) else {}
    parts: list[tuple[str, Any]] = [
        ("step", lambda: Step.from_dict(record["step"])),
        ("state", lambda: (record["state"]["quality"], record["state"]["weight_mb"])),
        ("state.plan", lambda: Plan.from_dict(state["plan"])),
        ("state.current", lambda: measurement_from_dict(state["current"])),
    ]
    if record["kind"] == "baseline":
        parts.append(("baseline", lambda: (record["calibration"], record["reference_outputs"])))
    for where, read in parts:
        try:
            read()
        except KeyError as e:
            return f"({record['kind']}) has no {e.args[0]!r}" + ("" if where in ("step", "baseline") and e.args[0] == where else f" in its {where}")
        except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong shape (RecipeError is a ValueError)
            return f"({record['kind']}): its {where} does not read back: {type(e).__name__}: {str(e)[:120]}"
    return None


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- measurements

def measurement_to_dict(m: Measurement) -> dict[str, Any]:
    """A Measurement as plain JSON (every sample kept, so a resumed step compares exactly)."""
    return {
        "samples": [dataclasses.asdict(s) for s in m.samples], "repeats": m.repeats, "outputs": m.outputs, "texts": m.texts,
        "warmup_s": m.warmup_s, "memory_source": m.memory_source, "extra": m.extra,
    }


def measurement_from_dict(data: dict[str, Any]) -> Measurement:
    """Inverse of :func:`measurement_to_dict`."""
    tuples = {f.name for f in dataclasses.fields(Sample) if isinstance(f.default, tuple)}
    samples = [Sample(**{k: tuple(v) if k in tuples else v for k, v in s.items()}) for s in data["samples"]]
    return Measurement(samples=samples, repeats=data["repeats"], outputs=data["outputs"], texts=data["texts"], warmup_s=data["warmup_s"],
                       memory_source=data["memory_source"], extra=data.get("extra", {}))


def _plain(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), so fingerprints compare equal."""
    return json.loads(json.dumps(value, default=str))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
