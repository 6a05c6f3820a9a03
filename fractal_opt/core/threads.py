"""Threads that end with their work, and raising an exception inside another thread.

:func:`in_own_thread` runs a call on a thread that ends when it returns. Why: torch and llama.cpp
share one OpenMP runtime (libgomp), which keeps a pool of worker threads for every live thread that
ran a parallel region and, once those outnumber the cores, cuts every thread's spin-wait between
kernels to almost nothing (docs/runtimes.md, "torch shares that OpenMP runtime"). A thread that
ends frees its pool, so the measurement serves each round on one, and the pipeline builds engines
and scores quality on one: no workers outlive them to throttle the rounds after.

:func:`raise_in` is CPython's ``PyThreadState_SetAsyncExc``, in one place. The pipeline's step
deadline uses it to stop a worker past ``policy.timeout_s``; :func:`in_own_thread` uses it to pass
that stop on to the thread it is waiting for. The exception arrives at the thread's next Python
instruction; a thread blocked in native code sees it only once it returns to Python.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["in_own_thread", "raise_in"]


def in_own_thread(fn: Callable[..., Any], *args: Any, name: str = "fractal-opt-round") -> Any:
    """``fn(*args)`` on a new thread (named ``name``) that ends when it returns; its result or its
    exception. An exception raised into the calling thread while it waits (a step timeout, Ctrl-C)
    is raised in the new thread too, and then re-raised here."""
    out: list[Any] = []
    error: list[BaseException] = []
    finished = threading.Event()  # the thread's own word: an interrupted join() makes it look stopped (raise_in)

    def work() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 (re-raised on the calling thread)
            error.append(e)
        finally:
            finished.set()

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            # Short waits, not one join(): the calling thread runs Python between them, so an
            # exception raised into it asynchronously (the pipeline's step timeout) arrives here.
            thread.join(0.05)
    except BaseException as e:
        raise_in(thread, type(e), running=not finished.is_set())  # and stops the thread's own Python code the same way
        raise
    if error:
        raise error[0]
    return out[0]


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
