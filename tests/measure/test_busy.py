"""Busy machines: the load snapshot, --wait-quiet, and an A/A calibration that says when it cannot resolve min_effect."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import small_recipe_dict

from fractal_opt.measure import busy
from fractal_opt.measure.busy import BusySnapshot, snapshot, wait_quiet
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.report.measurement import busy_warning, calibration_lines
from fractal_opt.pipeline.step_measurement import CALIBRATION_MAX_ROUNDS, StepMeasurer, calibration_rounds
from fractal_opt.testing import FakeEngine, cpu_machine
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Workload

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
QUIET = BusySnapshot(load_average=(0.1, 0.1, 0.1), cores=2, others_cores=0.0)


def _burners() -> list[int]:
    """One spinning process per core, and one more: every core is contended, whatever else runs.

    Each is started by a short-lived launcher, so it is not a child of this process: the snapshot
    leaves this process's own children out (a runtime's server is the run's own work). Returns the
    pids; the caller kills them (:func:`_stop`)."""
    launcher = ("import subprocess, sys; "
                "print(subprocess.Popen([sys.executable, '-c', 'while True: pass'], start_new_session=True, "
                "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    pids = []
    for _ in range((os.cpu_count() or 1) + 1):
        out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, check=True, timeout=60)
        pids.append(int(out.stdout.strip()))
    return pids


def _stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class JitteryEngine(FakeEngine):
    """A fake engine whose decode time per token changes by up to ±``JITTER`` from call to call (seeded)."""

    JITTER = 0.4

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rng = random.Random(7)
        self._base = self.per_token_s

    def serve(self, requests, **kwargs):
        out = []
        for r in requests:
            self.per_token_s = self._base * (1 + self._rng.uniform(-self.JITTER, self.JITTER))
            out += super().serve([r], **kwargs)
        return out


class WallClockEngine(FakeEngine):
    """A fake engine that does real CPU work per token and reads the real clock, so other
    processes on the machine slow it down as they would a model."""

    SPIN_S = 0.0005  # CPU time per token on a quiet core

    def serve(self, requests, *, max_new_tokens=None, seed=0, sync=None):
        from fractal_opt.engine.protocol import Generation

        out = []
        for request in requests:
            prompt = self.encode(" ".join(text for _, text in request.messages))
            t_submit = time.perf_counter()
            times = []
            for _ in range(self.budget(max_new_tokens)):
                end = time.process_time() + self.SPIN_S  # CPU time: a preempted token takes longer on the wall clock
                while time.process_time() < end:
                    pass
                times.append(time.perf_counter())
            tokens = [(len(prompt) + i) % self.vocab_size for i in range(len(times))]
            self.served += 1
            out.append(Generation(request_id=request.id, text=" ".join(map(str, tokens)), token_ids=tokens, prompt_tokens=len(prompt),
                                  t_submit=t_submit, t_prefill_start=t_submit, token_times=times, hit_cap=True, t_done=times[-1]))
        return out


def _measurer(workload: Workload, *, busy_reading: BusySnapshot = QUIET, notes: list[str] | None = None, **kwargs) -> StepMeasurer:
    return StepMeasurer(machine=cpu_machine(), workload=workload, requests=workload.requests(), min_effect=0.05, limits=LIMITS,
                        busy=lambda: busy_reading, note=(notes.append if notes is not None else None), **kwargs)


@pytest.mark.integration  # starts CPU-burner processes
def test_snapshot_sees_other_processes_and_not_this_one():
    """Spinning processes make the machine busy; this process's own spinning thread is not counted."""
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    own = threading.Thread(target=spin, daemon=True)
    own.start()
    procs = _burners()
    try:
        time.sleep(1.0)  # the burners start spinning (a Python start-up on a loaded machine)
        s = snapshot(interval_s=1.0)
    finally:
        stop.set()
        _stop(procs)
    assert s.busy and s.others_cores >= busy.BUSY_SHARE * s.cores, s
    assert set(procs) & {p["pid"] for p in s.processes}, s  # the burners are named
    assert os.getpid() not in {p["pid"] for p in s.processes}
    assert "load average" in s.describe() and f"on {s.cores} cores" in s.describe()
    assert s.to_dict()["busy"] is True and "text" in s.to_dict()


def test_wait_quiet_waits_until_the_others_leave_and_stops_at_the_cap():
    """--wait-quiet polls until the others' CPU use falls below QUIET_SHARE, or gives up at the cap, saying so."""
    readings = iter([BusySnapshot(None, 2, 1.8), BusySnapshot(None, 2, 1.2), BusySnapshot(None, 2, 0.1)])
    said: list[str] = []
    last = wait_quiet(max_wait_s=60, progress=said.append, sample=lambda: next(readings))
    assert last.others_cores == 0.1 and len(said) == 3
    assert said[0].startswith("waiting for the machine to be quiet") and said[-1].startswith("machine quiet")
    said.clear()
    last = wait_quiet(max_wait_s=0, progress=said.append, sample=lambda: BusySnapshot(None, 2, 1.9))
    assert last.others_cores == 1.9 and said == [said[0]] and said[0].startswith("still busy after")


def test_calibration_grows_rounds_then_reports_the_machine_busy():
    """A/A intervals wider than min_effect add rounds up to the cap; still too wide, the record, the note and the report say so."""
    wl = Workload(suite="default", limit=2, max_new_tokens=4, repeats=2, warmup=0)
    engine = JitteryEngine.factory()(Plan(source="fake"))
    loaded = BusySnapshot(load_average=(5.1, 4.8, 3.9), cores=2, others_cores=1.7, processes=[{"pid": 4121, "name": "python", "cpu": 0.98}])
    notes: list[str] = []
    _, record = _measurer(wl, busy_reading=loaded, notes=notes).calibrate(engine, "baseline", watch=["decode_tokens_per_s"])
    assert record["rounds"] == record["max_rounds"] == calibration_rounds(wl) == CALIBRATION_MAX_ROUNDS
    assert record["resolves"] is False and record["resolution"]["decode_tokens_per_s"] > 0.05
    low, high = record["intervals"]["decode_tokens_per_s"]
    change = record["decode_tokens_per_s"]
    assert record["resolution"]["decode_tokens_per_s"] == pytest.approx(max(high - change, change - low), abs=1e-3)  # the interval's half-width
    assert record["busy"]["load_average"] == [5.1, 4.8, 3.9] or record["busy"]["load_average"] == (5.1, 4.8, 3.9)
    shown = f"{record['resolution']['decode_tokens_per_s']:.0%}"
    assert len(notes) == 1 and notes[0].startswith(f"this machine is busy: verdicts can only see changes above {shown}")
    assert "load average 5.10 / 4.80 / 3.90 on 2 cores" in notes[0] and "python (pid 4121, 98%)" in notes[0]
    lines = calibration_lines(json.loads(json.dumps(record)))  # as read back from trace.json
    assert lines[0].startswith(f"**This machine is busy: verdicts can only see changes above {shown}") and "python (pid 4121" in lines[0]


def test_calibration_that_resolves_min_effect_stops_at_repeats_and_does_not_warn():
    """A steady engine: the A/A band is within min_effect after `repeats` rounds, no round is added and nothing warns."""
    wl = Workload(suite="default", limit=2, max_new_tokens=4, repeats=2, warmup=0)
    notes: list[str] = []
    _, record = _measurer(wl, notes=notes).calibrate(FakeEngine.factory()(Plan(source="fake")), "baseline")
    assert record["rounds"] == 2 and record["resolves"] is True and notes == []
    assert busy_warning(record) is None and "It resolves changes of 5%" in calibration_lines(record)[0]
    # The workload's own max_repeats is the cap when it sets one.
    assert calibration_rounds(Workload(repeats=3, max_repeats=4)) == 4 and calibration_rounds(Workload(repeats=8)) == 8


def test_wait_quiet_runs_before_the_calibration(monkeypatch):
    """StepMeasurer(wait_quiet_s=...) waits (with progress) before the first calibration round."""
    from fractal_opt.pipeline import step_measurement

    calls = []
    monkeypatch.setattr(step_measurement, "wait_quiet", lambda **kw: calls.append(kw["max_wait_s"]) or QUIET)
    wl = Workload(suite="default", limit=1, max_new_tokens=2, repeats=1, warmup=0)
    _measurer(wl, wait_quiet_s=30).calibrate(FakeEngine.factory()(Plan(source="fake")), "baseline")
    assert calls == [30]


@pytest.mark.integration  # starts CPU-burner processes
def test_calibration_next_to_a_cpu_burner_warns_in_the_report(tmp_path, mixed_suite, monkeypatch):
    """A run whose calibration shares the CPU with spinning processes says in
    report.md that the machine was busy, with the load and the processes seen at the start.

    The engine's timings come from the real clock (real CPU work per token), so the burners widen its
    A/A band as they would a model's; with min_effect 0.1% the 2-round band cannot resolve it
    (1% was too coarse: the scheduler can share the cores so evenly that one clean-clone CI run
    read a 0.28% band next to the burners)."""
    from fractal_opt.language.recipe import parse_recipe
    from fractal_opt.pipeline import step_measurement
    from fractal_opt.pipeline.runner import Pipeline

    monkeypatch.setattr(step_measurement, "snapshot", snapshot)  # the real 1 s reading (conftest shortens it for every other run)
    data = small_recipe_dict("fake", policy={"min_effect": 0.001}, suite=str(mixed_suite), max_new_tokens=16, repeats=2, max_repeats=3)
    recipe = parse_recipe(data, where="test", check_model=False)  # the fake engine loads no model

    procs = _burners()
    try:
        time.sleep(1.0)
        Pipeline(recipe, out_dir=tmp_path / "out", progress=False, machine=cpu_machine(), build=WallClockEngine.factory(), refuse=FakeEngine.refuse,
                 limits=LIMITS).run()
    finally:
        _stop(procs)
    calibration = json.loads((tmp_path / "out" / "trace.json").read_text())["calibration"]
    assert calibration["busy"]["busy"] is True
    report = (tmp_path / "out" / "report.md").read_text()
    assert calibration["resolves"] is False, calibration["resolution"]
    assert "**This machine is busy: verdicts can only see changes above" in report and "At the start: load average" in report
    # The warning sits above the step table.
    assert report.index("This machine is busy") < report.index("| layer | pass |")


def test_a_wide_band_on_a_quiet_machine_is_called_noisy_not_busy():
    """No other work seen at the start: the warning blames the measurement, not the machine, and says what narrows it."""
    record = {"resolves": False, "resolution": {"e2e_ms": 0.12}, "rounds": 6, "min_effect": 0.05,
              "busy": {"busy": False, "text": "load average 0.10 / 0.10 / 0.10 on 2 cores; other processes using 0.0 cores"}}
    text = busy_warning(record)
    assert text.startswith("The measurement is noisy: verdicts can only see changes above 12%") and "workload.max_repeats" in text


def test_run_command_passes_wait_quiet_and_prints_the_warning(monkeypatch, capsys, tmp_path):
    """`fractal-opt run R --wait-quiet 30` hands 30 s to the pipeline; the busy warning is printed under the answer."""
    import argparse
    import types

    from fractal_opt.cli import run as run_cli
    from fractal_opt.pipeline import runner
    from fractal_opt.report.trace import Trace
    from fractal_opt.tower.plan import Plan

    seen = {}
    calibration = {"resolves": False, "resolution": {"decode_tokens_per_s": 0.7}, "rounds": 6, "min_effect": 0.05, "busy": {"busy": True, "text": "load 5"}}
    trace = Trace(recipe={"name": "r"}, calibration=calibration)

    class Recorded:
        """Stands in for the Pipeline the command builds: records its arguments, runs nothing."""

        def __init__(self, recipe, **kw):
            seen.update(kw)

        def run(self):
            return runner.Result(plan=Plan(source="fake"), trace=trace, recipe=None)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "Pipeline", Recorded)
    monkeypatch.setattr(runner, "optimize", lambda recipe, **kw: Recorded(recipe, **kw).run())
    parser = argparse.ArgumentParser()
    run_cli.add(parser.add_subparsers())
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: fake\n", encoding="utf-8")
    args = parser.parse_args(["run", str(recipe), "--wait-quiet", "30", "--quiet"])
    args.func(args)
    assert seen["wait_quiet"] == 30.0
    assert "This machine is busy: verdicts can only see changes above 70%" in capsys.readouterr().out
