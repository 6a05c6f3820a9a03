"""The child-server machinery shared by the vLLM and llama-server transports: which processes count
as the server (their memory and CPU time are the engine's in a measurement)."""

from __future__ import annotations

import sys
import time

from fractal_opt.measure.runner import _cpu_s
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
        while _cpu_s([proc.pid]) < 0.2 and time.monotonic() < deadline:  # the parent's busy loop
            time.sleep(0.05)
        alone = _cpu_s([proc.pid])
        assert alone >= 0.2
        # The child is listed and reached from its parent too: its time is not added twice.
        assert abs(_cpu_s(pids) - alone) < 0.1 * alone + 0.05
    finally:
        proc.stop(grace_s=2.0)
    assert proc.pids() == []
