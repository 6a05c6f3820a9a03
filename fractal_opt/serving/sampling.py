"""Per-request sampling: a request's own ``temperature`` / ``top_p`` / ``seed`` on top of the plan's decoding.

A request may leave any of the three out (the plan's value, and the server's seed, apply). What a
runtime decodes with is :func:`decoding`: temperature 0 means greedy, a temperature above 0 samples
even on a greedy plan, ``top_p`` only matters when sampling, and ``seed`` only when sampling.
Two tickets with the same :func:`decoding` can share one padded ``generate`` call; tickets that
differ are served in separate batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.errors import BadRequest

__all__ = ["SEED_MAX", "SEED_MIN", "Decoding", "Sampling", "check", "decoding", "differs"]

# A seed is a signed 64-bit integer, what OpenAI's API, vLLM and torch.manual_seed take; the
# llama.cpp runtime maps it onto llama.cpp's 32-bit seeds (runtimes/llama_cpp/settings.py).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Sampling:
    """A request's own sampling fields; None takes the plan's value (the server's seed for ``seed``)."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None

    @property
    def empty(self) -> bool:
        return self.temperature is None and self.top_p is None and self.seed is None


@dataclass(frozen=True)
class Decoding:
    """What one request is decoded with. Greedy: ``do_sample`` False and every other field None."""

    do_sample: bool
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None


def check(temperature: Any = None, top_p: Any = None, seed: Any = None) -> Sampling:
    """The checked fields as a :class:`Sampling`.

    Raises:
        BadRequest: naming the field, the value and what is allowed.
    """
    if temperature is not None and (not _is_number(temperature) or not 0 <= temperature <= 2):
        raise BadRequest("temperature", f"'temperature': got {temperature!r}, expected a number in [0, 2] (0: greedy).")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise BadRequest("top_p", f"'top_p': got {top_p!r}, expected a number in (0, 1].")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX):
        raise BadRequest("seed", f"'seed': got {_show(seed)}, expected an integer in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit integer).")
    return Sampling(None if temperature is None else float(temperature), None if top_p is None else float(top_p), seed)


def decoding(app: Any, sampling: Sampling, *, seed: int) -> Decoding:
    """The decoding of a request with ``sampling`` on a plan whose application section is ``app``
    (``seed``: the server's seed, used when the request sends none)."""
    temperature = app.temperature if sampling.temperature is None and app.do_sample else sampling.temperature
    if temperature is None or temperature == 0:
        return Decoding(do_sample=False)
    top_p = sampling.top_p if sampling.top_p is not None else (app.top_p if app.do_sample else 1.0)
    # A greedy plan asked to sample: plain temperature (+ top_p) sampling, no plan top_k / min_p.
    top_k, min_p = (app.top_k, app.min_p) if app.do_sample else (None, None)
    return Decoding(True, temperature, top_p, top_k, min_p, sampling.seed if sampling.seed is not None else seed)


def differs(app: Any, sampling: Sampling, *, seed: int) -> str | None:
    """The first field of ``sampling`` that changes the decoding from the plan's (with the server's seed), or None."""
    plan = decoding(app, Sampling(), seed=seed)
    if decoding(app, sampling, seed=seed) == plan:
        return None
    given = [name for name in ("temperature", "top_p", "seed") if getattr(sampling, name) is not None]
    alone = [name for name in given if decoding(app, Sampling(**{name: getattr(sampling, name)}), seed=seed) != plan]
    return (alone or given)[0]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:40]}...{text[-20:]} ({len(text)} characters)"
