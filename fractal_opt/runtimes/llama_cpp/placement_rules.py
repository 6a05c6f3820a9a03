"""What the llama_cpp runtime refuses of a placed plan (a split over rpc-servers, replicas), and why.

One :class:`~fractal_opt.engine.capabilities.Refusal` row per rule, read by the runtime's table
(:data:`.settings.REFUSALS`), so the runner skips such a step with the reason before any round:

- both placements start child processes, so they need a ``llama-server`` executable
  (``runtime_path``): xllamacpp's server in this process has no RPC backend and is one server;
- started rpc-servers need llama.cpp's ``rpc-server`` built beside it (``make setup-llama-native``);
- every rpc-server named in ``rpc_endpoints`` must accept a TCP connection now (an unreachable one
  is refused here, not found by a hung load);
- three or more CPU rpc-servers are refused: llama.cpp's RPC backend is reported to deadlock with
  three or more CPU endpoints (llama.cpp bug report #28487), while two work;
- replicas need HAProxy (:mod:`..router`) unless there is one; a split plan is not replicated here.
"""

from __future__ import annotations

import socket
from typing import Any

from ...engine.capabilities import Refusal
from ...weights.llama_tools import BUILD_HINT, native_tool
from ..router import haproxy_problem

__all__ = ["CONNECT_TIMEOUT_S", "MAX_CPU_RPC_WORKERS", "PLACEMENT_REFUSALS", "rpc_server_problem", "unreachable"]

CONNECT_TIMEOUT_S = 2.0  # an rpc-server on a LAN answers a TCP connect in milliseconds; 2 s allows a slow link
MAX_CPU_RPC_WORKERS = 2  # llama.cpp bug report #28487: three or more CPU rpc-servers deadlock; two work


def rpc_server_problem() -> str | None:
    """Why no ``rpc-server`` can be started here, or None (looks at the file only)."""
    exe = native_tool("rpc-server")
    return None if exe.is_file() else f"no rpc-server built for this CPU at {exe}; {BUILD_HINT}"


def unreachable(endpoints: tuple[str, ...], *, timeout_s: float = CONNECT_TIMEOUT_S) -> list[str]:
    """The ``host:port`` endpoints that do not accept a TCP connection within ``timeout_s``, each with why."""
    bad = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                pass
        except (OSError, ValueError) as e:
            bad.append(f"{endpoint} ({type(e).__name__}: {e})")
    return bad


def _split(plan: Any) -> bool:
    return bool(plan.hardware.rpc_workers or plan.hardware.rpc_endpoints)


def _unreachable_reason(plan: Any) -> str:
    bad = unreachable(tuple(plan.hardware.rpc_endpoints))
    return (f"hardware.rpc_endpoints={list(plan.hardware.rpc_endpoints)}: {len(bad)} of {len(plan.hardware.rpc_endpoints)} rpc-servers do not answer: {', '.join(bad)}; "
            "start rpc-server on each (rpc-server --host ADDRESS --port PORT) or remove it from the list")


_NEEDS_EXECUTABLE = "starts child processes, which needs a llama-server executable: runtime: {backend: llama_cpp, path: native} (xllamacpp in this process "

PLACEMENT_REFUSALS: tuple[Refusal, ...] = (
    Refusal("hardware.rpc_workers", lambda p: _split(p) and p.hardware.runtime_path is None,
            lambda p: (f"hardware.rpc_workers={p.hardware.rpc_workers} (rpc_endpoints={list(p.hardware.rpc_endpoints)}): a split over rpc-servers "
                       + _NEEDS_EXECUTABLE + "has no RPC backend)")),
    Refusal("hardware.rpc_workers", lambda p: p.hardware.rpc_workers > 0 and rpc_server_problem() is not None,
            lambda p: f"hardware.rpc_workers={p.hardware.rpc_workers}: {rpc_server_problem()}"),
    Refusal("hardware.rpc_workers", lambda p: p.hardware.rpc_workers > MAX_CPU_RPC_WORKERS, lambda p: (
        f"hardware.rpc_workers={p.hardware.rpc_workers}: llama.cpp's RPC backend is reported to deadlock with three or more CPU rpc-servers "
        f"(llama.cpp bug report #28487); at most {MAX_CPU_RPC_WORKERS} are started here")),
    Refusal("hardware.rpc_endpoints", lambda p: bool(p.hardware.rpc_endpoints) and bool(unreachable(tuple(p.hardware.rpc_endpoints))), _unreachable_reason),
    Refusal("scheduling.replicas", lambda p: p.scheduling.replicas > 1 and p.hardware.runtime_path is None,
            lambda p: f"scheduling.replicas={p.scheduling.replicas}: replicas behind a router " + _NEEDS_EXECUTABLE + "is one server)"),
    Refusal("scheduling.replicas", lambda p: p.scheduling.replicas > 1 and haproxy_problem() is not None,
            lambda p: f"scheduling.replicas={p.scheduling.replicas}: the router is HAProxy: {haproxy_problem()}"),
    Refusal("scheduling.replicas", lambda p: p.scheduling.replicas > 1 and _split(p),
            "replicas of a plan split over rpc-servers are not built here: split, or replicate, one at a time"),
    Refusal("scheduling.replica_cores", lambda p: p.scheduling.replica_cores is not None and p.hardware.runtime_path is None,
            lambda p: f"scheduling.replica_cores={p.scheduling.replica_cores}: pinning a server to its cores " + _NEEDS_EXECUTABLE + "shares this process's cores)"),
    Refusal("scheduling.router", lambda p: p.scheduling.router not in ("auto", "haproxy"),
            lambda p: f"scheduling.router={p.scheduling.router!r}: the llama_cpp runtime's replicas sit behind HAProxy (router: auto or haproxy)"),
)
