"""Is something else running? The load average and the other processes using the CPU.

A measurement on a machine that other work keeps busy is noisy, and no pairing removes all of it:
the A/A calibration then cannot resolve the policy's ``min_effect``. What the user needs is to be
told, with the evidence: the load average against the core count, and the processes that were
using the CPU when the run started (this process and its children left out). :func:`snapshot`
takes that reading; :func:`wait_quiet` waits (with a cap) until the others' CPU use falls.

The others' share is sampled over a short window (``psutil`` CPU times of every process, twice),
not read from the load average: the 1-minute load average is an exponential average, so it still
reads "busy" a minute after the other work stopped, and it counts processes waiting on I/O.
Both are recorded.

Example:
    >>> s = snapshot(interval_s=0.2)                       # doctest: +SKIP
    >>> s.load_average, s.cores, s.others_cores            # doctest: +SKIP
    ((5.1, 4.8, 3.9), 2, 1.7)
    >>> s.describe()                                       # doctest: +SKIP
    'load average 5.10 / 4.80 / 3.90 on 2 cores; other processes using 1.7 cores: python (pid 4121, 98%), ...'
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["BUSY_SHARE", "QUIET_SHARE", "BusySnapshot", "snapshot", "wait_quiet"]

# The machine counts as busy when other processes keep at least this share of its cores working
# (or the 1-minute load average exceeds it, times the core count): on a 2-core machine one other
# core-hungry job (one core) makes the pipeline's two threads share a core, which is what turned
# the quickstart's A/A bands into -10%..+102% on the project's 2-core CPU.
BUSY_SHARE = 0.5
# --wait-quiet waits until the others use at most this share of the cores (a quarter of one core
# on a 2-core machine: an editor, a shell, a language server).
QUIET_SHARE = 0.125
# A process is named in the report when it used at least this share of one core while sampled.
_NAMED_CPU = 0.1
_NAMED_MAX = 6  # at most this many named, busiest first


@dataclass(frozen=True)
class BusySnapshot:
    """One reading of the machine's load.

    Attributes:
        load_average: 1, 5 and 15-minute load averages (None where the platform has none).
        cores: logical cores.
        others_cores: CPU time of every other process during the sample, in cores (1.0 = one core busy).
        processes: the busiest other processes, ``{"pid", "name", "cpu": share of one core}``.
        interval_s: the sampling window.
    """

    load_average: tuple[float, float, float] | None
    cores: int
    others_cores: float
    processes: list[dict[str, Any]] = field(default_factory=list)
    interval_s: float = 0.0

    @property
    def busy(self) -> bool:
        """Other work keeps at least :data:`BUSY_SHARE` of the cores busy (sampled, or by the 1-minute load average)."""
        load = self.load_average[0] if self.load_average else 0.0
        return self.others_cores >= BUSY_SHARE * self.cores or load > BUSY_SHARE * self.cores + 1

    def describe(self) -> str:
        """One line for the terminal and the report."""
        load = " / ".join(f"{v:.2f}" for v in self.load_average) if self.load_average else "unknown"
        text = f"load average {load} on {self.cores} cores; other processes using {self.others_cores:.1f} cores"
        if self.processes:
            text += ": " + ", ".join(f"{p['name']} (pid {p['pid']}, {p['cpu']:.0%})" for p in self.processes)
        return text

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["busy"] = self.busy
        out["text"] = self.describe()
        return out


def _own_pids() -> set[int]:
    import psutil

    me = psutil.Process()
    return {me.pid, *(c.pid for c in me.children(recursive=True))}


def _cpu_times() -> dict[int, tuple[str, float]]:
    """{pid: (name, user + system CPU seconds)} of every process that can be read."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for p in psutil.process_iter(["name", "cpu_times"]):
        t = p.info.get("cpu_times")
        if t is not None:
            out[p.pid] = (p.info.get("name") or "?", t.user + t.system)
    return out


def snapshot(interval_s: float = 1.0, *, count_children: bool = False) -> BusySnapshot:
    """Sample the machine's load for ``interval_s`` seconds, this process excluded; its children
    too unless ``count_children`` (a run's own servers are not "other work"; for ``doctor``,
    which starts none, every other process is)."""
    cores = os.cpu_count() or 1
    try:
        load: tuple[float, float, float] | None = tuple(round(v, 2) for v in os.getloadavg())  # type: ignore[assignment]
    except (AttributeError, OSError):
        load = None
    try:
        first = _cpu_times()
        t0 = time.perf_counter()
        time.sleep(interval_s)
        second = _cpu_times()
        elapsed = time.perf_counter() - t0
        mine = {os.getpid()} if count_children else _own_pids()
    except Exception:  # psutil refused (a sandbox without /proc): only the load average is known
        return BusySnapshot(load_average=load, cores=cores, others_cores=0.0, interval_s=interval_s)
    used = []
    for pid, (name, cpu1) in second.items():
        if pid in mine or pid not in first:
            continue
        share = max(0.0, cpu1 - first[pid][1]) / elapsed
        used.append({"pid": pid, "name": name, "cpu": round(share, 3)})
    used.sort(key=lambda p: p["cpu"], reverse=True)
    named = [p for p in used if p["cpu"] >= _NAMED_CPU][:_NAMED_MAX]
    return BusySnapshot(load_average=load, cores=cores, others_cores=round(sum(p["cpu"] for p in used), 2), processes=named, interval_s=interval_s)


def wait_quiet(*, max_wait_s: float = 600.0, progress: Callable[[str], None] = lambda m: None, interval_s: float = 2.0,
               sample: Callable[[], BusySnapshot] | None = None) -> BusySnapshot:
    """Wait until other processes use at most :data:`QUIET_SHARE` of the cores, or ``max_wait_s`` passed.

    Returns the last snapshot (its ``others_cores`` says whether the wait ended quiet or at the cap).
    ``sample`` replaces :func:`snapshot` (tests).
    """
    take = sample or (lambda: snapshot(interval_s))
    t0 = time.perf_counter()
    while True:
        s = take()
        waited = time.perf_counter() - t0
        if s.others_cores <= QUIET_SHARE * s.cores:
            progress(f"machine quiet after {waited:.0f} s ({s.describe()})")
            return s
        if waited >= max_wait_s:
            progress(f"still busy after {waited:.0f} s, measuring anyway ({s.describe()})")
            return s
        progress(f"waiting for the machine to be quiet ({waited:.0f}/{max_wait_s:.0f} s): {s.describe()}")
