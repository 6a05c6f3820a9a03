"""The child-server machinery shared by the vLLM and llama-server transports: which processes count
as the server (their memory and CPU time are the engine's in a measurement)."""

from __future__ import annotations

import sys
import time

from fractal_opt.measure.isolation import tree_cpu_s
from fractal_opt.runtimes.child_process import ServerProcess, free_port

# A "server" that spawns a worker, as vllm serve spawns its engine core, and burns a little CPU.
_PARENT = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           "t = time.process_time(); [0 for _ in iter(lambda: time.process_time() - t > 0.2, True)]; time.sleep(60)")


def test_the_server_counts_with_the_processes_it_spawned_each_once() -> None:
    proc = ServerProcess([sys.executable, "-c", _PARENT], env={}, port=free_port(), log_prefix="fractal-opt-test-")
    try:
        deadline = time.monotonic() + 20
        while len(proc.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = proc.pids()
        assert pids[0] == proc.pid and len(pids) == 2, pids
        while tree_cpu_s([proc.pid]) < 0.2 and time.monotonic() < deadline:  # the parent's busy loop
            time.sleep(0.05)
        alone = tree_cpu_s([proc.pid])
        assert alone >= 0.2
        # The child is listed and reached from its parent too: its time is not added twice.
        assert abs(tree_cpu_s(pids) - alone) < 0.1 * alone + 0.05
    finally:
        proc.stop(grace_s=2.0)
    assert proc.pids() == []


def _gone(pid: int) -> bool:
    """Ended (a zombie, ended but not yet reaped by an init that does not reap, counts as gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# A parent that starts a server child (which spawns a worker of its own) and then waits to be killed.
_OWNER = (
    "import json, sys, time\n"
    "from fractal_opt.runtimes.child_process import ServerProcess, free_port\n"
    "proc = ServerProcess([sys.executable, '-c', sys.argv[1]], env={}, port=free_port())\n"
    "deadline = time.monotonic() + 20\n"
    "while len(proc.pids()) < 2 and time.monotonic() < deadline: time.sleep(0.02)\n"
    "print(json.dumps(proc.pids()), flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_sigkilled_parent_leaves_no_server_child() -> None:
    """kill -9 of the process that started a server: the server and the worker it spawned are gone within 3 s."""
    import json
    import os
    import signal
    import subprocess

    owner = subprocess.Popen([sys.executable, "-c", _OWNER, _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(owner.stdout.readline())
        assert len(pids) == 2 and not any(_gone(p) for p in pids), pids
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(5)
        t = time.monotonic()
        while not all(_gone(p) for p in pids) and time.monotonic() - t < 3.0:
            time.sleep(0.02)
        assert all(_gone(p) for p in pids), f"still running 3 s after the parent's SIGKILL: {[p for p in pids if not _gone(p)]}"
    finally:
        owner.kill()


def _dying(marker: str, after_s: float, code: int) -> ServerProcess:
    proc = ServerProcess([sys.executable, "-c", f"import sys, time; print({marker!r}, flush=True); time.sleep({after_s}); sys.exit({code})"],
                         env={}, port=free_port(), log_prefix="fractal-opt-test-")
    proc.ready = True
    return proc


def test_a_dead_child_is_restarted_with_its_log_in_the_server_log(caplog) -> None:
    """A child that exits on its own is started again after a backoff; meanwhile health() says
    so; its last log lines go to the log, not into health()'s message."""
    import logging

    from fractal_opt.runtimes.child_process import Supervised

    starts: list[ServerProcess] = []

    def start() -> ServerProcess:
        starts.append(_dying("first child's last words", 0.2, 9) if not starts else _dying("second", 60, 0))
        return starts[-1]

    with caplog.at_level(logging.INFO, logger="fractal_opt.runtimes"):
        sup = Supervised(start, name="fake-server", backoff_s=0.5)
        try:
            t = time.monotonic()
            while sup.exited is None and time.monotonic() - t < 10:
                time.sleep(0.01)
            problem = sup.health()
            assert problem is not None and "exited with status 9" in problem and "last words" not in problem
            while len(starts) < 2 and time.monotonic() - t < 10:
                time.sleep(0.01)
            while sup.health() is not None and time.monotonic() - t < 10:
                time.sleep(0.01)
            assert sup.health() is None and sup.process is starts[1] and sup.process.alive()
        finally:
            sup.stop()
    assert "first child's last words" in caplog.text
    assert not starts[1].alive()


def test_a_child_that_keeps_dying_is_given_up_after_bounded_tries() -> None:
    """Three restarts, waits doubling between them; then health() raises: the server will not serve again."""
    import pytest

    from fractal_opt.core.errors import EngineError
    from fractal_opt.runtimes.child_process import Supervised

    starts: list[float] = []

    def start() -> ServerProcess:
        starts.append(time.monotonic())
        return _dying("again", 0.05, 3)

    sup = Supervised(start, name="fake-server", restarts=3, backoff_s=0.1)
    try:
        t = time.monotonic()
        while sup.failed is None and time.monotonic() - t < 15:
            time.sleep(0.02)
        with pytest.raises(EngineError, match="did not start again after 3 tries"):
            sup.health()
    finally:
        sup.stop()
    assert len(starts) == 4  # the first start and three restarts, no more
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[2] > gaps[0] + 0.2, f"no backoff between restarts: {gaps}"
