"""Which cores each part of a placed plan runs on: pinned with util-linux's ``taskset``.

A replica or an rpc-server gets cores of its own, so two parts never share a core's caches and
the OS scheduler cannot move one onto the other's core. The CPUs are this process's own
(``os.sched_getaffinity``: a container's cpuset is respected), in order, handed out in blocks.
``taskset --cpu-list CPUS COMMAND`` sets the affinity before the command runs, so every thread the
server later starts inherits it (setting it on a running process reaches only its main thread).

Example:
    >>> core_blocks(2, 1, cpus=[0, 1])
    [[0], [1]]
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from ..core.errors import EngineError

__all__ = ["core_blocks", "pinned"]


def core_blocks(count: int, each: int, *, cpus: Sequence[int] | None = None) -> list[list[int]]:
    """``count`` disjoint blocks of ``each`` CPUs from ``cpus`` (default: this process's).

    Raises:
        ValueError: fewer CPUs than ``count x each`` (the placement passes refuse that first).
    """
    available = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if count * each > len(available):
        raise ValueError(f"{count} parts x {each} cores = {count * each} cores, but only {len(available)} CPUs are available: {available}")
    return [available[i * each:(i + 1) * each] for i in range(count)]


def pinned(command: Sequence[str], cpus: Sequence[int]) -> list[str]:
    """``command`` run on ``cpus`` only (``taskset --cpu-list``); unchanged when ``cpus`` is empty.

    Raises:
        EngineError: cores are asked for and util-linux's ``taskset`` is not on PATH.
    """
    if not cpus:
        return list(command)
    taskset = shutil.which("taskset")
    if taskset is None:
        raise EngineError("pinning a part of the plan to its cores needs util-linux's taskset on PATH (apt-get install util-linux)")
    return [taskset, "--cpu-list", ",".join(str(c) for c in cpus), *command]
