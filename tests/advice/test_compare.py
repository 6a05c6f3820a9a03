"""compare: the plan diff, the recorded numbers, the targets each meets, and an interleaved re-measure."""

from __future__ import annotations

import pytest
import yaml

from fractal_opt.advice.compare import compare, load_side, plan_diff
from fractal_opt.core.errors import RecipeError
from fractal_opt.language.recipe import load_recipe
from fractal_opt.report.trace import Step, Trace
from fractal_opt.testing import FakeEngine, cpu_machine
from fractal_opt.tower.plan import Plan


def _recipe(model, passes=None, targets=None):
    data = {"model": str(model), "workload": {"suite": "default", "limit": 2, "max_new_tokens": 8, "repeats": 2, "warmup": 1}, "passes": passes or {}}
    if targets:
        data["targets"] = targets
    return data


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "fake"}', encoding="utf-8")
    return path


def _run_folder(folder, recipe_data, decode):
    recipe = load_recipe(recipe_data, check_model=False)
    trace = Trace(recipe=recipe.to_dict())
    trace.steps = [Step(pass_name=p.name, layer=p.layer.section, params=p.params(), status="kept", reason="") for p in recipe.passes]
    trace.final = {"plan": recipe.plan().to_dict(), "kept": [], "metrics": {"decode_tokens_per_s": decode, "peak_memory_mb": 900.0,
                                                                         "spread": {"decode_tokens_per_s": 0.04}}}
    folder.mkdir()
    (folder / "trace.json").write_text(trace.to_json(), encoding="utf-8")
    return folder


def test_plan_diff_lists_changed_fields_only():
    """plan_diff lists only the fields that differ, as (field, A, B)."""
    a = Plan(source="m")
    b = a.replace_section("hardware", dtype="bfloat16").replace_section("model", weight_bits=8)
    assert plan_diff(a, b) == [("hardware.dtype", "float32", "bfloat16"), ("model.weight_bits", None, 8)]


def test_two_runs_side_by_side_with_targets(tmp_path, model):
    """Two run folders side by side: the plan difference, each side's decode with its band, and which side meets the target."""
    targets = {"decode_tokens_per_s": 30}
    a = _run_folder(tmp_path / "a", _recipe(model, targets=targets), decode=12.0)
    b = _run_folder(tmp_path / "b", _recipe(model, {"hardware": [{"dtype": {"dtype": "bfloat16"}}]}, targets), decode=31.0)
    result = compare(a, b)
    text = result.to_text()
    assert "hardware.dtype  'float32' -> 'bfloat16'" in text
    assert "decode_tokens_per_s" in text and "31.0 ±4%" in text
    assert not result.targets["A"]["decode_tokens_per_s"]["met"] and result.targets["B"]["decode_tokens_per_s"]["met"]
    assert "Targets, B: decode_tokens_per_s 31 vs 30: met (1 of 1 met)" in text


def test_recipes_measured_interleaved(tmp_path, model):
    """Two recipes have no numbers; --measure builds both and measures B against A interleaved."""
    pa, pb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    pa.write_text(yaml.safe_dump(_recipe(model)), encoding="utf-8")
    pb.write_text(yaml.safe_dump(_recipe(model, {"hardware": [{"dtype": {"dtype": "bfloat16"}}]})), encoding="utf-8")
    result = compare(pa, pb, measure=True, build=FakeEngine.factory(speed={"hardware.dtype": {"bfloat16": 2.0}}), machine=cpu_machine())
    decode = next(r for r in result.measured if r.metric == "decode_tokens_per_s")
    assert decode.better and decode.change == pytest.approx(1.0, abs=0.1)
    assert "Measured here, interleaved" in result.to_text()


def test_neither_recipe_nor_run(tmp_path):
    """A folder that is neither a recipe nor a run folder is refused, naming the missing trace.json."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="no trace.json"):
        load_side(tmp_path / "empty")


def test_two_runs_list_their_pareto_set_across_both(tmp_path, model):
    """compare pools every plan both runs measured and names those on each frontier (A3 = run A's step 3)."""
    def folder(name, points):
        recipe = load_recipe(_recipe(model), check_model=False)
        trace = Trace(recipe=recipe.to_dict())
        base, *rest = [Step(pass_name=label, layer="-" if i == 0 else "scheduling", params={}, status="baseline" if i == 0 else "kept", reason="",
                            metrics={"throughput_tokens_per_s": tput, "ttft_ms_p90": ttft}) for i, (label, tput, ttft) in enumerate(points)]
        trace.baseline, trace.steps = base, rest
        trace.final = {"plan": recipe.plan().to_dict(), "kept": [], "metrics": {}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "trace.json").write_text(trace.to_json(), encoding="utf-8")
        return tmp_path / name

    a = folder("a", [("baseline", 10.0, 900.0), ("batching", 30.0, 1500.0)])
    b = folder("b", [("baseline", 9.0, 950.0), ("concurrency", 40.0, 1400.0)])
    result = compare(a, b)
    on = {i for i, _ in result.pareto()["throughput against TTFT p90"]}
    assert on == {"A0", "B1"}  # A1 is beaten by B1 on both; B0 by A0
    assert "Pareto set across both runs" in result.to_text() and result.to_dict()["pareto"]
