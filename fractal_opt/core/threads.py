"""Raising an exception inside another thread: CPython's ``PyThreadState_SetAsyncExc``, in one place.

The pipeline's step deadline uses it to stop a worker past ``policy.timeout_s``; the measurement
uses it to pass that stop on to the round it is waiting for. The exception arrives at the thread's
next Python instruction; a thread blocked in native code sees it only once it returns to Python.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["raise_in"]


def raise_in(thread: threading.Thread, kind: type[BaseException], *, running: bool | None = None) -> None:
    """Raise ``kind`` in ``thread`` at its next Python instruction (CPython; elsewhere a no-op).

    ``running``: whether the thread's own code is still running, when the caller knows better than
    ``thread.is_alive()``. An exception that interrupts ``thread.join()`` makes the joined thread
    look stopped though it still runs (CPython's ``_wait_for_tstate_lock`` releases its lock on any
    exception, the fix of bpo-45274 for Ctrl-C), so a caller that was interrupted while joining
    must say whether the thread finished."""
    if not (thread.is_alive() if running is None else running) or thread.ident is None:
        return
    try:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(kind))
    except (AttributeError, TypeError, ValueError):  # not CPython: the caller's own checks alone
        pass
