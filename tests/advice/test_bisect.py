"""bisect: a deliberately bad pass planted in a run folder is found by rolling back halves (fake engine)."""

from __future__ import annotations

import json

import pytest

from fractal_opt.advice.bisect import bisect, bisect_run, load_run
from fractal_opt.core.errors import RecipeError
from fractal_opt.language.recipe import load_recipe
from fractal_opt.report.trace import Step, Trace
from fractal_opt.testing import FakeEngine, cpu_machine

# Four kept passes, one per plan field the fake engine can be told about.
KEPT = [
    ("hardware", "dtype", {"dtype": "bfloat16"}),
    ("hardware", "attention", {"implementation": "eager"}),
    ("model", "kv_cache", {"implementation": "static"}),
    ("application", "max_new_tokens", {"limit": 6}),
]


def _recipe_dict(model: str) -> dict:
    return {"model": model, "workload": {"suite": "default", "limit": 2, "max_new_tokens": 8, "repeats": 3, "warmup": 1},
            "policy": {"min_effect": 0.05}}


def _plant_run(folder, model: str) -> None:
    """A run folder whose trace kept the four passes above (as fractal-opt run writes it)."""
    recipe = load_recipe(_recipe_dict(model), check_model=False)
    trace = Trace(recipe=recipe.to_dict())
    trace.steps = [Step(pass_name=name, layer=layer, params=params, status="kept", reason="faster on the run's workload")
                   for layer, name, params in KEPT]
    trace.finished = True
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trace.json").write_text(trace.to_json(), encoding="utf-8")


@pytest.fixture
def run_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "fake"}', encoding="utf-8")
    _plant_run(tmp_path / "run", str(model))
    return tmp_path / "run"


def test_load_run_gives_the_kept_passes(run_dir):
    """A run folder's trace.json gives back the recipe of its kept passes, in the order kept."""
    recipe = load_run(run_dir)
    assert [p.name for p in recipe.passes] == ["dtype", "attention", "kv_cache", "max_new_tokens"]


def test_finds_the_planted_slow_pass(run_dir):
    """The static KV cache is made 3x slower on the fake engine: bisect names it and only it."""
    build = FakeEngine.factory(speed={"model.kv_cache": {"static": 1 / 3}})
    result = bisect_run(run_dir, build=build, machine=cpu_machine())
    assert len(result.culprits) == 1 and result.culprits[0].startswith("model/kv_cache(implementation=static"), result.to_text()
    assert result.full is not None and result.full.bad
    assert len(result.probes) <= 5  # the full plan + two halvings of two probes each
    text = result.to_text()
    assert "The culprit: model/kv_cache(implementation=static" in text and "BAD" in text


def test_finds_a_pair_that_hurts_only_together(run_dir):
    """bfloat16 alone and the static KV cache alone cost nothing; together decode is 3x slower
    (the field guide's "a compression plugin with a quantized KV cache"). Both are named."""
    from fractal_opt.testing import FakeEngine as FE

    base_build = FE.factory()

    def build(plan, **kw):
        both = plan.hardware.dtype == "bfloat16" and plan.model.kv_cache == "static"
        engine = base_build(plan, **kw)
        if both:
            engine.per_token_s *= 3  # slow only together
        return engine

    result = bisect_run(run_dir, build=build, machine=cpu_machine())
    assert [c.split("(")[0] for c in result.culprits] == ["hardware/dtype", "model/kv_cache"], result.to_text()
    assert "pair" in result.to_text()


def test_nothing_to_bisect_when_the_plan_is_not_worse(run_dir):
    """A full plan no worse than the baseline is not bisected: one probe, and the note says so."""
    result = bisect_run(run_dir, build=FakeEngine.factory(), machine=cpu_machine())
    assert result.culprits == [] and "nothing to bisect" in result.note
    assert len(result.probes) == 1


def test_not_a_run_folder(tmp_path):
    """A folder without trace.json is refused, naming what is missing."""
    with pytest.raises(RecipeError, match="no trace.json"):
        load_run(tmp_path)


def test_unknown_metric_names_the_closest(run_dir):
    """A misspelt --metric fails naming the closest valid metric."""
    with pytest.raises(RecipeError, match="Did you mean 'e2e_ms'"):
        bisect(load_run(run_dir), metric="e2e_msec", build=FakeEngine.factory(), machine=cpu_machine())


def test_result_serializes(run_dir):
    """The bisect result is plain JSON: the culprit eager attention (0.3x) and the bad full plan survive json.dumps."""
    result = bisect_run(run_dir, build=FakeEngine.factory(speed={"hardware.attention": {"eager": 0.3}}), machine=cpu_machine())
    data = json.loads(json.dumps(result.to_dict()))
    assert data["culprits"] == ["hardware/attention(implementation=eager)"] and data["probes"][0]["bad"]


def test_another_workload_is_measured(run_dir):
    """--workload: the kept passes are measured on another suite (here the packaged chat suite)."""
    build = FakeEngine.factory(speed={"model.kv_cache": {"static": 1 / 3}})
    result = bisect_run(run_dir, workload="chat", build=build, machine=cpu_machine())
    assert result.culprits and result.culprits[0].startswith("model/kv_cache")
    with pytest.raises(RecipeError):
        bisect_run(run_dir, workload="no-such-suite", build=build, machine=cpu_machine())
