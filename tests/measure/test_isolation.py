"""One engine computes at a time: live child servers stopped during a round, the round's CPU account, re-runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from fractal_opt.measure.isolation import CpuAccount, add_live_group, contended, discard_live_group, live_groups, others_quiet, tree_cpu_s
from fractal_opt.measure.runner import MAX_RERUNS, Runner
from fractal_opt.runtimes.child_process import ServerProcess
from fractal_opt.testing import FakeEngine
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Workload

SPIN = [sys.executable, "-c", "while True: pass"]
WORKLOAD = Workload(suite="default", limit=1, max_new_tokens=2, repeats=1, warmup=0)
ENGINE_CPU_S = 0.4  # CPU seconds the spinning engine burns per round: 40 accounting ticks, so 5% of it is 2 ticks


class SpinningEngine(FakeEngine):
    """A FakeEngine that computes: each serve burns ENGINE_CPU_S of this process's CPU time, and
    records the status of the ``watched`` processes while it does."""

    watched: list[int]
    seen: list[str]

    def serve(self, requests, **kwargs):  # type: ignore[override]
        self.seen.extend(_wait_stopped(pid, True) for pid in self.watched)
        until = time.process_time() + ENGINE_CPU_S
        while time.process_time() < until:
            pass
        return super().serve(requests, **kwargs)


def _engine(watched: tuple[int, ...] = ()) -> SpinningEngine:
    engine = SpinningEngine.factory()(Plan(source="fake"))
    assert isinstance(engine, SpinningEngine)
    engine.watched, engine.seen = list(watched), []
    return engine


def _wait_stopped(pid: int, stopped: bool) -> str:
    """The process's status once it is (or is no longer) stopped, or after a second: a signal is
    acted on only when the process next runs, which on a loaded machine can take a moment."""
    deadline = time.monotonic() + 1.0
    while (psutil.Process(pid).status() == psutil.STATUS_STOPPED) != stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    return psutil.Process(pid).status()


def _runs_again(pid: int, *, cpu_s: float, within_s: float = 10.0) -> bool:
    """True once ``pid``'s tree used ``cpu_s`` more CPU seconds (waiting: on a loaded machine a
    niced process gets the cores late)."""
    start, deadline = tree_cpu_s([pid]), time.monotonic() + within_s
    while time.monotonic() < deadline:
        if tree_cpu_s([pid]) - start > cpu_s:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def child_server() -> Iterator[ServerProcess]:
    """A spinning child started as a server child (so registered as a live child server)."""
    child = ServerProcess(SPIN, env={}, port=0, log_prefix="fractal-opt-test-spin-")
    time.sleep(0.5)  # its watchdog's interpreter has started and gone idle: not part of the rounds below
    yield child
    child.stop(grace_s=2.0)


@pytest.fixture
def unregistered_spinner() -> Iterator[subprocess.Popen]:
    """A spinning process of this run that no registry knows: nothing can stop it."""
    proc = subprocess.Popen(SPIN, start_new_session=True)
    yield proc
    proc.kill()
    proc.wait(5)


def test_a_live_child_server_is_stopped_during_a_round_and_runs_again_after(child_server: ServerProcess) -> None:
    """A busy child server of the run is stopped while another engine's round runs (under 5% of the
    engine's CPU time), the round is not re-run, and the child computes again afterwards."""
    assert child_server.pid in live_groups()
    engine = _engine((child_server.pid,))
    runner = Runner(engine, WORKLOAD, WORKLOAD.requests())
    before = tree_cpu_s([child_server.pid])
    runner.round()
    during = tree_cpu_s([child_server.pid]) - before
    row = runner.repeats[0]
    assert engine.seen == [psutil.STATUS_STOPPED]
    assert row["contention"]["engine_cpu_s"] >= ENGINE_CPU_S - 0.02  # os.times counts in 10 ms ticks: a tick or two either way
    assert during < 0.05 * row["contention"]["engine_cpu_s"]
    assert row["contention"]["run_others_cpu_s"] < 0.05 * row["contention"]["engine_cpu_s"]
    assert "reruns" not in row and "contended" not in row and engine.served == 1
    assert _runs_again(child_server.pid, cpu_s=0.05)


def test_a_busy_process_of_the_run_that_cannot_be_stopped_reruns_the_round_and_is_flagged(unregistered_spinner: subprocess.Popen) -> None:
    """An unstoppable busy process of the run takes more than 5% of the engine's CPU time: the
    round is served again MAX_RERUNS times, then kept as one row flagged contended."""
    engine = _engine()
    runner = Runner(engine, WORKLOAD, WORKLOAD.requests())
    forgotten: list[int] = []
    runner.source.forget_round = lambda: forgotten.append(1)  # type: ignore[attr-defined]  # a source keeping per-round state
    time.sleep(0.2)  # it spins before the round starts
    runner.round()
    row = runner.repeats[0]
    assert MAX_RERUNS == 2
    assert row["reruns"] == 2 and row["contended"] is True
    assert engine.served == 3 and len(runner.repeats) == 1 and len(runner.samples) == 1  # the discarded tries leave no samples
    assert len(forgotten) == 2 and len(row["rerun_contention"]) == 2  # each discarded try is forgotten by the source, its account kept
    c = row["contention"]
    assert c["run_others_cpu_s"] > 0.05 * c["engine_cpu_s"]
    assert c["share"] == pytest.approx(c["run_others_cpu_s"] / c["engine_cpu_s"], abs=1e-3)
    assert c["outside_cpu_s"] >= 0.0


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_stopped_groups_are_continued_when_the_round_raises(unregistered_spinner: subprocess.Popen, error: type[BaseException]) -> None:
    """A registered group stopped for a round is continued when the round raises or is interrupted."""
    pid = unregistered_spinner.pid
    add_live_group(pid)
    try:
        with pytest.raises(error), others_quiet([]) as stopped:
            assert stopped == [pid]
            assert _wait_stopped(pid, True) == psutil.STATUS_STOPPED
            raise error("the round failed")
        assert _wait_stopped(pid, False) != psutil.STATUS_STOPPED
    finally:
        discard_live_group(pid)


def test_the_measured_engines_own_group_and_this_process_are_never_stopped(unregistered_spinner: subprocess.Popen) -> None:
    """keep_pids' groups (the measured engine's servers) run on; this process's own group is never signalled."""
    pid = unregistered_spinner.pid
    add_live_group(pid)
    add_live_group(os.getpgrp())
    try:
        with others_quiet([pid]) as stopped:
            assert stopped == []
            assert _wait_stopped(pid, True) != psutil.STATUS_STOPPED  # waited a second for a stop that never comes
    finally:
        discard_live_group(pid)
        discard_live_group(os.getpgrp())


def test_a_stopped_child_server_still_stops_promptly_and_leaves_the_registry() -> None:
    """ServerProcess.stop() of a group a round left stopped ends it at once (SIGCONT after SIGTERM),
    not after the SIGKILL grace, and no later round signals it."""
    child = ServerProcess(SPIN, env={}, port=0, log_prefix="fractal-opt-test-spin-")
    os.killpg(child.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    child.stop(grace_s=10.0)
    assert time.monotonic() - t0 < 5.0
    assert child.proc.returncode == -signal.SIGTERM
    assert child.pid not in live_groups()


def test_a_helper_process_that_ran_and_ended_within_the_round_is_counted_as_the_runs_other() -> None:
    """A child that started, burned 0.2 s of CPU and was waited for during the round counts as the run's other."""
    burn = "import time\nuntil = time.process_time() + 0.2\nwhile time.process_time() < until: pass"
    with CpuAccount([]) as account:
        subprocess.run([sys.executable, "-c", burn], check=True)
    c = account.result()
    assert c["run_others_cpu_s"] >= 0.18  # 0.2 s, give or take the 10 ms ticks
    assert c["engine_cpu_s"] < c["run_others_cpu_s"]


@pytest.mark.parametrize(("engine_s", "others_s", "verdict"), [(1.0, 0.05, False), (1.0, 0.051, True), (0.0, 0.009, False), (0.0, 0.02, True)])
def test_a_round_is_contended_above_5_percent_of_the_engine_and_one_tick(engine_s: float, others_s: float, verdict: bool) -> None:
    """More than 5% of the engine's CPU time is contention; under one 10 ms accounting tick never is."""
    assert contended({"engine_cpu_s": engine_s, "run_others_cpu_s": others_s}) is verdict


# ---------------------------------------------------------------------------------- integration


@pytest.mark.integration  # two llama.cpp servers on the embedded model (~20 s)
def test_a_second_resident_llama_cpp_engine_is_quiet_during_a_round() -> None:
    """Two llama.cpp engines resident, the second a native llama-server child kept busy by a
    client: during the first engine's round it uses < 5% of the measured engine's CPU time, and
    it computes again after the round."""
    from fractal_opt.core.errors import ModelSourceError
    from fractal_opt.runtimes.llama_cpp import engine as llama_engine
    from fractal_opt.runtimes.llama_cpp.process import NATIVE, executable_problem
    from fractal_opt.tower.plan import HardwarePlan

    if (problem := executable_problem(NATIVE)) is not None:
        pytest.skip(problem)
    try:
        from fractal_opt.weights.models import resolve

        resolve("smollm2-135m-instruct")
    except ModelSourceError as e:
        pytest.skip(f"embedded model not installed: {e}")
    llama_engine.clear_cache()
    native = llama_engine.LlamaCppEngine.build(Plan(source="smollm2-135m-instruct", hardware=HardwarePlan(runtime="llama_cpp", threads=1, runtime_path=NATIVE)),
                                               progress=lambda _: None, max_new_tokens=16)
    other = native.model.server()  # held: it stays resident next to the engine measured (the case the isolation exists for)
    measured = llama_engine.LlamaCppEngine.build(Plan(source="smollm2-135m-instruct", hardware=HardwarePlan(runtime="llama_cpp", threads=1)),
                                                 progress=lambda _: None, max_new_tokens=16)
    busy = threading.Event()
    busy.set()

    def keep_busy() -> None:
        while busy.is_set():
            try:
                other.handle_completions({"prompt": "Count to one hundred:", "max_tokens": 64, "temperature": 0.0, "stream": False})
            except Exception:  # noqa: BLE001 - the load only has to keep it computing
                time.sleep(0.05)

    client = threading.Thread(target=keep_busy, daemon=True)
    client.start()
    try:
        time.sleep(1.0)
        workload = Workload(suite="default", limit=2, max_new_tokens=16, repeats=1, warmup=0)
        runner = Runner(measured, workload, workload.requests())
        runner.round()
        row = runner.repeats[0]
        assert row["contention"]["engine_cpu_s"] > 0.1
        assert row["contention"]["run_others_cpu_s"] < 0.05 * row["contention"]["engine_cpu_s"]
        assert "reruns" not in row
        assert _runs_again(other.pid, cpu_s=0.2)  # it computes again once the round is over
    finally:
        busy.clear()
        client.join(30)
        other.stop()
        llama_engine.clear_cache()
