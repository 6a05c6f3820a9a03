"""Step labels in reports: the pass and only the parameters that differ from its defaults."""

from __future__ import annotations

from fractal_opt.layers.scheduling import Batching
from fractal_opt.report.labels import non_default_params, pass_label


def test_a_label_shows_the_first_parameter_and_the_changed_ones():
    """batching(mode=static, batch_size=6): the defaults the recipe did not change are left out."""
    params = Batching(mode="static", batch_size=6).params()
    assert len(params) > 2  # trace.json keeps every field; the label does not
    assert pass_label("batching", params) == "batching(mode=static, batch_size=6)"


def test_the_baseline_is_labelled_baseline():
    """The baseline row reads 'baseline', whatever its pass name and parameters."""
    assert pass_label("baseline", {"x": 1}, status="baseline") == "baseline"


def test_a_pass_not_installed_here_shows_every_parameter():
    """A trace from a plugin this machine lacks cannot know its defaults: every parameter is shown, none guessed."""
    params = {"level": 3, "fast": True}
    assert non_default_params("someone_elses_pass", params) == params
    assert pass_label("someone_elses_pass", params) == "someone_elses_pass(level=3, fast=True)"
