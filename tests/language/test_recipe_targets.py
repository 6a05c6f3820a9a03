"""Targets as recipe vocabulary: known metric names, positive finite numbers, a YAML round trip."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.language.recipe import dump_recipe, load_recipe
from fractal_opt.language.targets import Target


def test_unknown_metric_names_the_closest():
    """A misspelt metric fails naming it and the closest valid name."""
    with pytest.raises(RecipeError, match=r"unknown metric 'decode_token_per_s'.*Did you mean 'decode_tokens_per_s'"):
        load_recipe({"model": "org/some-model", "targets": {"decode_token_per_s": 30}})


@pytest.mark.parametrize("value", [0, -3, float("inf"), float("nan"), "fast", True, None])
def test_a_target_is_a_positive_finite_number(value):
    """Zero, negatives, infinities, NaN, strings, booleans and null are refused naming the field and what is allowed."""
    with pytest.raises(RecipeError, match=r"targets\.ttft_ms_p90: got .*positive finite number"):
        load_recipe({"model": "org/some-model", "targets": {"ttft_ms_p90": value}})


def test_targets_must_be_a_mapping():
    """A list instead of {metric: number} is refused with an example of the right form."""
    with pytest.raises(RecipeError, match="expected a mapping of metric -> number"):
        load_recipe({"model": "org/some-model", "targets": [30]})


def test_targets_survive_a_yaml_round_trip():
    """Targets written out with the recipe load back equal."""
    targets = {"decode_tokens_per_s": 30, "ttft_ms_p90": 800, "peak_memory_mb": 8000, "throughput_tokens_per_s": 200}
    recipe = load_recipe({"model": "org/some-model", "targets": targets})
    again = load_recipe(dump_recipe(recipe))
    assert again.targets == recipe.targets
    assert again.targets.to_dict() == {k: float(v) for k, v in targets.items()}


def test_a_gap_reads_in_the_metrics_own_direction():
    """Tokens/s short of a target and milliseconds over one are both unmet; a value past the target is met with its ratio."""
    assert Target("decode_tokens_per_s", 30.0).gap(7.9)["text"] == "7.9 vs 30: 3.8x short"
    assert Target("ttft_ms_p90", 800.0).gap(1600.0)["text"] == "1600 vs 800: 2.0x over"
    met = Target("peak_memory_mb", 8000.0).gap(4000.0)
    assert met["met"] and met["ratio"] == 2.0 and met["text"] == "4000 vs 8000: met (2.0x)"
