"""raise_in: an exception raised inside another thread stops Python code there at its next instruction."""

from __future__ import annotations

import threading
import time

from fractal_opt.core.threads import raise_in


class Stop(Exception):
    """What the test raises in its worker."""


def test_a_spinning_thread_is_stopped_by_the_raised_exception():
    """A thread in a pure-Python loop ends with the exception raised in it, within a second."""
    seen: list[BaseException] = []

    def spin():
        try:
            while True:
                pass
        except Stop as e:
            seen.append(e)

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    time.sleep(0.05)
    raise_in(worker, Stop)
    worker.join(5)
    assert not worker.is_alive() and len(seen) == 1 and isinstance(seen[0], Stop)


def test_a_finished_or_unstarted_thread_is_left_alone():
    """Raising in a thread that has ended, or never started, does nothing and raises nothing here."""
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    raise_in(done, Stop)
    raise_in(threading.Thread(target=lambda: None), Stop)
