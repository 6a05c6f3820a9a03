"""The live status line a run shows on stderr."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """A live status line on stderr (a plain line per update when stderr is not a terminal)."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.perf_counter() - self.t0:6.1f}s] {message}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:200])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self, message: str) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r\033[K")
        self(message)
        if self.enabled and self.tty:
            self.stream.write("\n")
