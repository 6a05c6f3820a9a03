"""HAProxy in front of a plan's replicas: the router is the distribution's, never one written here.

:func:`haproxy_config` writes the configuration (pure: tested without HAProxy), :class:`Router`
runs ``haproxy -db -f CONFIG`` as a child like every other part of a plan
(:class:`~fractal_opt.runtimes.child_process.ServerProcess`: its own process group, stopped with
its engine, at exit, and by the watchdog when this process dies by any signal).

How it balances: ``leastconn`` sends each new request to the replica with the fewest open
connections, and ``maxconn`` per replica (its slots) queues the rest inside HAProxy rather than
inside a replica whose slots are all busy, so a free replica never waits behind a busy one.
Streaming answers (server-sent events) pass through as they come: ``http-server-close`` keeps
HAProxy from holding connections to the replicas, and no response is buffered. It listens on
loopback only; the replicas behind it demand the key their engine gave them, which HAProxy passes
through (the ``Authorization`` header), so HAProxy's port serves nobody without that key.

Install: ``apt-get install haproxy`` (``make setup-router``; .ci/run runs it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["HAPROXY", "INSTALL_HINT", "haproxy_config", "haproxy_problem", "router_command", "write_config"]

HAPROXY = "haproxy"
INSTALL_HINT = "apt-get install haproxy (make setup-router installs it: Debian's package)"
_TIMEOUT_S = 600  # a streamed answer may take minutes on a loaded CPU: as long as llama-server's own read timeout


def haproxy_problem() -> str | None:
    """Why HAProxy cannot be started here, or None. Looks at PATH only."""
    return None if shutil.which(HAPROXY) else f"no {HAPROXY} executable on PATH; {INSTALL_HINT}"


def haproxy_config(backends: Sequence[tuple[str, int]], *, port: int, maxconn: int, host: str = "127.0.0.1") -> str:
    """HAProxy's configuration: listen on ``host:port``, spread requests over ``backends`` ((host, port) each) by least connections.

    Example:
        >>> "server r1 127.0.0.1:8002 maxconn 4" in haproxy_config([("127.0.0.1", 8001), ("127.0.0.1", 8002)], port=8000, maxconn=4)
        True
    """
    servers = "\n".join(f"    server r{i} {h}:{p} maxconn {maxconn}" for i, (h, p) in enumerate(backends))
    return f"""global
    maxconn {max(64, 4 * maxconn * len(backends))}
defaults
    mode http
    option http-server-close
    timeout connect 5s
    timeout client {_TIMEOUT_S}s
    timeout server {_TIMEOUT_S}s
    timeout queue {_TIMEOUT_S}s
frontend replicas_in
    bind {host}:{port}
    default_backend replicas
backend replicas
    balance leastconn
{servers}
"""


def router_command(config_path: str | os.PathLike[str]) -> list[str]:
    """``haproxy`` in the foreground (``-db``: no daemon, so it stays the child this process stops)."""
    return [shutil.which(HAPROXY) or HAPROXY, "-db", "-f", str(config_path)]


def write_config(text: str) -> Path:
    """The configuration in a file only this user can read; the caller removes it."""
    fd, path = tempfile.mkstemp(prefix="fractal-opt-haproxy-", suffix=".cfg")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(path)
