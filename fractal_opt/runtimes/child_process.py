"""A server runtime as a child process that never outlives the engine: vLLM's ``vllm serve``, llama.cpp's ``llama-server``.

The child runs in its own process group (vLLM's engine core and workers are grandchildren), so
stopping it signals the whole group: SIGTERM, then SIGKILL after a grace period. An ``atexit``
hook stops any child still running when Python exits, including one whose engine was dropped
without ``close()``. Its output goes to a temporary log file, kept when it failed to start (its
last lines explain why) and deleted after a clean stop. Each live child's group is registered with
:mod:`fractal_opt.measure.isolation`, which stops it (SIGSTOP, then SIGCONT) while another
engine's timed round runs, so one engine computes at a time.

A parent killed with SIGKILL runs no code, so neither of those can help then. Each child has a
watchdog: a small Python process, outside the parent's process group, holding the read end of a
pipe whose write end only the parent holds. When the parent dies, by any signal, the kernel
closes the pipe, the watchdog reads end-of-file and SIGKILLs the child's whole group (measured: within
10 ms). A clean :meth:`ServerProcess.stop` writes ``stopped`` first, so the watchdog
leaves without a signal. Why not ``PR_SET_PDEATHSIG``: Linux fires it when the *thread* that
forked the child ends, and children here are started from measurement threads that end after
each round; it also reaches the child alone, not vLLM's grandchildren.

:class:`Supervised` starts a child again when it dies on its own (bounded tries, growing waits);
once they are spent it stays down and says so, so ``fractal-opt serve`` can exit for a
supervisor to restart it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..core.errors import EngineError
from ..measure.isolation import add_live_group, discard_live_group

__all__ = ["ServerProcess", "Supervised", "free_port"]

log = logging.getLogger("fractal_opt.runtimes")

_STOP_GRACE_S = 20.0  # vLLM's engine core shuts down in ~3 s on SIGTERM; then SIGKILL the group
_GROUP_EXIT_S = 5.0  # how long stop() waits for SIGKILLed workers to be gone
# Every started child until stop(): strong references, so a child whose engine was dropped
# without close() is still stopped by the atexit hook (a weak set would lose it with the object).
_LIVE: set[ServerProcess] = set()
_EXITING = threading.Event()  # set when Python exits: children stopped then are not restarted
# The watchdog (see the module's note): reads until end-of-file; anything but "stopped" means the
# parent died without stopping the child, so the child's group is killed. SIGINT / SIGTERM are
# ignored: a Ctrl-C or a kill of the parent's group must not take the watchdog before the child.
_WATCHDOG = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if sys.stdin.buffer.read() != b'stopped':\n"
    "    try: os.killpg(int(sys.argv[1]), signal.SIGKILL)\n"
    "    except OSError: pass\n"
)


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
        self.started = time.monotonic()
        _LIVE.add(self)
        add_live_group(self.proc.pid)  # other engines' timed rounds stop this group while they run (measure.isolation)
        self._watchdog = _watch(self.proc.pid)

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
        discard_live_group(self.proc.pid)  # first: no round stops a group on its way out
        if self.proc.returncode is None:
            self._signal(signal.SIGTERM)
            self._signal(signal.SIGCONT)  # a group stopped by a round (measure.isolation) acts on the SIGTERM only once continued
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
        _release(self._watchdog)
        if not self._log.closed:
            self._log.close()
        if self.ready:
            self.log_path.unlink(missing_ok=True)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Supervised:
    """A server child started again when it dies on its own, at most ``restarts`` times in a row
    (waiting ``backoff_s``, then twice that, ...; a child that served ``stable_s`` since its start
    resets the count). Then it stays down: :meth:`health` raises, so the caller can exit for a
    supervisor (systemd, Kubernetes) to start it afresh. The child's last log lines go to this
    process's log (``fractal_opt.runtimes``), never into a client's error message.

    Args:
        start: starts a child and returns it once it serves (raises EngineError when it cannot);
            called once now (its error propagates: nothing restarts what never started) and for each restart.
        name: the server's name in messages ("llama-server").
    """

    def __init__(self, start: Callable[[], ServerProcess], *, name: str, restarts: int = 3, backoff_s: float = 1.0, stable_s: float = 60.0):
        self.name, self.max_restarts, self.backoff_s, self.stable_s = name, restarts, backoff_s, stable_s
        self._start = start
        self.process = start()
        self.restarts = 0  # restarts since the child last served stable_s
        self.exited: int | None = None  # the exit status of the child being replaced now (None: none is)
        self.failed: str | None = None  # set once the restarts are spent
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"fractal-opt-{name}-supervisor", daemon=True)
        self._thread.start()

    def health(self) -> str | None:
        """Why the server cannot answer now (its child is being restarted), or None.

        Raises:
            EngineError: the restarts are spent; it will not serve again.
        """
        if self.failed is not None:
            raise EngineError(self.failed)
        if self.exited is not None or not self.process.alive():
            return f"{self.name} exited with status {self.exited if self.exited is not None else self.process.proc.poll()}; restarting it ({self.restarts} of {self.max_restarts})"
        return None

    def stop(self) -> None:
        """Stop the child and the supervision (idempotent)."""
        self._stopping.set()
        self.process.stop(grace_s=5.0)
        if threading.current_thread() is not self._thread:
            self._thread.join(10.0)

    def _watch(self) -> None:
        while not self._stopping.is_set():
            child = self.process
            status = child.proc.wait()
            if self._stopping.is_set() or _EXITING.is_set():
                return
            self.exited = status
            log.error("%s (pid %d) exited with status %s after %.0f s; its log (%s) ends:\n%s", self.name, child.pid, status,
                      time.monotonic() - child.started, child.log_path, child.log_tail())
            child.ready = False  # keep its log for reading
            child.stop(grace_s=1.0)
            if time.monotonic() - child.started >= self.stable_s:
                self.restarts = 0
            if not self._restart():
                return
            self.exited = None

    def _restart(self) -> bool:
        """Start the child again within the bounds; False (and ``failed`` set) when they are spent or on stop."""
        while self.restarts < self.max_restarts:
            if self._stopping.wait(self.backoff_s * 2**self.restarts):
                return False
            self.restarts += 1
            try:
                child = self._start()
            except EngineError as e:
                log.error("restarting %s (try %d of %d) failed: %s", self.name, self.restarts, self.max_restarts, e)
                continue
            self.process = child
            if self._stopping.is_set():  # stop() ran while it started: it stopped the old one only
                child.stop(grace_s=5.0)
                return False
            log.warning("%s restarted (try %d of %d), pid %d", self.name, self.restarts, self.max_restarts, self.process.pid)
            return True
        self.failed = f"{self.name} exited with status {self.exited} and did not start again after {self.max_restarts} tries; it will not serve"
        log.error("%s", self.failed)
        return False


def _watch(pgid: int) -> subprocess.Popen | None:
    """Start the watchdog of the child group ``pgid`` (None where it cannot start: the child still
    stops with its engine and at exit, only a SIGKILLed parent would leave it)."""
    try:
        return subprocess.Popen([sys.executable, "-I", "-c", _WATCHDOG, str(pgid)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        log.warning("no watchdog for server process group %d (%s): a SIGKILL of this process would leave it running", pgid, e)
        return None


def _release(watchdog: subprocess.Popen | None) -> None:
    """Tell a watchdog its child was stopped on purpose, and reap it."""
    if watchdog is None or watchdog.stdin is None or watchdog.stdin.closed:
        return
    try:
        watchdog.stdin.write(b"stopped")
        watchdog.stdin.close()
        watchdog.wait(5.0)
    except (OSError, subprocess.TimeoutExpired):
        watchdog.kill()


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
    _EXITING.set()  # no Supervised restarts what is stopped here
    for proc in list(_LIVE):
        proc.stop(grace_s=5.0)
