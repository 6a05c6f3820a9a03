"""A server runtime as a child process that never outlives the engine: vLLM's ``vllm serve``, llama.cpp's ``llama-server``.

The child runs in its own process group (vLLM's engine core and workers are grandchildren), so
stopping it signals the whole group: SIGTERM, then SIGKILL after a grace period. An ``atexit``
hook stops any child still running when Python exits, including one whose engine was dropped
without ``close()``. Its output goes to a temporary log file, kept when it failed to start (its
last lines explain why) and deleted after a clean stop.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import EngineError

__all__ = ["ServerProcess", "free_port"]

_STOP_GRACE_S = 20.0  # vLLM's engine core shuts down in ~3 s on SIGTERM; then SIGKILL the group
_GROUP_EXIT_S = 5.0  # how long stop() waits for SIGKILLed workers to be gone
# Every started child until stop(): strong references, so a child whose engine was dropped
# without close() is still stopped by the atexit hook (a weak set would lose it with the object).
_LIVE: set[ServerProcess] = set()


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server child on 127.0.0.1; :meth:`stop` ends it and every process it spawned.

    Args:
        command: the full command line (the executable, the model, the flags).
        env: variables set over this process's environment.
        port: the port it listens on (part of ``command``).
        log_prefix: the temporary log file's name starts with it.
    """

    def __init__(self, command: list[str], *, env: dict[str, str], port: int, log_prefix: str = "fractal-opt-server-"):
        self.command = command
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])
        self.ready = False  # set once it served: stop() then deletes the log (a failed start keeps it to read)
        self._log = self.log_path.open("wb")
        try:
            # start_new_session: the server leads its own process group, so stop() reaches its
            # engine core and workers too, and a Ctrl-C in the caller's terminal is not sent to it twice.
            self.proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            self._log.close()
            raise EngineError(f"could not start {command[0]!r}: {e}") from e
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def pids(self) -> list[int]:
        """The child and every live process it spawned (vLLM's engine core and workers serve in
        grandchildren); empty once it has ended."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid, *(p.pid for p in root.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE)]
        except psutil.Error:
            return []

    def log_tail(self, lines: int = 30) -> str:
        """The last lines the server printed (its errors explain a failed start)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, *, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM the server's process group, wait up to ``grace_s``, then SIGKILL it. Idempotent."""
        if self.proc.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(10)
        # Workers that outlived their parent would still be in the group: end them too, and wait
        # until the kernel has taken them down (a signal is delivered asynchronously).
        self._signal(signal.SIGKILL)
        deadline = time.monotonic() + _GROUP_EXIT_S
        while _group_running(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        _LIVE.discard(self)
        if not self._log.closed:
            self._log.close()
        if self.ready:
            self.log_path.unlink(missing_ok=True)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _group_running(pgid: int) -> bool:
    """True while a process of group ``pgid`` still runs (zombies count as ended: in a container
    whose init does not reap, they stay listed but hold nothing). Linux /proc; False elsewhere."""
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        # After the command name: state, ppid, pgrp (proc(5)).
        if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop(grace_s=5.0)
