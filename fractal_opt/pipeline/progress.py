"""The live status line a run shows on stderr: the step, the time so far and an estimate of the rest."""

from __future__ import annotations

import re
import shutil
import sys
import time

__all__ = ["Progress"]

# The runner starts each step's messages with "[index/total]" (a search's sub-steps may add more
# inside the brackets); the step count and the ETA are read from it.
_STEP = re.compile(r"^\[(\d+)/(\d+)\b")


class Progress:
    """A live status line on stderr (a plain line per update when stderr is not a terminal).

    Each line shows the elapsed time and, once a step has finished, an estimate of the time left:
    the mean time of the finished steps times the steps still to run, less the time the current
    step has taken so far, but never less than the mean for the steps after it (the baseline and
    its A/A calibration are not counted as a step), and never more than what is left of the run's
    time budget (``budget_s``, shown beside it). The estimate is hand-rolled rather than tqdm's because
    the runner reports messages, not iterations, and a step's messages arrive from several places.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> p = Progress(stream=out)
        >>> p("[1/4] hardware/dtype(dtype=bfloat16): building")
        >>> "step 1/4" in out.getvalue()
        True
    """

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._step: tuple[int, int] | None = None  # (index, total) of the step under way
        self._step_t0: float | None = None  # when the first step began (the baseline's time excluded)
        self._current_t0: float | None = None  # when the step under way began
        self.budget_s: float | None = None  # the run's time budget (the runner sets it): the line shows what is left of it

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left by the mean pace of the finished steps; None before one finished."""
        if self._step is None or self._step_t0 is None:
            return None
        index, total = self._step
        done = index - 1
        if done < 1:
            return None
        now = time.perf_counter() if now is None else now
        current_t0 = self._current_t0 if self._current_t0 is not None else now
        per_step = (current_t0 - self._step_t0) / done  # finished steps only: a partial step does not inflate the mean
        in_step = now - current_t0
        return max(per_step * (total - done) - in_step, per_step * (total - index), 0.0)

    def status(self, message: str) -> str:
        """The line for ``message``: elapsed time, step count and ETA, then the message."""
        now = time.perf_counter()
        if m := _STEP.match(message):
            index, total = int(m.group(1)), int(m.group(2))
            if self._step_t0 is None:
                self._step_t0 = now
            if self._step is None or self._step[0] != index:
                self._current_t0 = now
            self._step = (index, total)
            rest = message[m.end():]
            message = rest[1:].lstrip() if rest.startswith("]") else message  # "[4/6] x" -> "x"; a sub-step's label stays whole
        elif self._step and self._step[0] == self._step[1]:  # after the last step (the final confirmation): no step, no ETA
            self._step = None
        head = f"[{_clock(now - self.t0)}"
        budget_left = None if self.budget_s is None else max(self.budget_s - (now - self.t0), 0.0)
        if self._step:
            head += f" · step {self._step[0]}/{self._step[1]}"
            left = self.eta(now)
            if left is not None and budget_left is not None:
                left = min(left, budget_left)  # the run stops at its budget: the ETA never runs past it
            head += f" · ETA {_clock(left)}" if left is not None else ""
        if budget_left is not None:
            head += f" · budget {_clock(budget_left)} left"
        return f"{head}] {message}"

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        line = self.status(message)
        if self.tty:
            width = shutil.get_terminal_size((120, 24)).columns
            self.stream.write("\r\033[K" + (line if len(line) < width else line[: width - 2] + "…"))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self, message: str) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r\033[K")
        self._step = None  # no ETA on the closing line
        self(message)
        if self.enabled and self.tty:
            self.stream.write("\n")


def _clock(seconds: float) -> str:
    """``42s``, ``3m05s`` or ``1h02m``."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
