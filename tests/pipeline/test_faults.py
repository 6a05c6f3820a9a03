"""Every failure contained: a fault injected at each stage of a step ends that step as a recorded
``failed`` (or rolled back, for a NaN) and the run goes on to a finished trace; a failing baseline
ends the run with a clear message and a written, finished trace instead of a traceback.

One run on the fake engine carries one fault per step stage (check, apply, build, measure, hang,
NaN, a probe's SystemExit, judge) and a healthy pass last; the baseline faults are runs of their own.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import small_recipe_dict

from fractal_opt.core.errors import RunFailed
from fractal_opt.language.policy import Policy
from fractal_opt.language.recipe import load_recipe
from fractal_opt.layers.hardware import Dtype
from fractal_opt.measure import busy
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.pipeline import deadline, step_measurement
from fractal_opt.pipeline.deadline import StepTimeout, WorkerAbandoned, checkpoint, run_with_deadline
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.testing import FakeEngine, cpu_machine
from fractal_opt.testing import fake_model_folder as fake_model
from fractal_opt.tower.passes import Layer, Pass
from fractal_opt.tower.plan import Plan

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
TIMEOUT_S = 6.0  # policy.timeout_s of the fault run: far above a healthy fake step, even on a busy machine
RELEASE = threading.Event()  # what the native hang waits for (set when the fault run is over)

# The probes a recipe names (quality.probes), importable from a module the tests write.
PROBES = '''
def steady(engine):
    if engine.plan.hardware.threads == 7:
        raise SystemExit(3)
    return {"score": 1.0}

def broken(engine):
    raise ValueError("the probe's model file is missing")

def leaves(engine):
    raise SystemExit(4)

def spins(engine):
    while True:
        pass
'''


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckRaises(Pass):
    """A pass whose check raises."""

    name = "check_raises"
    layer = Layer.HARDWARE

    def check(self, plan: Plan, machine) -> str | None:
        raise RuntimeError("check broke")

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", threads=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckBlocks(Pass):
    """A pass whose check blocks in native code (a lock wait), which no exception can interrupt."""

    name = "check_blocks"
    layer = Layer.HARDWARE

    def check(self, plan: Plan, machine) -> str | None:
        RELEASE.wait(120)
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", threads=6)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApplyRaises(Pass):
    """A pass whose apply raises."""

    name = "apply_raises"
    layer = Layer.HARDWARE

    def apply(self, plan: Plan) -> Plan:
        raise KeyError("apply broke")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Threads(Pass):
    """Sets the thread count, which selects the fake engine's injected fault."""

    name = "fault_threads"
    layer = Layer.HARDWARE
    value: int = 1

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", threads=self.value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch(Pass):
    """A scheduling change; the fault run's policy cannot judge scheduling steps."""

    name = "fault_batch"
    layer = Layer.SCHEDULING

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("scheduling", batch_size=3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeRaises(Policy):
    """A policy whose verdict on a scheduling step raises."""

    def judge(self, layer, *args, **kwargs):
        if layer is Layer.SCHEDULING:
            raise ZeroDivisionError("judge broke")
        return super().judge(layer, *args, **kwargs)




@pytest.fixture(scope="module")
def probes_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("probes")
    (folder / "fault_probes.py").write_text(PROBES, encoding="utf-8")
    sys.path.insert(0, str(folder))
    yield "fault_probes"
    sys.path.remove(str(folder))
    sys.modules.pop("fault_probes", None)


@pytest.fixture(scope="module", autouse=True)
def _quick_load_reading():
    """The busy-machine reading waits 1 s per run by default; these runs need none of it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_measurement, "snapshot", lambda: busy.snapshot(0.01))
        yield


def _recipe(model: Path, probe: str, *, timeout_s: float = TIMEOUT_S, passes: dict | None = None) -> dict:
    # max_repeats 2: no extra rounds, so the baseline's A/A calibration stays well inside timeout_s
    # on a loaded machine (the fake's throughput is wall-clock, and a t interval from 2 rounds is wide).
    recipe = small_recipe_dict(model, limit=1, max_new_tokens=4, repeats=2, max_repeats=2, warmup=0, passes=passes or {},
                               policy={"timeout_s": timeout_s})
    recipe["quality"] = {"reference_tokens": 32, "probes": [probe], "allow_code": True}
    return recipe


def _pipeline(recipe, out: Path, **fake) -> Pipeline:
    return Pipeline(recipe, out_dir=out, progress=False, machine=cpu_machine(), build=FakeEngine.factory(**fake), refuse=lambda plan: None,
                    limits=LIMITS)


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory, probes_module):
    """One run with a fault at every stage of a step, then a healthy pass."""
    root = tmp_path_factory.mktemp("faults")
    recipe = load_recipe(_recipe(fake_model(root / "model"), f"{probes_module}:steady", passes={"application": [{"max_new_tokens": {"limit": 2}}]}))
    faulty = (CheckRaises(), ApplyRaises(), Threads(value=2), Threads(value=3), Threads(value=4), CheckBlocks(), Dtype(dtype="float16"), Threads(value=7), Batch())
    recipe = dataclasses.replace(recipe, passes=faulty + recipe.passes, policy=JudgeRaises(**{f.name: getattr(recipe.policy, f.name)
                                                                                             for f in dataclasses.fields(Policy)}))
    pipeline = _pipeline(recipe, root / "out", fail={"hardware.threads": {2: "simulated out of memory while loading"}},
                         fail_serve={"hardware.threads": {3: "simulated CUDA error while decoding"}},
                         hang_s={"hardware.threads": {4: 120.0}}, nan={"hardware.dtype": {"float16": True}},
                         # faster, so their quality is scored (a step whose objective did not improve is rolled back unscored)
                         speed={"hardware.dtype": {"float16": 3.0}, "hardware.threads": {7: 3.0}})
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        # How long a timed-out worker may take to stop before it is abandoned. A stopping worker
        # still records its failure (trace.json, report.md, report.html) before it ends: 0.5 s was
        # too short for that on a loaded clean-clone CI run, which abandoned the hung step instead.
        mp.setattr(deadline, "GRACE_S", 3.0)
        try:
            result = pipeline.run()
        finally:
            RELEASE.set()  # the abandoned worker wakes, meets its pending StepTimeout and ends
    trace = json.loads((root / "out" / "trace.json").read_text())
    return result, trace, time.perf_counter() - t0


def _step(fault_run, position: int):
    result, trace, _ = fault_run
    assert trace["finished"] is True, "the run did not finish"
    assert len(trace["steps"]) == 10
    return result.trace.steps[position - 1]


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_a_check_that_raises_is_a_failed_step(fault_run):
    """A pass whose check raises is a failed step naming the stage and the exception, with the traceback kept."""
    step = _step(fault_run, 1)
    assert (step.status, step.reason) == ("failed", "check: RuntimeError: check broke")
    assert "check broke" in step.timings["traceback"]


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_an_apply_that_raises_is_a_failed_step(fault_run):
    """A pass whose apply raises is a failed step naming the stage and the exception."""
    step = _step(fault_run, 2)
    assert (step.status, step.reason) == ("failed", "apply: KeyError: 'apply broke'")


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_a_failed_build_is_a_failed_step(fault_run):
    """A build that raises (simulated out of memory) is a failed step naming the stage and the message."""
    step = _step(fault_run, 3)
    assert (step.status, step.reason) == ("failed", "build: RuntimeError: simulated out of memory while loading")


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_a_failed_measurement_is_a_failed_step(fault_run):
    """Serving that raises during measurement is a failed step naming the stage and the message."""
    step = _step(fault_run, 4)
    assert (step.status, step.reason) == ("failed", "measure: RuntimeError: simulated CUDA error while decoding")


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_a_hung_step_ends_at_its_timeout(fault_run):
    """The fake engine hangs for 120 s; the step ends as failed at timeout_s and the run goes on."""
    step = _step(fault_run, 5)
    assert step.status == "failed" and step.reason.startswith(f"timeout after {TIMEOUT_S:g} s (policy.timeout_s), in measure"), step.reason
    _, _, seconds = fault_run
    assert seconds < 100, "the hang was waited out instead of cut at the timeout"


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_a_step_blocked_in_native_code_is_abandoned_and_the_run_goes_on(fault_run):
    """A wait that StepTimeout cannot interrupt: the step is failed after the grace period, its
    worker left running, and the next steps run on the plan as it was before it."""
    step = _step(fault_run, 6)
    assert step.status == "failed" and step.reason.startswith(f"timeout after {TIMEOUT_S:g} s (policy.timeout_s); the step"), step.reason
    assert "did not stop" in step.reason and step.reason.endswith("(it was in check)")
    assert _step(fault_run, 7).plan["hardware"]["threads"] is None, "the abandoned step's plan leaked into the next one"


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_a_nan_quality_number_is_not_kept(fault_run):
    """float16 overflows to NaN log-probabilities, so KL is NaN; the guard that watches it trips (policy: not finite)."""
    step = _step(fault_run, 7)
    assert step.status == "rolled_back" and "not finite" in step.reason, step.reason


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_a_probe_that_calls_sys_exit_is_a_failed_step(fault_run):
    """A custom quality probe calling sys.exit is a failed step, not the end of the run."""
    step = _step(fault_run, 8)
    assert (step.status, step.reason) == ("failed", "quality: RuntimeError: custom probe 'steady' called sys.exit(3)")


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_a_judge_that_raises_is_a_failed_step(fault_run):
    """A policy whose judge raises is a failed step naming the stage and the exception."""
    step = _step(fault_run, 9)
    assert (step.status, step.reason) == ("failed", "judge: ZeroDivisionError: judge broke")


@pytest.mark.integration  # the fault run waits out two 6 s step timeouts: ~20 s
def test_the_run_goes_on_after_every_fault(fault_run):
    """The healthy pass after the faults is measured and kept, on the plan the faults left alone."""
    result, trace, _ = fault_run
    step = _step(fault_run, 10)
    assert step.status == "kept", step.reason
    assert result.plan.hardware.threads is None and result.plan.application.max_new_tokens == 2
    assert trace["final"]["kept"] == ["application/max_new_tokens"]


@pytest.mark.parametrize(("probe", "reason"), [
    ("broken", "baseline: quality: RuntimeError: custom probe 'broken' raised ValueError: the probe's model file is missing"),
    ("leaves", "baseline: quality: RuntimeError: custom probe 'leaves' called sys.exit(4)"),
])
def test_a_failing_baseline_ends_the_run_with_a_finished_trace(probes_module, tmp_path, probe, reason):
    """A baseline whose probe raises or exits ends the run with RunFailed and a finished trace.json that records why."""
    pipeline = _pipeline(_recipe(fake_model(tmp_path / "model"), f"{probes_module}:{probe}", passes={"application": [{"max_new_tokens": {"limit": 2}}]}),
                         tmp_path / "out")
    with pytest.raises(RunFailed, match="the baseline failed, so no pass was tried") as e:
        pipeline.run()
    assert reason in str(e.value) and "trace.json records it" in str(e.value)
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert trace["finished"] is True and trace["steps"] == []
    assert (trace["baseline"]["status"], trace["baseline"]["reason"]) == ("failed", reason)


def test_a_hung_baseline_ends_at_its_timeout(probes_module, tmp_path):
    """A baseline stuck in a probe ends at policy.timeout_s with RunFailed and a finished trace.json."""
    pipeline = _pipeline(_recipe(fake_model(tmp_path / "model"), f"{probes_module}:spins", timeout_s=1), tmp_path / "out")
    with pytest.raises(RunFailed, match=r"timeout after 1 s \(policy.timeout_s\)"):
        pipeline.run()
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert trace["finished"] is True and trace["baseline"]["status"] == "failed"


# ---------------------------------------------------------------------- the deadline itself

def test_the_deadline_returns_and_raises_what_the_step_did():
    """run_with_deadline returns the step's value, with or without a deadline, and passes its SystemExit on."""
    assert run_with_deadline(lambda: 42, 5) == 42
    assert run_with_deadline(lambda: 42, None) == 42

    def exits():
        raise SystemExit(5)

    with pytest.raises(SystemExit):
        run_with_deadline(exits, 5)


def test_a_python_hang_is_stopped_at_the_deadline():
    """A loop in Python code gets StepTimeout raised inside it; a loop that reports progress stops at its next checkpoint."""
    def spin():
        while True:
            pass

    def polls():
        while True:
            time.sleep(0.01)
            checkpoint()

    for hang in (spin, polls):
        t0 = time.perf_counter()
        with pytest.raises(StepTimeout):
            run_with_deadline(hang, 0.2)
        assert time.perf_counter() - t0 < 5


def test_a_hang_on_a_thread_of_its_own_is_stopped_with_the_step():
    """Work the step hands to a thread of its own (a round, the quality gate: core.threads.in_own_thread)
    is stopped with it: the StepTimeout that interrupts the step's join() is passed on, though the
    interrupted join() makes that thread look stopped, and no thread is left spinning."""
    from fractal_opt.core.threads import in_own_thread

    def spin():
        while True:
            pass

    with pytest.raises(StepTimeout):
        run_with_deadline(lambda: in_own_thread(spin), 0.2)
    time.sleep(0.2)
    assert not [t for t in threading.enumerate() if t.name == "fractal-opt-round"]


def test_a_worker_stuck_in_native_code_is_abandoned():
    """A call that blocks in C cannot be interrupted: after the grace period the worker is left
    running (a daemon thread) and the caller is told so."""
    release = threading.Event()
    with pytest.raises(WorkerAbandoned, match="did not stop"):
        run_with_deadline(lambda: release.wait(30), 0.2)
    release.set()
    time.sleep(0.1)  # the abandoned thread ends; later workers (which may get its thread id) are not cancelled
    assert [run_with_deadline(lambda: checkpoint() or 1, 5) for _ in range(20)] == [1] * 20


def test_the_cli_reports_a_failing_baseline_with_exit_1_and_no_traceback(probes_module, tmp_path, monkeypatch, capsys):
    """`fractal-opt run` on a recipe whose probe fails at the baseline: one line saying why, exit 1, trace.json written."""
    import yaml

    from fractal_opt import runtimes
    from fractal_opt.cli import main
    from fractal_opt.pipeline import runner

    monkeypatch.setattr(runtimes.RUNTIMES, "build", FakeEngine.factory())  # no model: the fake engine, as the CLI would build a real one
    monkeypatch.setattr(runner, "probe_limits", lambda *a, **k: LIMITS)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(fake_model(tmp_path / "model"), f"{probes_module}:broken", timeout_s=120)), encoding="utf-8")
    assert main(["run", str(recipe), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "the baseline failed, so no pass was tried" in err and "custom probe 'broken' raised ValueError" in err
    assert "Traceback" not in err
    assert json.loads((tmp_path / "out" / "trace.json").read_text())["finished"] is True
