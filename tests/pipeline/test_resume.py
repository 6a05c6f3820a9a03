"""Runs that survive: a run killed with SIGKILL resumes from its journal, a changed input refuses
to resume, and a folder holding a run is never overwritten silently.

The killed runs are child processes of a forkserver that imported fractal_opt and torch once, so
each start costs milliseconds instead of seconds of imports; they run on the fake engine.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import yaml
from conftest import small_recipe_dict

from fractal_opt.cli import main
from fractal_opt.core.machine import Machine
from fractal_opt.language.recipe import load_recipe
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.pipeline.journal import JOURNAL, Journal, differences, fingerprint
from fractal_opt.testing import fake_model_folder as fake_model

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
# The step fields that hold what was measured and decided: a resumed step must carry the journal's exactly.
MEASURED = ("status", "metrics", "changes", "bands", "plan", "census")


def recipe_for(model: Path) -> dict:
    """Four steps, each measured in a fraction of a second on the fake engine: kept, rolled back, rolled back, kept."""
    return small_recipe_dict(model, limit=2, max_new_tokens=4, repeats=2, warmup=0, passes={
        "hardware": [{"dtype": {"dtype": "bfloat16"}}, {"dtype": {"dtype": "float16"}}],
        "model": [{"kv_cache": {"implementation": "off"}}],
        "application": [{"max_new_tokens": {"limit": 2}}],
    })


def _child(recipe: dict, out: str, resume: bool, force: bool) -> None:
    """One run in a child process, as `fractal-opt run` would do it, on the fake engine."""
    from fractal_opt.measure import busy
    from fractal_opt.pipeline import step_measurement
    from fractal_opt.pipeline.runner import Pipeline
    from fractal_opt.testing import FakeEngine, cpu_machine

    step_measurement.snapshot = lambda: busy.snapshot(0.01)  # the load reading waits 1 s by default
    build = FakeEngine.factory(speed={"hardware.dtype": {"bfloat16": 2.0}, "model.kv_cache": {"off": 0.5}}, per_token_ms=2.0)
    Pipeline(recipe, out_dir=out, progress=False, machine=cpu_machine(), build=build, limits=LIMITS, resume=resume, force=force).run()


def _records(out: Path) -> list[dict]:
    return Journal(out).read() if (out / JOURNAL).is_file() else []


def _unfinished(out: Path) -> bool:
    return json.loads((out / "trace.json").read_text()).get("finished") is False


def _wait(condition, proc, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and proc.is_alive():
        assert time.monotonic() < deadline, "the child made no progress"
        time.sleep(0.01)


@pytest.mark.integration
def test_killed_runs_resume_to_every_step_exactly_once(tmp_path):
    """SIGKILL at random points after the baseline, resume, again: every step is in the trace
    once, in order, and each step the journal held comes back with the journal's numbers."""
    seed = int(os.environ.get("FRACTAL_RESUME_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    recipe = recipe_for(fake_model(tmp_path / "model"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "trace.json").write_text(json.dumps({"finished": True, "note": "an older run"}), encoding="utf-8")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["fractal_opt.pipeline.runner", "fractal_opt.testing", "torch"])
    kills, journaled_before_resume, marked_in_progress = 0, [], False
    for attempt in range(8):
        proc = ctx.Process(target=_child, args=(recipe, str(out), attempt > 0, attempt == 0))
        proc.start()
        if attempt == 0:  # --force over the older run: marked in progress before the baseline ends
            _wait(lambda: _unfinished(out) or len(_records(out)) >= 2, proc)
            marked_in_progress = _unfinished(out) and len(_records(out)) < 2
        if attempt < 3:
            target = max(2, len(_records(out)) + 1)  # the baseline, then at least one more finished step
            _wait(lambda target=target: len(_records(out)) >= target, proc)
            time.sleep(rng.uniform(0.0, 0.6))
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
        proc.join(60)
        assert proc.exitcode is not None, "the child hung"
        trace = json.loads((out / "trace.json").read_text())  # whole (atomic writes)
        if proc.exitcode == 0:
            break
        assert proc.exitcode == -signal.SIGKILL, f"seed {seed}: the run failed with exit code {proc.exitcode}"
        if trace["finished"]:  # the kill landed after the run had ended, in the interpreter's exit: a run that finished
            kills -= 1
            break
        journaled_before_resume.append({r["position"]: r for r in _records(out) if r.get("kind") == "step"})
    assert trace["finished"] is True, f"seed {seed}: no run finished"
    assert marked_in_progress, "the older run's finished trace stayed in place while the new run measured its baseline"
    assert kills >= 1, f"seed {seed}: every run finished before its kill"

    trace = json.loads((out / "trace.json").read_text())
    assert trace["finished"] is True
    expected = [(p.name, p.params()) for p in load_recipe(recipe).passes]
    assert [(s["pass"], s["params"]) for s in trace["steps"]] == [(n, json.loads(json.dumps(p))) for n, p in expected], f"seed {seed}"
    records = _records(out)
    positions = [r["position"] for r in records if r.get("kind") == "step"]
    assert positions == list(range(1, len(expected) + 1)), f"seed {seed}: journal positions {positions}"
    assert sum(r["kind"] == "baseline" for r in records) == 1, f"seed {seed}: the baseline was measured again"
    baseline = next(r for r in records if r["kind"] == "baseline")
    assert trace["baseline"]["metrics"] == baseline["step"]["metrics"] and trace["baseline"]["timings"]["from_journal"] is True

    resumed = 0
    for position, step in enumerate(trace["steps"], start=1):
        before = journaled_before_resume[-1].get(position)  # finished before the last kill
        if before is None:
            assert "from_journal" not in step["timings"], f"seed {seed}: step {position} is marked resumed but was not journaled"
            continue
        resumed += 1
        assert step["timings"]["from_journal"] is True and "from the journal" in step["reason"]
        for key in MEASURED:
            assert step[key] == before["step"][key], f"seed {seed}: step {position} {key} differs from the journal"
    assert resumed >= 1, f"seed {seed}: no step came from the journal"


@pytest.fixture
def journaled_run(tmp_path):
    """A run folder as a killed run leaves it: a journal whose fingerprint matches this machine, and a trace."""
    model = fake_model(tmp_path / "model")
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe_for(model)), encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    Journal(out).start(fingerprint(load_recipe(recipe_path), Machine.probe()))
    (out / "trace.json").write_text(json.dumps({"finished": False}), encoding="utf-8")
    return recipe_path, model, out


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_a_changed_recipe_refuses_to_resume_and_says_what_changed(journaled_run, capsys):
    recipe_path, _, out = journaled_run
    data = yaml.safe_load(recipe_path.read_text())
    data["policy"] = {"min_effect": 0.1}
    recipe_path.write_text(yaml.safe_dump(data), encoding="utf-8")
    before = _snapshot(out)
    assert main(["run", str(recipe_path), "--out", str(out), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "recipe: policy.min_effect 0.05 -> 0.1" in err and "--force" in err
    assert _snapshot(out) == before, "a refused resume changed the folder"


def test_a_changed_model_file_refuses_to_resume(journaled_run, capsys):
    recipe_path, model, out = journaled_run
    text = '{"model_type": "fake", "hidden_size": 8}'
    (model / "config.json").write_text(text, encoding="utf-8")
    assert main(["run", str(recipe_path), "--out", str(out), "--resume", "--quiet"]) == 2
    assert f"model files: config.json.size 22 -> {len(text)}" in capsys.readouterr().err


def test_a_folder_holding_a_run_is_not_overwritten(journaled_run, capsys):
    """Without --resume or --force: exit 2 before anything loads, the message names both, the files stay as they were."""
    recipe_path, _, out = journaled_run
    before = _snapshot(out)
    assert main(["run", str(recipe_path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "holds another run" in err and "--resume" in err and "--force" in err
    assert _snapshot(out) == before


def test_an_out_that_is_a_file_is_refused_before_loading(journaled_run, tmp_path, capsys):
    recipe_path, _, _ = journaled_run
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder", encoding="utf-8")
    for out in (blocker, blocker / "sub"):
        assert main(["run", str(recipe_path), "--out", str(out), "--quiet"]) == 2
        assert str(blocker) in capsys.readouterr().err
    assert blocker.read_text() == "not a folder"


def test_resume_and_force_exclude_each_other(journaled_run):
    recipe_path, _, out = journaled_run
    try:
        code = main(["run", str(recipe_path), "--out", str(out), "--resume", "--force"])
    except SystemExit as e:  # argparse's own exit
        code = e.code
    assert code == 2


@pytest.mark.integration
def test_a_torn_last_line_is_dropped(finished_run):
    """A kill in the middle of an append leaves half a line: reading stops before it, resuming cuts
    exactly those bytes off (every whole record stays byte for byte) and the next append starts on a line of its own."""
    _, out = finished_run
    journal = Journal(out)
    whole = journal.path.read_bytes()
    with journal.path.open("a", encoding="utf-8") as f:
        f.write('{"kind": "step", "posi')
    assert [r["kind"] for r in journal.read()] == ["run", "baseline", "step", "step", "step", "step", "final"]
    header = journal.read()[0]["fingerprint"]
    assert [r["kind"] for r in journal.resume(header)] == ["baseline", "step", "step", "step", "step", "final"]
    assert journal.path.read_bytes() == whole
    journal.append({"kind": "final", "final": {"status": "again"}})
    assert journal.read()[-1] == {"kind": "final", "final": {"status": "again"}}


def _fake_pipeline(recipe: dict, out: Path, *, resume: bool = False, force: bool = False, build=None):
    """The run _child makes, in this process (finished_run makes the load reading quick)."""
    from fractal_opt.pipeline.runner import Pipeline
    from fractal_opt.testing import FakeEngine, cpu_machine

    build = build or FakeEngine.factory(speed={"hardware.dtype": {"bfloat16": 2.0}, "model.kv_cache": {"off": 0.5}}, per_token_ms=2.0)
    return Pipeline(recipe, out_dir=out, progress=False, machine=cpu_machine(), build=build, limits=LIMITS, resume=resume, force=force)


def _no_build(plan, **kwargs):
    raise AssertionError(f"resuming measured again: it built {plan.applied}")


@pytest.fixture
def finished_run(tmp_path, monkeypatch):
    """A finished run's folder (on the fake engine): its journal is a header, the baseline, four steps and the final confirmation."""
    from fractal_opt.measure import busy
    from fractal_opt.pipeline import step_measurement

    monkeypatch.setattr(step_measurement, "snapshot", lambda: busy.snapshot(0.01))  # the load reading waits 1 s by default
    recipe = recipe_for(fake_model(tmp_path / "model"))
    out = tmp_path / "out"
    _fake_pipeline(recipe, out).run()
    return recipe, out


@pytest.mark.integration
def test_resuming_a_finished_run_measures_nothing_and_gives_the_same_result(finished_run):
    """--resume on a finished run: the steps and the final confirmation come from the journal, no
    engine is built, the result is the same and trace.json says finished; --reconfirm measures the
    confirmation again and journals it as a new record."""
    recipe, out = finished_run
    records = _records(out)
    assert records[-1]["kind"] == "final" and records[-1]["final"]["status"] != "provisional"
    before = json.loads((out / "trace.json").read_text())
    result = _fake_pipeline(recipe, out, resume=True, build=_no_build).run()
    after = json.loads((out / "trace.json").read_text())
    assert after["finished"] is True and result.trace.final == before["final"] == after["final"]
    assert len(_records(out)) == len(records), "resuming a finished run appended records"
    again = _fake_pipeline(recipe, out, resume=True)
    again.reconfirm = True
    again.run()
    assert [r["kind"] for r in _records(out)][-2:] == ["final", "final"]


def _corrupt(out: Path, line: int, text: str) -> bytes:
    lines = (out / JOURNAL).read_bytes().split(b"\n")
    lines[line - 1] = text.encode()
    (out / JOURNAL).write_bytes(b"\n".join(lines))
    return (out / JOURNAL).read_bytes()


def _first_step(out: Path) -> dict:
    return next(r for r in _records(out) if r["kind"] == "step")


CORRUPTIONS = {  # name -> (line, the line's new text from the run's own records, a substring of the refusal)
    "header-fingerprint-null": (1, lambda out: json.dumps({"kind": "run", "fingerprint": None}), "not the run's header"),
    "header-a-list": (1, lambda out: "[1, 2]", "is a JSON list"),
    "step-a-list": (3, lambda out: "[]", "is a JSON list"),
    "step-without-position": (3, lambda out: json.dumps({k: v for k, v in _first_step(out).items() if k != "position"}), "position None, expected 1"),
    "step-out-of-order": (3, lambda out: json.dumps({**_first_step(out), "position": 3}), "position 3, expected 1"),
    "step-state-cut": (3, lambda out: json.dumps({**_first_step(out), "state": {**_first_step(out)["state"], "plan": {}}}), "has no 'source' in its state.plan"),
    "baseline-without-step": (2, lambda out: json.dumps({k: v for k, v in _records(out)[1].items() if k != "step"}), "has no 'step'"),
    "zeroed-middle-line": (4, lambda out: "\0" * 300, "is not valid JSON"),
    "nested-100k-deep": (5, lambda out: "[" * 100_000 + "]" * 100_000, "is not valid JSON"),
}


@pytest.mark.integration
@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_malformed_journal_line_refuses_to_resume_naming_it(finished_run, name, capsys, monkeypatch):
    """Every malformed record (a null fingerprint, a list, a step without position or out of order,
    a baseline without its step, a zeroed middle line, 100,000-deep nesting): exit 2 naming the line,
    nothing measured, and the journal left byte for byte (the valid records after it are kept)."""
    import fractal_opt.runtimes

    recipe, out = finished_run
    line, text, expected = CORRUPTIONS[name]
    journal = _corrupt(out, line, text(out))
    (out / "recipe-in.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    monkeypatch.setattr(fractal_opt.runtimes.RUNTIMES, "build", _no_build)
    assert main(["run", str(out / "recipe-in.yaml"), "--out", str(out), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{JOURNAL} line {line} " in err and expected in err and "Traceback" not in err, err
    assert (out / JOURNAL).read_bytes() == journal


@pytest.mark.parametrize("name", [JOURNAL, "trace.json"])
def test_a_run_file_that_is_a_folder_is_refused(tmp_path, name, capsys):
    """journal.jsonl or trace.json being a folder: exit 2 naming it, with --resume and --force alike."""
    recipe = recipe_for(fake_model(tmp_path / "model"))
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    for flag in ("--resume", "--force"):
        assert main(["run", str(recipe_path), "--out", str(out), flag, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"{name} there is a folder" in err and "Traceback" not in err, err


def test_an_empty_out_is_refused(journaled_run, tmp_path, monkeypatch, capsys):
    """`run --out ""` would write into the current folder: exit 2, nothing written there."""
    recipe_path, _, _ = journaled_run
    monkeypatch.chdir(tmp_path / "out")
    before = _snapshot(tmp_path / "out")
    assert main(["run", str(recipe_path), "--out", "", "--quiet"]) == 2
    assert "--out: got ''" in capsys.readouterr().err
    assert _snapshot(tmp_path / "out") == before


def test_differences_name_each_changed_field():
    old = {"machine": {"cpu": "a", "packages": {"torch": "2.1"}}, "recipe": {"model": "m"}}
    new = {"machine": {"cpu": "a", "packages": {"torch": "2.2"}}, "recipe": {"model": "m", "name": "x"}}
    assert differences(old, new) == ["machine: packages.torch 2.1 -> 2.2", "recipe: name <none> -> x"]


def test_resuming_rebuilds_the_same_kept_state_from_the_journal(tmp_path, monkeypatch):
    """The kept state (plan, measurement, quality, census) after a finished run equals the one a
    resume rebuilds from the journal without measuring: the value the next step would start from."""
    from fractal_opt.measure import busy
    from fractal_opt.pipeline import step_measurement

    monkeypatch.setattr(step_measurement, "snapshot", lambda: busy.snapshot(0.01))  # the load reading waits 1 s by default
    recipe = small_recipe_dict(fake_model(tmp_path / "model"), limit=1, max_new_tokens=4, repeats=2, max_repeats=2, warmup=0,
                               passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}], "model": [{"kv_cache": {"implementation": "off"}}]})
    first = _fake_pipeline(recipe, tmp_path / "out")
    first.run()

    def refuse_to_build(*a, **k):
        raise AssertionError("a resumed finished run builds nothing")

    again = _fake_pipeline(recipe, tmp_path / "out", resume=True, build=refuse_to_build)
    again.run()
    assert [s.status for s in again._trace.steps] == [s.status for s in first._trace.steps] == ["kept", "rolled_back"]
    a, b = first.kept, again.kept
    assert (b.plan, b.measurement, dict(b.census)) == (a.plan, a.measurement, dict(a.census)) and b.plan.hardware.dtype == "bfloat16"
    assert json.dumps(dict(b.quality), sort_keys=True, default=str) == json.dumps(dict(a.quality), sort_keys=True, default=str)
