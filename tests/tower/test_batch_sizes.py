"""llama.cpp's batch sizes: a pair llama.cpp would silently change is refused with the fix."""

from __future__ import annotations

import pytest

from fractal_opt.tower.batch_sizes import N_BATCH_DEFAULT, batch_problems


def test_sizes_llama_cpp_runs_as_given_have_no_problem():
    """Defaults, a ubatch equal to the batch and a ubatch below it are all run as written."""
    assert batch_problems(None, None) == {}
    assert batch_problems(512, 512) == {}
    assert batch_problems(1024, 256) == {}
    assert batch_problems(None, N_BATCH_DEFAULT) == {}


def test_a_ubatch_over_the_batch_names_both_and_the_fix():
    """n_ubatch > n_batch would silently run min(n_batch, n_ubatch): the problem says what would run and how to fix it."""
    problem = batch_problems(256, 512)["n_ubatch"]
    assert problem.startswith("exceeds n_batch=256 and llama.cpp needs n_ubatch <= n_batch")
    assert "it would silently run 256" in problem and "raise n_batch to at least 512" in problem


def test_a_ubatch_over_the_default_batch_names_the_default():
    """Without n_batch, the ubatch is checked against llama.cpp's default of 2048 and the message says so."""
    problem = batch_problems(None, 4096)["n_ubatch"]
    assert "llama.cpp's default n_batch of 2048" in problem and "silently run 2048" in problem


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "512"])
def test_a_size_that_is_not_a_token_count_is_named(bad):
    """Zero, negatives, fractions, booleans and strings are not token counts; the field is named."""
    assert batch_problems(bad, None) == {"n_batch": "is not a token count >= 1 (or null: llama.cpp's default)"}
    assert set(batch_problems(512, bad)) == {"n_ubatch"}
