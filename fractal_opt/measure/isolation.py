"""One engine computes at a time: the run's other child servers are stopped during a timed round,
and every round says who else used the CPU while it ran.

A child server (``vllm serve``, a llama-server of another plan) keeps threads that poll, warm
caches or serve health checks while it is resident; on a small machine that takes cores from the
engine being measured, and nothing in the round's numbers would show it. So:

- :func:`others_quiet` SIGSTOPs the process group of every live child server of this run except
  the measured engine's own, and SIGCONTs them when the round ends, whatever ends it. Engines that
  run inside this process (transformers, xllamacpp's in-process server) compute only while they
  are called, and a round calls only the engine it measures: they have nothing to stop.
- :class:`CpuAccount` reads, over the round, the measured engine's CPU seconds (this process plus
  the engine's server trees), the CPU seconds of the run's *other* processes (descendants of this
  process outside those trees), and the machine's busy CPU seconds outside this process tree.

The registry of live child groups lives here, below ``runtimes/`` (which registers each child it
starts), because ``measure/`` may not import ``runtimes/``: runtimes already import measure.

Example:
    >>> with others_quiet([]), CpuAccount([]) as account:   # doctest: +SKIP
    ...     serve_the_round()
    >>> account.result()["share"]                             # doctest: +SKIP
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["RERUN_SHARE", "CpuAccount", "add_live_group", "contended", "discard_live_group", "live_groups", "others_quiet", "tree_cpu_s"]

# A round is re-run when the run's other processes used more than this share of the measured
# engine's CPU time (5%: the size of the policy's default min_effect, so a disturbance this large
# could decide a verdict).
RERUN_SHARE = 0.05
# ...and more than one accounting tick: Linux counts process CPU time in clock ticks of 10 ms
# (USER_HZ = 100), so less than that cannot be told from rounding (an engine that sleeps, like the
# test's FakeEngine, uses a few ms of CPU: a share of it would be noise).
_TICK_S = 0.01

_REAPED = -1  # the key, among the run's other processes, of this process's waited-for children (no pid is negative)
# Process groups of the child servers this process started and has not stopped yet.
_LIVE_GROUPS: set[int] = set()


def add_live_group(pgid: int) -> None:
    """Register a child server's process group: other engines' rounds stop it while they run."""
    _LIVE_GROUPS.add(pgid)


def discard_live_group(pgid: int) -> None:
    """Forget a child server's group once it is stopped for good (idempotent)."""
    _LIVE_GROUPS.discard(pgid)


def live_groups() -> list[int]:
    """The process groups of this run's live child servers, as registered now."""
    return sorted(_LIVE_GROUPS)


def _trees(pids: Sequence[int]) -> dict[int, Any]:
    """``pids`` and all their descendants, as psutil processes by pid (each once)."""
    import psutil

    seen: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in (proc, *proc.children(recursive=True)):
                seen.setdefault(p.pid, p)
        except psutil.Error:  # ended between the readings: its time is lost, the rest counts
            continue
    return seen


def _cpu(proc: Any) -> float:
    import psutil

    try:
        t = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def tree_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes ``pids`` and their children used so far, each
    process counted once (an engine may list a server and its children both)."""
    return sum(_cpu(p) for p in _trees(pids).values()) if pids else 0.0


@contextmanager
def others_quiet(keep_pids: Sequence[int]) -> Iterator[list[int]]:
    """Stop every live child server's process group but those of ``keep_pids`` (and their
    descendants) for the duration of the block; continue them afterwards, also when the block
    raises or is interrupted (KeyboardInterrupt, the step deadline). Yields the stopped groups.

    This process's own group is never stopped. A group that ended meanwhile is skipped.
    """
    keep = {os.getpgrp()}
    for pid in _trees(keep_pids):
        try:
            keep.add(os.getpgid(pid))
        except OSError:
            continue
    stopped: list[int] = []
    try:
        for pgid in live_groups():
            if pgid in keep:
                continue
            stopped.append(pgid)  # before the signal: an interruption right after it still continues the group
            _signal_group(pgid, signal.SIGSTOP)
        yield stopped
    finally:
        for pgid in stopped:
            _signal_group(pgid, signal.SIGCONT)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # ended, or no longer ours: nothing to stop or continue
        pass


def _machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far, all cores (Linux counts guest time inside
    user and nice, so it is taken out once; idle and iowait are not busy)."""
    import psutil

    t = psutil.cpu_times()._asdict()
    total = sum(t.values()) - t.get("guest", 0.0) - t.get("guest_nice", 0.0)
    return float(total - t["idle"] - t.get("iowait", 0.0))


class CpuAccount:
    """Who used the CPU during a round (a context manager around it; :meth:`result` after).

    Args:
        engine_pids: the measured engine's server processes (``Engine.server_pids()``); this
            process counts as the engine's too (in-process runtimes compute in it).
    """

    def __init__(self, engine_pids: Sequence[int]):
        self.engine_pids = list(engine_pids)
        self._start: tuple[float, dict[int, float], float] | None = None
        self._end: tuple[float, dict[int, float], float] | None = None

    def _reading(self) -> tuple[float, dict[int, float], float]:
        import psutil

        t = os.times()
        engine = _trees(self.engine_pids)
        engine_s = t.user + t.system + sum(_cpu(p) for p in engine.values())
        try:
            descendants = psutil.Process().children(recursive=True)
        except psutil.Error:
            descendants = []
        others = {p.pid: _cpu(p) for p in descendants if p.pid not in engine}
        # Children this process has waited for: their CPU time moved here when they ended (a
        # helper that started and ended within the round is counted through it).
        others[_REAPED] = t.children_user + t.children_system
        return engine_s, others, _machine_busy_s()

    def __enter__(self) -> CpuAccount:
        self._start = self._reading()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = self._reading()

    def result(self) -> dict[str, float | None]:
        """``engine_cpu_s``, ``run_others_cpu_s``, ``outside_cpu_s`` over the round, and ``share``
        (others of the run / engine; None when the engine used no CPU time)."""
        assert self._start is not None and self._end is not None, "result() is read after the round"
        (e0, o0, m0), (e1, o1, m1) = self._start, self._end
        engine = max(0.0, e1 - e0)
        # A process that started during the round counts from zero; one that ended counts when this
        # process waited for it (os.times' children), else its time is lost with it.
        others = sum(max(0.0, cpu - o0.get(pid, 0.0)) for pid, cpu in o1.items())
        outside = max(0.0, (m1 - m0) - engine - others)  # clamped: tick rounding can make it slightly negative
        return {"engine_cpu_s": round(engine, 4), "run_others_cpu_s": round(others, 4), "outside_cpu_s": round(outside, 4),
                "share": round(others / engine, 4) if engine > 0 else None}


def contended(account: dict[str, Any]) -> bool:
    """True when the run's other processes used more than :data:`RERUN_SHARE` of the engine's CPU
    time during the round (and more than one accounting tick)."""
    others = account["run_others_cpu_s"]
    return bool(others > max(RERUN_SHARE * account["engine_cpu_s"], _TICK_S))
