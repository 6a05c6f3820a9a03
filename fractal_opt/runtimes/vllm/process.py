"""Finding vLLM and running ``vllm serve`` as a child process that never outlives the engine.

vLLM pins its own torch and transformers, so it runs from its own environment
(``scripts/setup-vllm.sh`` creates ``.venv-vllm``) and fractal_opt only talks to it over HTTP.
Where it is found, first match wins:

1. ``plan.hardware.runtime_url`` / ``$FRACTAL_OPT_VLLM_URL``: a server already running; nothing
   is started and :meth:`VllmProcess.stop` leaves it alone.
2. ``plan.hardware.runtime_path`` / ``$FRACTAL_OPT_VLLM``: the ``vllm`` executable to launch.
3. ``.venv-vllm/bin/vllm`` in the repository (what ``scripts/setup-vllm.sh`` makes).

The server runs in its own process group (its engine core and workers are grandchildren), so
stopping it signals the whole group: SIGTERM, then SIGKILL after a grace period. An ``atexit``
hook stops any server still running when Python exits, including one whose engine was
dropped without ``close()``.
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

from ...errors import EngineError

__all__ = ["ENV_PATH", "ENV_URL", "VllmProcess", "default_executable", "find_executable", "find_url", "free_port", "unavailable", "wait_started"]

ENV_PATH = "FRACTAL_OPT_VLLM"
ENV_URL = "FRACTAL_OPT_VLLM_URL"
_REPO = Path(__file__).resolve().parents[3]
_STOP_GRACE_S = 20.0  # vLLM's engine core shuts down in ~3 s on SIGTERM; then SIGKILL the group
_GROUP_EXIT_S = 5.0  # how long stop() waits for SIGKILLed workers to be gone
# Every started server until stop(): strong references, so a server whose engine was dropped
# without close() is still stopped by the atexit hook (a weak set would lose it with the object).
_LIVE: set[VllmProcess] = set()


def default_executable() -> Path:
    """Where ``scripts/setup-vllm.sh`` puts the ``vllm`` executable."""
    return _REPO / ".venv-vllm" / "bin" / "vllm"


def find_url(plan_url: str | None) -> str | None:
    """The base URL of a running server to use instead of starting one, or None."""
    return plan_url or os.environ.get(ENV_URL) or None


def find_executable(plan_path: str | None) -> Path:
    """The ``vllm`` executable to launch.

    Raises:
        EngineError: none is configured or found, naming every place looked and how to fix it.
    """
    if plan_path or os.environ.get(ENV_PATH):
        where = "hardware.runtime_path" if plan_path else f"${ENV_PATH}"
        path = Path(plan_path or os.environ[ENV_PATH]).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EngineError(f"{where}={str(path)!r}: not an executable file; point it at the `vllm` of a vLLM environment (scripts/setup-vllm.sh makes one).")
        return path
    path = default_executable()
    if path.is_file():
        return path
    msg = (f"the vllm runtime found no vLLM: set hardware.runtime_path or ${ENV_PATH} to a `vllm` executable, "
           f"or hardware.runtime_url / ${ENV_URL} to a running server, or create {path.parent.parent} with scripts/setup-vllm.sh.")
    raise EngineError(msg)


def unavailable() -> str | None:
    """Why no vLLM can be found from the environment alone ($FRACTAL_OPT_VLLM_URL,
    $FRACTAL_OPT_VLLM, ``.venv-vllm``), or None; a plan's runtime_path / runtime_url may still
    name one. Looks at paths only: imports nothing."""
    if os.environ.get(ENV_URL):
        return None
    try:
        find_executable(None)
    except EngineError as e:
        return str(e)
    return None


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmProcess:
    """One ``vllm serve`` child on 127.0.0.1; :meth:`stop` ends it and every process it spawned.

    Args:
        command: the full command line (the executable, ``serve``, the model, the flags).
        env: variables set over this process's environment.
        port: the port it listens on (part of ``command``).
    """

    def __init__(self, command: list[str], *, env: dict[str, str], port: int):
        self.command = command
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkstemp(prefix="fractal-opt-vllm-", suffix=".log")[1])
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


def wait_started(proc: VllmProcess, started: float, timeout_s: float) -> None:
    """Raise with the server's own last lines when it died or hung (used by the engine's build)."""
    if not proc.alive():
        raise EngineError(f"vllm serve exited with status {proc.proc.returncode} after {time.perf_counter() - started:.0f} s; its log ({proc.log_path}) ends:\n{proc.log_tail()}")
    raise EngineError(f"vllm serve was not ready after {timeout_s:.0f} s; its log ({proc.log_path}) ends:\n{proc.log_tail()}")


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop(grace_s=5.0)
