"""Attention heads read from a model's files, and the tensor-parallel degrees they allow."""

from __future__ import annotations

import json

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.language.recipe import parse_recipe
from fractal_opt.weights.heads import attention_heads, divides_heads, tensor_parallel_problem
from fractal_opt.weights.models import resolve


@pytest.mark.parametrize(("heads", "kv", "degree", "ok"), [(9, 3, 3, True), (9, 3, 2, False), (32, 8, 4, True), (32, 8, 16, True), (32, 6, 4, False)])
def test_a_degree_must_divide_the_heads_and_fit_the_kv_heads(heads, kv, degree, ok):
    """vLLM's rule: the degree divides the query heads; the KV heads are divisible by it or divide it."""
    assert (divides_heads(heads, kv, degree) is None) is ok


def test_the_embedded_model_has_nine_heads_which_two_does_not_divide():
    """SmolLM2-135M's GGUF header says 9 heads / 3 KV heads: tensor parallel 2 is refused with the degrees that work."""
    assert attention_heads(resolve("smollm2-135m-instruct")) == (9, 3)
    assert "9 attention heads" in tensor_parallel_problem("smollm2-135m-instruct", 2) and "[1, 3, 9]" in tensor_parallel_problem("smollm2-135m-instruct", 2)
    assert tensor_parallel_problem("smollm2-135m-instruct", 3) is None


def test_a_folder_s_config_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 12, "num_key_value_heads": 4}))
    assert attention_heads(resolve(str(tmp_path))) == (12, 4)


def test_the_recipe_check_refuses_a_split_the_heads_refuse():
    """fractal-opt check refuses tensor parallel 2 on the embedded model from its header alone, naming the pass."""
    data = {"model": "smollm2-135m-instruct", "passes": {"hardware": [{"runtime": {"backend": "vllm"}}, {"split": {"tensor": 2}}]}}
    with pytest.raises(RecipeError, match=r"split\(.*tensor=2\).*9 attention heads"):
        parse_recipe(data)


def test_the_vllm_runtime_refuses_the_split_before_starting_anything():
    """A tensor-parallel plan the heads refuse is the vllm runtime's refusal too (the runner skips the step before any round)."""
    from fractal_opt.layers.hardware import Runtime
    from fractal_opt.layers.placement import Split
    from fractal_opt.runtimes.vllm.engine import VllmEngine
    from fractal_opt.tower.plan import Plan

    plan = Split(tensor=2).apply(Runtime(backend="vllm").apply(Plan(source="smollm2-135m-instruct")))
    assert "hardware.tensor_parallel=2: the model has 9 attention heads" in VllmEngine.refuse(plan)
    assert VllmEngine.refuse(Split(tensor=3).apply(Runtime(backend="vllm").apply(Plan(source="smollm2-135m-instruct")))) is None
