"""A wall-clock limit on one step of a run (``policy.timeout_s``).

Python cannot kill a thread, and a step cannot simply run in a child process (its engines, the
reference logits and the engine cache live in this one). So a step runs in a worker thread and
the runner waits for it at most ``timeout_s``. Past that, the worker is asked to stop in the two
ways CPython offers, then waited for a short grace period:

- :func:`checkpoint` raises :class:`StepTimeout` in a cancelled worker. The runner calls it at
  every stage of a step, before it changes shared state, and in its progress callback (builds,
  measurement rounds and probes report progress often);
- :c:func:`PyThreadState_SetAsyncExc` raises :class:`StepTimeout` inside the worker, which ends a
  hang in Python code (a probe's endless loop, a polling wait). CPython may deliver it late, so
  the checkpoints, not this, are what keep a late-waking worker from touching anything.

:class:`StepTimeout` derives from BaseException, as KeyboardInterrupt does, so a library's
``except Exception`` cannot swallow it. The limit: a worker blocked inside native code (a
deadlocked kernel, a C call that waits) cannot be stopped. It is abandoned (a daemon thread, so it
cannot keep the process alive), :class:`WorkerAbandoned` says so, and :func:`abandoned` tells the
worker, should it wake, to leave every shared object alone; the memory and CPU it holds stay taken
until it wakes or the process ends, which may disturb later numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..core.threads import raise_in

__all__ = ["StepTimeout", "WorkerAbandoned", "abandoned", "checkpoint", "run_with_deadline"]

T = TypeVar("T")

# How long a cancelled worker may take to unwind (close engines, record its failure).
GRACE_S = 10.0

# Per worker thread: the Event that says it was asked to stop (thread-local, not keyed by thread
# ident: idents are reused by later threads, which must not inherit a cancellation).
_local = threading.local()


class StepTimeout(BaseException):  # named for what happened, as KeyboardInterrupt is
    """A step ran past its ``timeout_s``: raised inside the step's worker to make it unwind."""


class WorkerAbandoned(Exception):
    """A timed-out worker did not stop within the grace period; it was left running."""


def checkpoint() -> None:
    """Raise :class:`StepTimeout` when called from a worker whose deadline has passed.

    The caller's code calls it before each stage and before it changes shared state, so a worker
    that wakes up after it was abandoned stops there (the asynchronous StepTimeout is raised at the
    worker's next Python instruction in principle, but CPython may deliver it much later)."""
    cancelled = getattr(_local, "cancelled", None)
    if cancelled is not None and cancelled.is_set():
        raise StepTimeout("the step ran past its deadline")


def abandoned() -> bool:
    """True in a worker that was abandoned: the waiting thread has recorded its failure and gone
    on, so the worker must leave every shared object alone."""
    flag = getattr(_local, "abandoned", None)
    return flag is not None and flag.is_set()


def run_with_deadline(fn: Callable[[], T], timeout_s: float | None, *, name: str = "step") -> T:
    """``fn()`` in a worker thread, waited for at most ``timeout_s`` seconds (None: inline, no limit).

    Returns what ``fn`` returned, or raises what it raised (SystemExit included: a step cannot
    end the run that way). Past the deadline the worker is cancelled (see the module docstring);
    if it unwinds in time, what it raised (usually StepTimeout) is raised here.

    Raises:
        WorkerAbandoned: the worker did not stop within the grace period.
    """
    if timeout_s is None:
        return fn()
    outcome: dict[str, Any] = {}
    cancelled, left, finished = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        _local.cancelled, _local.abandoned = cancelled, left
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which decides
            outcome["error"] = e
        finally:
            finished.set()

    worker = threading.Thread(target=work, name=f"fractal-opt {name}", daemon=True)
    worker.start()
    try:
        worker.join(timeout_s)
    except KeyboardInterrupt:  # Ctrl-C reaches only this thread: stop the worker too, then end the run
        _cancel(worker, cancelled, running=not finished.is_set())  # the interrupted join() makes the worker look stopped
        raise
    if worker.is_alive():
        _cancel(worker, cancelled)
        worker.join(min(GRACE_S, max(1.0, timeout_s)))
        if worker.is_alive():  # it stays cancelled: its next checkpoint raises
            left.set()
            raise WorkerAbandoned(f"timeout after {timeout_s:g} s (policy.timeout_s); the {name} did not stop (blocked in native code) "
                                  "and was left running: it may hold memory and CPU until the run ends")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _cancel(worker: threading.Thread, cancelled: threading.Event, *, running: bool | None = None) -> None:
    cancelled.set()
    raise_in(worker, StepTimeout, running=running)  # at the worker's next Python instruction; elsewhere the checkpoint alone
