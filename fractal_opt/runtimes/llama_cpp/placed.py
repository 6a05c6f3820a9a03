"""A placed llama.cpp plan: one model over rpc-servers, or copies of it behind a router.

Both answer the engine's calls as a single :class:`~.process.LlamaServerProcess` does (they are
one), so the engine, its slots, clocks and quality probes are unchanged; what differs is the set
of processes behind the port it talks to, and every one of them is a child this object owns
(:class:`~fractal_opt.runtimes.child_process.ServerProcess`: its own process group, stopped with
the engine, at exit, and by its watchdog when this process dies by any signal, SIGKILL included).

- :class:`RpcSplitServer`: ``rpc_workers`` llama.cpp ``rpc-server`` processes, each pinned to its
  own cores, listening on ``rpc_bind`` (loopback unless the plan names another address: the RPC
  protocol has no authentication, so the run then says so on stderr), plus the plan's
  ``rpc_endpoints`` started elsewhere; ``llama-server --rpc`` spreads the model's layers over all
  of them. Health names the part that is down.
- :class:`ReplicaSet`: ``replicas`` llama-servers of the plan, each pinned to ``replica_cores``
  cores with as many threads, sharing one random key, behind HAProxy (:mod:`..router`) on a
  loopback port; each replica is restarted within bounds like a single server, and health names a
  replica that is down or restarting.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...core.errors import EngineError
from ...weights.llama_tools import native_tool
from ..child_process import ServerProcess, Supervised, free_port
from ..cores import core_blocks, pinned
from ..router import haproxy_config, router_command, write_config
from .process import LlamaServerProcess, started

__all__ = ["ReplicaSet", "RpcSplitServer", "rpc_worker_command", "starter"]

log = logging.getLogger("fractal_opt.runtimes")

_RPC_START_TIMEOUT_S = 30.0  # an rpc-server listens within a second; it loads nothing until llama-server sends tensors
_ROUTER_START_TIMEOUT_S = 30.0  # HAProxy starts in milliseconds; the wait is for its first /health through a replica
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def starter(settings: Any) -> Callable[[Any], Any]:
    """The server class for ``settings``: a split over rpc-servers, replicas behind a router, or one llama-server."""
    if settings.rpc_workers or settings.rpc_endpoints:
        return RpcSplitServer
    if settings.replicas > 1 or settings.replica_cores is not None:
        return ReplicaSet
    return LlamaServerProcess


def rpc_worker_command(executable: str, *, host: str, port: int, threads: int) -> list[str]:
    """One ``rpc-server``: a ggml CPU backend that listens on ``host:port`` with ``threads`` threads."""
    return [executable, "--host", host, "--port", str(port), "--threads", str(threads)]


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1" if host in ("0.0.0.0", "::") else host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _start_rpc_worker(index: int, count: int, *, bind: str, cpus: Sequence[int]) -> ServerProcess:
    port = free_port()
    argv = pinned(rpc_worker_command(str(native_tool("rpc-server")), host=bind, port=port, threads=len(cpus)), cpus)
    worker = ServerProcess(argv, env={}, port=port, log_prefix="fractal-opt-rpc-server-")
    deadline = time.monotonic() + _RPC_START_TIMEOUT_S
    while not _listening(bind, port):
        if not worker.alive() or time.monotonic() > deadline:
            worker.stop(grace_s=1.0)
            raise EngineError(f"rpc-server {index + 1} of {count} did not listen on {bind}:{port} (status {worker.proc.poll()}); its log ends:\n{worker.log_tail()}")
        time.sleep(0.05)
    worker.ready = True
    return worker


def _stop_all(parts: Sequence[Any], files: Sequence[Path] = ()) -> None:
    """Stop every part (the front first, so no request reaches a part on its way out) and remove ``files``."""
    for part in parts:
        part.stop()
    for path in files:
        path.unlink(missing_ok=True)


class RpcSplitServer(LlamaServerProcess):
    """llama-server with the model's layers on rpc-servers: the ones it starts here and the plan's endpoints."""

    def __init__(self, settings: Any, **kwargs: Any):
        if settings.rpc_bind not in _LOOPBACK:
            loud = (f"fractal-opt: WARNING: rpc-servers listen on {settings.rpc_bind}: llama.cpp's RPC protocol has no authentication, so anyone "
                    "who can reach that address can run computations on this machine and read the model's weights. Bind to 127.0.0.1 unless "
                    "the network is yours alone.")
            print(loud, file=sys.stderr, flush=True)
            log.warning("%s", loud)
        blocks = core_blocks(settings.rpc_workers, _cores_each(settings.rpc_workers)) if settings.rpc_workers else []
        self.workers: list[ServerProcess] = []
        try:
            for i, cpus in enumerate(blocks):
                self.workers.append(_start_rpc_worker(i, len(blocks), bind=settings.rpc_bind, cpus=cpus))
            self.endpoints = [*(f"{_connect_host(settings.rpc_bind)}:{w.port}" for w in self.workers), *settings.rpc_endpoints]
            super().__init__(settings, rpc=self.endpoints, **kwargs)
        except BaseException:
            _stop_all(self.workers)
            raise
        self._finalizer.detach()  # stop the front and the workers together
        self._finalizer = weakref.finalize(self, _stop_all, [self.supervised, *self.workers])

    def pids(self) -> list[int]:
        return [self.pid, *(w.pid for w in self.workers if w.alive())]

    def health(self) -> str | None:
        """Which rpc-server is down (the split model cannot serve without it), else the front's health."""
        for i, worker in enumerate(self.workers):
            if not worker.alive():
                return (f"rpc-server {i + 1} of {len(self.workers)} (pid {worker.pid}, {self.endpoints[i]}) exited with status {worker.proc.returncode}: "
                        "the layers it held are gone; restart the server")
        return super().health()


class ReplicaSet(LlamaServerProcess):
    """``settings.replicas`` llama-servers, each pinned to its own cores, behind HAProxy on a loopback port."""

    def __init__(self, settings: Any, *, start_timeout_s: float = 120.0):
        key = secrets.token_urlsafe(32)
        one = dataclasses.replace(settings, replicas=1, replica_cores=None)  # each replica serves the plan itself
        blocks = core_blocks(settings.replicas, settings.replica_cores or _cores_each(settings.replicas))
        self.replicas: list[LlamaServerProcess] = []
        self._config: Path | None = None
        try:
            for i, cpus in enumerate(blocks):
                self.replicas.append(LlamaServerProcess(one, key=key, cpus=cpus, name=f"replica {i + 1} of {len(blocks)}", start_timeout_s=start_timeout_s))
            if len(self.replicas) == 1:  # one pinned server: no router in front of it
                front = self.replicas[0]
                self.port, self.supervised = front.port, front.supervised
            else:
                port = self.port = free_port()
                self._config = write_config(haproxy_config([("127.0.0.1", r.port) for r in self.replicas], port=port, maxconn=settings.slots))
                argv = router_command(self._config)
                # The start function must not hold self: the supervisor's thread would keep this object alive, and its finalizer never run.
                self.supervised = Supervised(lambda: started(argv, {}, port, _ROUTER_START_TIMEOUT_S, name="haproxy"), name="haproxy")
        except BaseException:
            _stop_all(self.replicas, [self._config] if self._config else [])
            raise
        self._key = key
        parts = [self.supervised, *self.replicas] if len(self.replicas) > 1 else self.replicas
        self._finalizer = weakref.finalize(self, _stop_all, parts, [self._config] if self._config else [])

    def pids(self) -> list[int]:
        own = [self.pid] if len(self.replicas) > 1 else []
        return [*own, *(pid for r in self.replicas for pid in r.pids() if r.process.alive())]

    def health(self) -> str | None:
        """A replica down or restarting (named), else the router's health (its /health reaches a replica).

        Raises:
            EngineError: a replica or the router died and could not be started again.
        """
        for i, replica in enumerate(self.replicas):
            try:
                problem = replica.supervised.health()
            except EngineError as e:
                raise EngineError(f"replica {i + 1} of {len(self.replicas)}: {e}") from None
            if problem is not None:
                return f"replica {i + 1} of {len(self.replicas)} (pid {replica.pid}, port {replica.port}): {problem}"
        return super().health()


def _cores_each(parts: int) -> int:
    """This process's CPUs shared out over ``parts`` (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, parts))


def _connect_host(bind: str) -> str:
    """Where llama-server reaches an rpc-server listening on ``bind`` (all interfaces: loopback)."""
    return "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
