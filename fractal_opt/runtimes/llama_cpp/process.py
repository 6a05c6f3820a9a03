"""llama.cpp's own ``llama-server`` as a child process: the llama_cpp runtime's second transport.

The default transport is xllamacpp's server in this process (:mod:`.engine`). A plan with
``hardware.runtime_path`` runs a ``llama-server`` executable instead, as a child process on a
loopback port, and sends it the same request bodies over HTTP: the two are the same C++ server
(xllamacpp compiles llama.cpp's ``tools/server``), so :class:`LlamaServerProcess` answers the two
calls the engine makes, ``handle_completions(body, callback)`` streamed and ``handle_completions(body)``,
with the same chunks, and everything above them (slots, clocks, quality probes) is unchanged.

Why a second transport: the xllamacpp wheel is built for any x86-64 CPU (its CPU backend reports
AVX2 and no AVX-512), and no wheel on the registry ships a ``llama-server`` built for this CPU.
``scripts/build-llama-server.sh`` (``make setup-llama-native``) compiles one from the llama.cpp
sources inside xllamacpp's own sdist (the same llama.cpp version), with ``GGML_NATIVE=ON``; the
path value ``native`` names that build (one per CPU instruction set: :func:`cpu_tag`). Measured
on a 2-core AMD EPYC (AVX-512, AVX512_BF16), 8 chat clients: the native build on
BF16 weights gave 125.4 output tokens/s, the wheel's best 85.4 (benchmarks/runtimes.py, 5 rounds;
docs/runtimes.md).
A child process also has its own OpenMP runtime, so it never shares spin-waiting threads with
torch or with another server in this process (docs/runtimes.md, "one server at a time").

A :class:`LlamaServerProcess` stops when the last reference to it goes (as an
``xllamacpp.Server`` does), at :meth:`LlamaServerProcess.stop`, when Python exits, or when this
process dies by any signal (the child's watchdog: :mod:`..child_process`). It listens on a
loopback port with a random API key, so other users of the host cannot use it past ``serve``; a
child that dies is started again, within bounds, and :meth:`LlamaServerProcess.health` says so.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import subprocess
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...core.errors import EngineError
from ...weights.llama_tools import cpu_tag, native_tool
from ..child_process import ServerProcess, Supervised, free_port
from ..cores import pinned

__all__ = ["NATIVE", "LlamaServerProcess", "command", "cpu_tag", "executable_problem", "native_executable", "resolve_executable", "started"]

NATIVE = "native"  # hardware.runtime_path value: the llama-server that scripts/build-llama-server.sh built
_START_TIMEOUT_S = 120.0  # loading the embedded model takes ~1 s; a large GGUF from a cold disk takes longer
_READ_TIMEOUT_S = 600.0  # per socket read: a hung server surfaces as an error
_EXIT_WAIT_S = 2.0  # after a broken connection: how long to wait for a dying child's exit status
_HEALTH_TIMEOUT_S = 1.0  # serve's /health asks the child's: a load balancer's probe must not hang on it
_BUILD_HINT = "make setup-llama-native (scripts/build-llama-server.sh) builds llama.cpp's llama-server for this CPU in about 5 minutes"


def native_executable() -> Path:
    """Where ``scripts/build-llama-server.sh`` puts the llama-server it builds for this CPU:
    ``cache_dir()/llama-native/<xllamacpp version>/<cpu_tag()>/llama-server`` (the sources are that
    version's; the build uses this CPU's instructions, so another CPU gets a build of its own
    rather than one that dies of an illegal instruction when a cache directory is shared)."""
    return native_tool("llama-server")


def resolve_executable(path: str) -> Path:
    """The executable a ``hardware.runtime_path`` value names (``native``: :func:`native_executable`)."""
    return native_executable() if path == NATIVE else Path(path).expanduser()


def executable_problem(path: str) -> str | None:
    """Why ``hardware.runtime_path=path`` cannot be launched, or None. Looks at the file only."""
    exe = resolve_executable(path)
    if exe.is_file() and os.access(exe, os.X_OK):
        return None
    what = f"no llama-server built for this CPU at {exe}" if path == NATIVE else f"{str(exe)!r} is not an executable file"
    return f"hardware.runtime_path={path!r}: {what}; {_BUILD_HINT}, or give the path of a llama-server executable"


def command(executable: str, settings: Any, port: int, *, host: str = "127.0.0.1", rpc: Sequence[str] = ()) -> list[str]:
    """The ``llama-server`` command line for ``settings`` (:class:`.settings.ServerSettings`): the
    same load-time settings :func:`.settings.common_params` gives xllamacpp, as llama.cpp's flags
    (also what ``fractal-opt export --target llama-server`` prints). ``rpc``: the ``host:port``
    of each rpc-server the model's layers are spread over (every layer offloaded to them)."""
    cmd = [executable, "--model", settings.model_path, "--host", host, "--port", str(port),
           "--parallel", str(settings.slots), "--ctx-size", str(settings.kv_tokens),
           "--kv-unified" if settings.unified else "--no-kv-unified",
           "--cache-type-k", settings.cache_type, "--cache-type-v", settings.cache_type,
           "--flash-attn", settings.flash_attention]
    if settings.threads is not None:
        cmd += ["--threads", str(settings.threads), "--threads-batch", str(settings.threads)]  # prefill uses the batch threads
    if settings.n_batch is not None:
        cmd += ["--batch-size", str(settings.n_batch)]
    if settings.n_ubatch is not None:
        cmd += ["--ubatch-size", str(settings.n_ubatch)]
    # As in common_params: prefix reuse only when the plan asks (a cache hit is not a prefill).
    cmd += ["--cache-prompt"] if settings.prefix_cache else ["--no-cache-prompt", "--cache-ram", "0"]
    if rpc:
        # Each rpc-server is a device of its own; 999 layers = all of them go to the devices, split
        # by the memory each reports, and llama-server keeps only the token embeddings.
        cmd += ["--rpc", ",".join(rpc), "--n-gpu-layers", "999"]
    return cmd


class LlamaServerProcess:
    """A ``llama-server`` child for ``settings``, answering the engine's two xllamacpp calls over HTTP.

    A child that dies on its own is started again on the same port (:class:`~..child_process.Supervised`:
    three tries, 1 s, 2 s, 4 s apart); requests in flight then, or sent while it restarts, fail with
    a short EngineError, and :meth:`health` says why it cannot serve (raising once the tries are spent).

    Raises:
        EngineError: the server could not start, exited, or was not serving within the timeout
            (the message ends with its last log lines).
    """

    def __init__(self, settings: Any, *, start_timeout_s: float = _START_TIMEOUT_S, key: str | None = None, cpus: Sequence[int] = (),
                 rpc: Sequence[str] = (), name: str = "llama-server"):
        if settings.executable is None:
            raise EngineError("LlamaServerProcess needs settings.executable (hardware.runtime_path)")
        port = free_port()
        # cpus: the cores it is pinned to (a replica's); rpc: the rpc-servers its layers run on.
        argv = pinned([*command(settings.executable, settings, port, rpc=rpc), "--no-webui"], cpus)
        # Its loopback port is reachable by every user of the host: it demands a random key, given
        # through the environment (readable by this user only, unlike the command line in ps).
        # Replicas behind one router share their key (``key``).
        self._key = key or secrets.token_urlsafe(32)
        env = {"LLAMA_API_KEY": self._key}
        self.supervised = Supervised(lambda: started(argv, env, port, start_timeout_s, name=name), name=name)
        # Stop the child once nothing refers to this object any more, like an xllamacpp.Server
        # whose last reference goes (the one-resident rule in .engine drops servers that way).
        self._finalizer = weakref.finalize(self, self.supervised.stop)
        self.port = port

    @property
    def process(self) -> ServerProcess:
        """The child serving now (another one after a restart)."""
        return self.supervised.process

    @property
    def pid(self) -> int:
        return self.process.pid

    def pids(self) -> list[int]:
        """Every process this server runs on (one here; a split or replicated plan's parts too):
        their memory and CPU time are the engine's."""
        return [self.pid]

    def health(self) -> str | None:
        """Why this server cannot answer now (its child restarting, or not answering /health), or None.

        Raises:
            EngineError: the child died and could not be started again.
        """
        if (problem := self.supervised.health()) is not None:
            return problem
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=_HEALTH_TIMEOUT_S)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
        except (OSError, http.client.HTTPException) as e:
            return f"llama-server (pid {self.pid}) does not answer /health: {e}"
        return None if status == 200 else f"llama-server (pid {self.pid}) answers /health with HTTP {status}"

    def stop(self) -> None:
        """End the child now (idempotent)."""
        self._finalizer()

    def _post(self, path: str, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=_READ_TIMEOUT_S)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {self._key}"})
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise self._failure(f"POST {path} to llama-server failed: {e}") from e

    def _failure(self, what: str) -> EngineError:
        """An EngineError for ``what``: its first line short (what a client may be told), then the
        child's last log lines when it has ended (a dying server closes its sockets a moment before
        it exits: wait briefly for that)."""
        child = self.process
        try:
            child.proc.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return EngineError(f"{what} (llama-server {child.pid} still runs; its log: {child.log_path})")
        return EngineError(f"{what} (llama-server exited with status {child.proc.returncode})\nits log ends:\n{child.log_tail()}")

    def handle_completions(self, body: dict[str, Any], callback: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any] | None:
        """One ``/v1/completions`` request: with ``callback``, streamed chunk by chunk (as xllamacpp
        does; ``callback`` returning True ends the request); without, the whole answer. Returns
        ``{"error": ...}`` when llama-server refused it."""
        if callback is not None:
            return self._stream("/v1/completions", {**body, "stream": True}, callback)
        conn, response = self._post("/v1/completions", body)
        try:
            return _error(response) if response.status != 200 else json.loads(response.read())
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise self._failure(f"the answer from llama-server broke: {type(e).__name__}: {e}") from e
        finally:
            conn.close()

    def _stream(self, path: str, body: dict[str, Any], callback: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """Call ``callback`` with every chunk of a streamed answer; ``callback`` returning True ends
        the request: closing the connection makes llama-server cancel it and free its slot."""
        conn, response = self._post(path, body)
        ended = False  # [DONE], an error event, or the caller's cancel: the stream ended as llama-server meant
        try:
            if response.status != 200:
                return _error(response)
            for raw in response:
                line = raw.strip()
                # Server-sent events: "data: {chunk}" per token, "error: {...}" when the request
                # failed after the stream began, blank separators.
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]" or callback(json.loads(data)):
                        ended = True
                        break
                elif line.startswith(b"error:"):
                    callback({"error": _error_body(json.loads(line[6:].strip()))})
                    ended = True
                    break
        except (OSError, http.client.HTTPException, ValueError) as e:  # a cut connection, a torn chunk
            raise self._failure(f"the stream from llama-server broke: {type(e).__name__}: {e}") from e
        finally:
            conn.close()
        if not ended:  # the connection closed cleanly but early: the server went away mid-answer
            raise self._failure("llama-server closed the stream before its end ([DONE])")
        return None


def started(argv: list[str], env: dict[str, str], port: int, timeout_s: float, *, name: str = "llama-server") -> ServerProcess:
    """Start ``argv`` (a llama-server, or a router in front of some) and return it once its /health answers 200.

    Raises:
        EngineError: it exited or was not serving within ``timeout_s`` (with its last log lines).
    """
    process = ServerProcess(argv, env=env, port=port, log_prefix="fractal-opt-llama-server-")
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if not process.alive():
            process.stop()
            raise EngineError(f"{name} exited with status {process.proc.returncode} while loading; its log ({process.log_path}) ends:\n{process.log_tail()}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
            if status == 200:
                process.ready = True
                return process
        except OSError:
            pass  # not listening yet
        time.sleep(0.05)
    process.stop()
    raise EngineError(f"{name} was not serving after {timeout_s:.0f} s; its log ({process.log_path}) ends:\n{process.log_tail()}")


def _error(response: http.client.HTTPResponse) -> dict[str, Any]:
    text = response.read().decode(errors="replace")
    try:
        return {"error": _error_body(json.loads(text))}
    except ValueError:
        return {"error": {"message": f"HTTP {response.status}: {text[:300]}"}}


def _error_body(parsed: Any) -> dict[str, Any]:
    """llama-server's ``{"error": {"code", "message", "type"}}`` (or the bare inner object)."""
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return parsed["error"]
    return parsed if isinstance(parsed, dict) else {"message": str(parsed)}
