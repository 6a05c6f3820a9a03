"""Running vLLM servers kept across engine builds: a pipeline step that changes only per-request
fields (decoding, max_new_tokens, the queue) reuses the server instead of a 60-80 s restart.

A server is keyed by everything that reaches its process (:func:`server_key`): the executable,
the model folder, the ``vllm serve`` flags and the environment it starts with. The cache holds at
most two, like the other runtimes' model caches (the pipeline alternates between the last kept
plan and a candidate). An engine *uses* its server from build to close:

- closing an engine never stops a server another engine uses, nor one the cache still holds;
- eviction (a third server, :func:`evict_except`, :func:`clear_cache`) stops a server at once
  when no engine uses it, else when its last engine closes;
- before a server starts for a plan that may run on a GPU, idle cached servers are stopped: vLLM
  reserves its share of the GPU's memory (``--gpu-memory-utilization``, 0.9 by default) at start
  and refuses to start when that much is not free;
- :mod:`.process`'s ``atexit`` hook stops whatever still runs when Python exits.

Example:
    >>> key = server_key("/env/bin/vllm", "/models/m", ["--dtype", "float32"], {"OMP_NUM_THREADS": "2"})
    >>> key[0], key[2]
    ('/env/bin/vllm', ('--dtype', 'float32'))
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .process import VllmProcess

__all__ = ["Served", "acquire", "clear_cache", "evict_except", "release", "server_key"]

_SIZE = 2  # servers kept: the last kept plan's and a candidate's, as the other runtimes keep
# Inherited variables that change what a server does (the CPU build's KV-cache GiB, GPU selection,
# threads); other variables of the caller's environment do not make a new server.
_KEY_ENV = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
_KEY_ENV_PREFIX = "VLLM_"


@dataclass(eq=False)
class Served:
    """One running server and the engines using it."""

    key: tuple
    process: VllmProcess
    weights_key: tuple  # Plan.weights_key() of the plan it was started for (evict_except matches it)
    load_s: float  # its start-up: process, weights, KV-cache allocation, until /v1/models answered
    users: int = 0  # engines built on it and not yet closed
    cached: bool = True  # False once evicted: it stops when its last user closes


_SERVERS: OrderedDict[tuple, Served] = OrderedDict()  # least recently used first
# Held while a server starts, so two builds of one key never start it twice (builds serialize).
_LOCK = threading.RLock()


def server_key(executable: str, model_dir: str, args: Sequence[str], env: Mapping[str, str]) -> tuple:
    """What makes two servers the same: executable, model folder, flags, and the environment the
    process sees that matters to vLLM (``env`` over the inherited ``VLLM_*`` and device variables)."""
    inherited = {k: v for k, v in os.environ.items() if k.startswith(_KEY_ENV_PREFIX) or k in _KEY_ENV}
    return (str(executable), str(model_dir), tuple(args), tuple(sorted({**inherited, **env}.items())))


def acquire(key: tuple, *, weights_key: tuple, start: Callable[[], tuple[VllmProcess, float]], frees_gpu: bool) -> tuple[Served, bool]:
    """The cached server for ``key`` (True: reused) or a new one from ``start()`` (False), with
    this caller counted as a user until :func:`release`.

    Args:
        key: :func:`server_key` of the server wanted.
        weights_key: ``Plan.weights_key()`` of the plan, for :func:`evict_except`.
        start: starts the server and waits until it serves; returns it and its start-up seconds.
        frees_gpu: stop idle cached servers before starting (plans that may run on a GPU).
    """
    with _LOCK:
        served = _SERVERS.get(key)
        if served is not None and not served.process.alive():
            _drop(served)  # it died (crash, out of memory): start it again
            served = None
        if served is not None:
            _SERVERS.move_to_end(key)
            served.users += 1
            return served, True
        while len(_SERVERS) >= _SIZE:
            _drop(next(iter(_SERVERS.values())))
        if frees_gpu:
            for idle in [s for s in _SERVERS.values() if s.users == 0]:
                _drop(idle)
        process, load_s = start()
        served = Served(key=key, process=process, weights_key=weights_key, load_s=load_s, users=1)
        _SERVERS[key] = served
        return served, False


def release(served: Served) -> None:
    """One user of ``served`` is done; an evicted server stops with its last user."""
    with _LOCK:
        served.users = max(0, served.users - 1)
        if served.users == 0 and not served.cached:
            served.process.stop()


def evict_except(keep: set[tuple]) -> None:
    """Stop (or, while an engine uses it, release to stop at its close) every cached server
    whose plan's ``weights_key()`` is not in ``keep``."""
    with _LOCK:
        for served in [s for s in _SERVERS.values() if s.weights_key not in keep]:
            _drop(served)


def clear_cache() -> None:
    """Evict every cached server (each stops now, or when the last engine using it closes)."""
    with _LOCK:
        for served in list(_SERVERS.values()):
            _drop(served)


def _drop(served: Served) -> None:
    _SERVERS.pop(served.key, None)
    served.cached = False
    if served.users == 0:
        served.process.stop()
