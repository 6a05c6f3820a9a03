"""Errors raised by fractal_opt.

Every error is a :class:`FractalOptError`, so an app can catch them all in one place::

    FractalOptError
    ├── RecipeError          bad recipe / pass / plan input, raised before any model is loaded
    │   ├── ResumeError      the output folder holds another run, or a run that cannot be resumed
    │   └── BadRequest       one request's field the server cannot take (HTTP 400; ``param`` names it)
    ├── ModelSourceError     the model cannot be found or installed (says how to get it)
    └── EngineError          building or serving a plan failed
        ├── RequestRejected  the engine refused a request (over the context cap, queue full)
        └── RunFailed        the baseline failed, so the run ended (its trace.json says why)
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "BadRequest",
    "EngineError",
    "FractalOptError",
    "ModelSourceError",
    "RecipeError",
    "RequestRejected",
    "ResumeError",
    "RunFailed",
    "closest",
]


class FractalOptError(Exception):
    """Base class of every error fractal_opt raises on purpose."""


class RecipeError(FractalOptError, ValueError):
    """A recipe, pass or plan value is invalid. Raised before any model is loaded."""


class ResumeError(RecipeError):
    """The output folder holds another run (and neither resume nor force was asked for), or the
    run there cannot be resumed (its fingerprint differs: the message says what changed).
    Raised before any model is loaded, so the folder's files are left as they were."""


class BadRequest(RecipeError):
    """One request's field that the server cannot take: ``param`` names it (``messages[1].content``,
    ``temperature``), the message the value and what is allowed. The HTTP endpoint answers it with
    a 400 and OpenAI's error body; ``Server.submit`` raises it for a sampling value out of range or
    one its scheduler cannot honour per request. ``code`` is OpenAI's machine-readable reason
    where one applies (``context_length_exceeded``)."""

    def __init__(self, param: str, message: str, *, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ModelSourceError(FractalOptError):
    """A model source cannot be resolved (not installed, not found)."""


class EngineError(FractalOptError, RuntimeError):
    """Building or serving a plan failed."""


class RequestRejected(EngineError):
    """The engine refused a request (for example a prompt over the context cap)."""


class RunFailed(EngineError):
    """The run could not go on: its baseline failed (a build, a measurement or a probe raised, or
    it ran past ``policy.timeout_s``). The output folder's trace.json records the failure."""


def closest(name: str, valid: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest valid name, or ``""`` when none is close."""
    matches = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.5)
    return f" Did you mean {matches[0]!r}?" if matches else ""
