"""The doctor's recipe checks: a runtime a recipe switches to that cannot run here is a warning naming it and why."""

from __future__ import annotations

from conftest import small_recipe_dict

from fractal_opt.advice.recipe_checks import OK, WARN, runtimes_check
from fractal_opt.language.recipe import load_recipe
from fractal_opt.testing import cpu_machine, fake_model_folder


def test_a_recipe_switching_to_an_unavailable_runtime_is_warned_about(tmp_path, monkeypatch):
    """A runtime pass to vLLM where none is found: WARN naming vllm and the runtime's own reason; without it: OK naming the runtimes."""
    from fractal_opt.runtimes import RUNTIMES

    monkeypatch.setattr(RUNTIMES, "availability", lambda machine: {"transformers": None, "llama_cpp": None, "vllm": "no vLLM found"})
    model = fake_model_folder(tmp_path / "m")
    switching = load_recipe(small_recipe_dict(model, passes={"hardware": [{"runtime": {"backend": "vllm"}}]}), check_model=False)
    check = runtimes_check(switching, cpu_machine())
    assert check.verdict == WARN and "vllm: no vLLM found" in check.found and "1 of the recipe's 2 runtimes" in check.found
    plain = runtimes_check(load_recipe(small_recipe_dict(model), check_model=False), cpu_machine())
    assert plain.verdict == OK and "(transformers)" in plain.found
