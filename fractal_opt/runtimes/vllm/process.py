"""Finding vLLM and running ``vllm serve`` as a child process that never outlives the engine.

vLLM pins its own torch and transformers, so it runs from its own environment
(``scripts/setup-vllm.sh`` creates ``.venv-vllm``) and fractal_opt only talks to it over HTTP.
Where it is found, first match wins:

1. ``plan.hardware.runtime_url`` / ``$FRACTAL_OPT_VLLM_URL``: a server already running; nothing
   is started and :meth:`VllmProcess.stop` leaves it alone.
2. ``plan.hardware.runtime_path`` / ``$FRACTAL_OPT_VLLM``: the ``vllm`` executable to launch.
3. ``.venv-vllm/bin/vllm`` in the repository (what ``scripts/setup-vllm.sh`` makes).

The server runs as a :class:`~fractal_opt.runtimes.child_process.ServerProcess`: in its own process
group (its engine core and workers are grandchildren), stopped with it, and at exit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ...core.errors import EngineError
from ..child_process import ServerProcess, free_port

__all__ = ["ENV_PATH", "ENV_URL", "VllmProcess", "default_executable", "find_executable", "find_url", "free_port", "unavailable", "wait_started"]

ENV_PATH = "FRACTAL_OPT_VLLM"
ENV_URL = "FRACTAL_OPT_VLLM_URL"
_REPO = Path(__file__).resolve().parents[3]


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


class VllmProcess(ServerProcess):
    """One ``vllm serve`` child on 127.0.0.1 (:class:`~fractal_opt.runtimes.child_process.ServerProcess`)."""

    def __init__(self, command: list[str], *, env: dict[str, str], port: int):
        super().__init__(command, env=env, port=port, log_prefix="fractal-opt-vllm-")


def wait_started(proc: VllmProcess, started: float, timeout_s: float) -> None:
    """Raise with the server's own last lines when it died or hung (used by the engine's build)."""
    if not proc.alive():
        raise EngineError(f"vllm serve exited with status {proc.proc.returncode} after {time.perf_counter() - started:.0f} s; its log ({proc.log_path}) ends:\n{proc.log_tail()}")
    raise EngineError(f"vllm serve was not ready after {timeout_s:.0f} s; its log ({proc.log_path}) ends:\n{proc.log_tail()}")
