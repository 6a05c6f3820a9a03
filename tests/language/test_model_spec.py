"""The recipe's model: key: a plain source, or a mapping that names the prompt form and whether
the folder's own code may run; both reach the baseline plan and survive a dump."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.language.model_spec import ModelSpec, parse_model
from fractal_opt.language.recipe import dump_recipe, load_recipe


def test_a_plain_source_and_a_mapping_give_the_same_model():
    """model: X and model: {source: X} are one model with the model's own template, no remote code."""
    assert parse_model("m", where="r") == parse_model({"source": "m"}, where="r") == ModelSpec(source="m")


def test_the_mapping_sets_the_baseline_plans_prompt_form_and_trust(tmp_path):
    """chat_template none / a .jinja file and trust_remote_code reach the base plan; a dump writes them back."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    recipe = load_recipe({"model": {"source": "tiny", "chat_template": str(template), "trust_remote_code": True}}, check_model=False)
    plan = recipe.base_plan()
    assert plan.application.chat_template == template.read_text() and plan.model.trust_remote_code
    assert load_recipe(dump_recipe(recipe), check_model=False).base_plan() == plan
    plain = load_recipe({"model": {"source": "tiny", "chat_template": "none"}}, check_model=False)
    assert plain.base_plan().application.chat_template == "none" and "chat_template: none" in dump_recipe(plain)
    assert dump_recipe(load_recipe({"model": {"source": "tiny"}}, check_model=False)).count("model: tiny") == 1


@pytest.mark.parametrize(("value", "needle"), [
    ({"source": "m", "chat_tempate": "none"}, "Did you mean 'chat_template'"),
    ({"chat_template": "none"}, "model.source"),
    ({"source": "m", "trust_remote_code": "yes"}, "expected true or false"),
    ({"source": "m", "chat_template": "missing.jinja"}, "not auto, none, an existing .jinja file"),
    ({"source": "m", "chat_template": "{{ ''.__class__.__mro__ }}"}, "sandbox"),
    (["m"], "expected a name or path"),
])
def test_a_bad_model_mapping_is_refused_naming_the_key(value, needle):
    """Unknown keys, a missing source, a non-boolean trust, a template that is neither a file nor a
    template, and one that leaves Jinja's sandbox: refused before any model loads."""
    with pytest.raises(RecipeError, match=needle):
        parse_model(value, where="recipe")
