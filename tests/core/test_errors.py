"""The error tree: an app catches every deliberate error as FractalOptError, and the standard bases still work."""

from __future__ import annotations

import pytest

from fractal_opt.core import errors
from fractal_opt.core.errors import (
    BadRequest,
    EngineError,
    FractalOptError,
    ModelSourceError,
    RecipeError,
    RequestRejected,
    ResumeError,
    RunFailed,
    closest,
)


@pytest.mark.parametrize(("error", "parent"), [(RecipeError, FractalOptError), (ResumeError, RecipeError), (BadRequest, RecipeError), (ModelSourceError, FractalOptError),
                                               (EngineError, FractalOptError), (RequestRejected, EngineError), (RunFailed, EngineError)])
def test_each_error_sits_where_the_docstring_draws_it(error, parent):
    """The tree in the module docstring is the tree of classes, and each class is named in it."""
    assert issubclass(error, parent) and error.__name__ in errors.__doc__


def test_bad_input_is_a_value_error_and_a_failed_build_a_runtime_error():
    """Code that catches ValueError or RuntimeError, as apps already do, catches recipe and engine errors too."""
    with pytest.raises(ValueError):
        raise RecipeError("bad")
    with pytest.raises(RuntimeError):
        raise RunFailed("the baseline failed")


def test_closest_suggests_a_near_name_and_nothing_for_a_far_one():
    """A typo gets "Did you mean"; a name close to nothing gets no suggestion at all."""
    assert closest("decode_token_per_s", ["decode_tokens_per_s", "ttft_ms"]) == " Did you mean 'decode_tokens_per_s'?"
    assert closest("zzz", ["decode_tokens_per_s", "ttft_ms"]) == ""
