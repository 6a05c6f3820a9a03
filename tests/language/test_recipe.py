"""Recipes: strict validation with helpful messages, round trips, tower order, shipped files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fractal_opt.core.errors import RecipeError
from fractal_opt.core.validate import RecipeProblems
from fractal_opt.language.recipe import Recipe, dump_recipe, load_recipe
from fractal_opt.layers.application import MaxNewTokens
from fractal_opt.layers.hardware import Dtype, Threads
from fractal_opt.layers.model import Quantize
from fractal_opt.testing import embedded_installed

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def _error(data, **kwargs) -> str:
    """The message load_recipe raises for ``data`` (model paths are not checked unless asked)."""
    kwargs.setdefault("check_model", False)
    with pytest.raises(RecipeError) as info:
        load_recipe(data, **kwargs)
    return str(info.value)


def _recipe(**extra):
    return {"model": "tiny", **extra}


def test_unknown_pass_suggests_closest():
    """An unknown pass 'dtpe' is named, the layer's passes are listed, and 'dtype' is suggested."""
    msg = _error(_recipe(passes={"hardware": [{"dtpe": {"dtype": "bfloat16"}}]}))
    assert "'dtpe'" in msg and "Did you mean 'dtype'?" in msg
    assert "threads" in msg  # the valid passes of the layer are listed


def test_unknown_parameter_suggests_closest():
    """An unknown pass parameter is named with the valid parameters and the closest one."""
    msg = _error(_recipe(passes={"model": [{"quantize": {"bitz": 8}}]}))
    assert "'bitz'" in msg and "Did you mean 'bits'?" in msg and "skip" in msg


def test_misspelled_choice_suggests_closest_value():
    """A misspelled choice 'bflaot16' names the field and value, lists the allowed values and suggests 'bfloat16'."""
    msg = _error(_recipe(passes={"hardware": [{"dtype": {"dtype": "bflaot16"}}]}))
    assert "'dtype'" in msg and "'bflaot16'" in msg and "'float16'" in msg and "Did you mean 'bfloat16'?" in msg


def test_string_where_int_expected():
    """A string where an int is expected names the field, the value and the expected type."""
    msg = _error(_recipe(passes={"scheduling": [{"batching": {"batch_size": "eight"}}]}))
    assert "'batch_size'" in msg and "'eight'" in msg and "expected int" in msg


def test_workload_string_where_int_expected():
    """A quoted number in the workload is refused (YAML '8' is a string), naming the key."""
    msg = _error(_recipe(workload={"max_new_tokens": "8"}))
    assert "max_new_tokens" in msg and "'8'" in msg and "int" in msg


def test_bool_is_not_an_int():
    """`true` is not accepted where a token count is expected."""
    msg = _error(_recipe(passes={"application": [{"max_new_tokens": {"limit": True}}]}))
    assert "'limit'" in msg and "True" in msg


def test_pass_under_wrong_layer_names_its_layer():
    """A pass listed under the wrong layer says which layer it belongs to and where to move it."""
    msg = _error(_recipe(passes={"hardware": [{"quantize": {"bits": 8}}]}))
    assert "'quantize' belongs to layer 'model'" in msg and "passes.model" in msg


def test_unknown_layer_suggests_closest():
    """A misspelled layer name lists the layers and suggests the closest."""
    msg = _error(_recipe(passes={"hardwre": [{"dtype": {}}]}))
    assert "'hardwre'" in msg and "Did you mean 'hardware'?" in msg


def test_unknown_top_level_key_suggests_closest():
    """An unknown top-level key lists the valid keys and suggests the closest."""
    msg = _error(_recipe(workloda={"max_new_tokens": 8}))
    assert "'workloda'" in msg and "Did you mean 'workload'?" in msg


def test_unknown_workload_suite_suggests_closest():
    """An unknown workload suite lists the packaged suites and suggests the closest."""
    msg = _error(_recipe(workload={"suite": "defualt"}))
    assert "'defualt'" in msg and "Did you mean 'default'?" in msg


def test_unknown_guard_metric_suggests_closest():
    """An unknown policy guard metric lists the metrics and suggests the closest."""
    msg = _error(_recipe(policy={"guards": {"kl_maen": {"max": 0.1}}}))
    assert "'kl_maen'" in msg and "Did you mean 'kl_mean'?" in msg


def test_guards_of_the_wrong_shape():
    """policy.guards given as a list is refused with a RecipeError naming the key, not a crash."""
    msg = _error(_recipe(policy={"guards": ["kl_mean"]}))
    assert "guards" in msg


def test_unknown_objective_suggests_closest():
    """An unknown policy objective suggests the closest metric."""
    msg = _error(_recipe(policy={"objective": "decode_tokens_per_sec"}))
    assert "Did you mean 'decode_tokens_per_s'?" in msg


def test_bad_yaml():
    """Text that is not valid YAML is a RecipeError that says so (no yaml traceback)."""
    msg = _error("model: tiny\npasses: [unclosed\n")
    assert "not valid YAML" in msg


def test_missing_model():
    """A recipe without a model says the key is missing and what it may be."""
    assert "missing key 'model'" in _error({"workload": {}})


def test_model_path_that_does_not_exist(tmp_path):
    """A model path that does not exist fails validation (before anything loads), naming the path."""
    missing = str(tmp_path / "nowhere")
    assert missing in _error({"model": missing}, check_model=True)


def test_duplicate_pass_refused():
    """The same pass with the same parameters listed twice is refused."""
    assert "listed twice" in _error(_recipe(passes={"hardware": ["dtype", "dtype"]}))


def test_bare_pass_name_uses_defaults():
    """A bare pass name means the pass with its default parameters."""
    recipe = load_recipe(_recipe(passes={"hardware": ["dtype"]}), check_model=False)
    assert recipe.passes == (Dtype(),)


def test_round_trip():
    """dump_recipe(load_recipe(x)) loads back to an equal Recipe."""
    text = """
name: round-trip
model: tiny
workload: {suite: default, max_new_tokens: 12, repeats: 2, limit: 3}
policy: {objective: auto, guards: {kl_mean: {max: 0.1}, ttft_ms: null}, min_effect: 0.05}
passes:
  hardware: [{threads: {count: 2}}, {dtype: {dtype: bfloat16}}]
  model: [{quantize: {bits: 8, skip: [lm_head, embed_tokens]}}]
  scheduling: [{batching: {mode: static, batch_size: 4}}]
  application: [{max_new_tokens: {limit: 24}}, {decoding: {strategy: sample, temperature: 0.7}}]
"""
    recipe = load_recipe(text, check_model=False)
    again = load_recipe(dump_recipe(recipe), check_model=False)
    assert again == recipe
    assert again.passes[2] == Quantize(bits=8, skip=("lm_head", "embed_tokens"))


def test_dump_to_file_round_trip(tmp_path):
    """A recipe written to a .yaml file loads back equal from the path."""
    recipe = load_recipe(_recipe(passes={"application": [{"max_new_tokens": {"limit": 5}}]}), check_model=False)
    path = tmp_path / "r.yaml"
    dump_recipe(recipe, path, header="# a header comment\n")
    assert path.read_text().startswith("# a header comment\n")
    assert load_recipe(path, check_model=False) == recipe


def test_plan_applies_passes_in_tower_order():
    """Recipe.plan() applies passes bottom up (hardware before application) whatever the YAML order."""
    text = """
model: tiny
passes:
  application: [{max_new_tokens: {limit: 7}}]
  model: [quantize]
  hardware: [{threads: {count: 1}}]
"""
    recipe = load_recipe(text, check_model=False)
    assert [p.name for p in recipe.passes] == ["threads", "quantize", "max_new_tokens"]
    plan = recipe.plan()
    assert plan.applied == ("threads", "quantize", "max_new_tokens")
    assert plan.hardware.threads == 1 and plan.model.weight_bits == 8 and plan.application.max_new_tokens == 7


def test_plan_keeps_recipe_order_within_a_layer():
    """Within one layer, passes run in the order the recipe lists them (the later one wins)."""
    recipe = load_recipe(_recipe(passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}, {"dtype": {"dtype": "float16"}}]}), check_model=False)
    assert recipe.plan().hardware.dtype == "float16"


def test_recipe_object_is_returned_as_is():
    """load_recipe(Recipe) returns the same object (no re-validation surprises)."""
    recipe = Recipe(model="tiny", passes=(Threads(count=1), MaxNewTokens(limit=3)))
    assert load_recipe(recipe) is recipe


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_validate(path):
    """Every recipe shipped in recipes/ validates (its model source too, when the embedded-model wheel is installed)."""
    recipe = load_recipe(path, check_model=embedded_installed())
    assert recipe.model


def test_dump_writes_only_what_differs_in_block_style():
    """recipe.yaml holds `version:` first, then only non-default values, in block style; default-parameter passes are bare names."""
    recipe = load_recipe(_recipe(workload={"max_new_tokens": 12}, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}, {"threads": {"count": 2}}]}),
                         check_model=False)
    text = dump_recipe(recipe)
    assert text.startswith("version: 1\n")
    data = yaml.safe_load(text)
    assert data == {"version": 1, "model": "tiny", "workload": {"max_new_tokens": 12}, "passes": {"hardware": ["dtype", {"threads": {"count": 2}}]}}
    assert "{" not in text and "[" not in text, f"flow style in:\n{text}"
    for noise in ("null", "max_repeats", "\n  load:", "stop:", "policy:", "quality:"):
        assert noise not in text, f"{noise!r} is a default and should not be written:\n{text}"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_survive_a_dump(path):
    """Every shipped recipe written by dump_recipe loads back equal."""
    recipe = load_recipe(path, check_model=False)
    assert load_recipe(dump_recipe(recipe), check_model=False) == recipe


def test_version_is_read():
    """`version: 1` loads; a newer version is refused with the version this fractal_opt reads and how to upgrade."""
    assert load_recipe(_recipe(version=1), check_model=False).model == "tiny"
    msg = _error(_recipe(version=2))
    assert "'version'" in msg and "format 2" in msg and "up to 1" in msg and "pip install -U fractal-opt" in msg
    assert "'version'" in _error(_recipe(version="1"))


def test_every_problem_is_reported_at_once():
    """One load reports every problem of the file, across sections and passes, not only the first."""
    with pytest.raises(RecipeProblems) as info:
        load_recipe(_recipe(workloda={}, workload={"repeats": 0, "warmup": "x"}, policy={"objective": "nope"},
                            passes={"hardware": ["dtpe", {"threads": {"count": -1}}], "modle": []}), check_model=False)
    problems = info.value.problems
    assert len(problems) == 7, problems
    for text in ("'workloda'", "'repeats'", "'warmup'", "'nope'", "'dtpe'", "'count'", "'modle'"):
        assert any(text in p for p in problems), text
    assert f"{len(problems)} problems" in str(info.value)


def test_every_numeric_parameter_is_bounded():
    """No pass parameter takes 1e20, infinity or a negative number: every numeric field has a range."""
    import dataclasses
    import typing

    from fractal_opt.core.validate import bounds
    from fractal_opt.layers import registry

    checked = 0
    for cls in registry().values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            allowed = bounds(cls, f, hints[f.name])
            if allowed is None:
                continue
            is_list = typing.get_origin(hints[f.name]) is tuple
            for value in (10**20, -1, float("inf"), float("nan")):
                with pytest.raises(RecipeError):
                    cls.from_params({f.name: [value] if is_list else value})
            checked += 1
    assert checked >= 30


def test_probes_need_an_explicit_opt_in():
    """quality.probes imports code: refused without quality.allow_code, accepted with it, and listed by Recipe.code()."""
    msg = _error(_recipe(quality={"probes": ["mypkg.mod:probe"]}))
    assert "mypkg.mod:probe" in msg and "allow_code: true" in msg
    recipe = load_recipe(_recipe(quality={"probes": ["mypkg.mod:probe"], "allow_code": True}), check_model=False)
    assert recipe.code() == ["mypkg.mod:probe"]
    assert load_recipe(_recipe(), check_model=False).code() == []


def test_non_finite_guard_limit_refused():
    """A guard limit of .nan or .inf is refused (a NaN limit never trips)."""
    assert "finite" in _error(_recipe(policy={"guards": {"kl_mean": {"max": float("nan")}}}))
