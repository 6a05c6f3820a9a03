"""TokenClock: the streamer that reads the clock as tokens are generated (the measurement's only
hook inside a runtime's generate loop). Timing rules are in :mod:`fractal_opt.measure.runner`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["TokenClock"]


class TokenClock:
    """A generate() streamer that only reads the clock: once for the prompt, once per new token.

    transformers calls ``put`` with the prompt ids first, then with each step's new token(s)
    (one per batch row), and ``end`` when done. ``sync`` (e.g. ``torch.cuda.synchronize``) runs
    before every reading so that asynchronous devices are timed when the work is really done.
    """

    def __init__(self, *, sync: Callable[[], None] | None = None):
        self.sync = sync
        self.prompt_time: float | None = None
        self.token_times: list[float] = []

    def put(self, value: Any) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        if self.prompt_time is None:
            self.prompt_time = now
        else:
            # Speculative decoding (prompt lookup, a draft model) hands over every accepted token
            # of a step at once, as a [1, k] tensor; each is a token available now, so the decode
            # rate stays (n - 1) / (t_last - t_first) over tokens. A plain step is [batch]: one.
            burst = value.shape[-1] if getattr(value, "ndim", 1) == 2 and value.shape[0] == 1 else 1
            self.token_times.extend([now] * burst)

    def end(self) -> None:
        pass
