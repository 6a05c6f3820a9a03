"""The fractal-opt command: exit codes, readable errors, and a full run on the tiny model."""

from __future__ import annotations

import json

import yaml

from fractal_opt.cli import main
from fractal_opt.layers import registry


def test_check_bad_recipe_exits_2_without_traceback(tiny_dir, tmp_path, capsys):
    """`fractal-opt check` on an invalid recipe returns 2 and prints what is wrong (no traceback)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {tiny_dir}\npasses:\n  hardware: [{{dtpe: {{dtype: bfloat16}}}}]\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "invalid input" in err and "'dtpe'" in err and "Did you mean 'dtype'?" in err
    assert "Traceback" not in err


def test_check_missing_file_exits_2(tmp_path, capsys):
    """`fractal-opt check` on a path that does not exist returns 2 and names the path."""
    missing = tmp_path / "nope.yaml"
    assert main(["check", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "Traceback" not in err


def test_check_good_recipe(tiny_dir, small_recipe, tmp_path, capsys):
    """`fractal-opt check` on a valid recipe returns 0 and lists its passes."""
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(small_recipe(tiny_dir, passes={"hardware": ["dtype"]})))
    assert main(["check", str(path)]) == 0
    assert "dtype(dtype=bfloat16)" in capsys.readouterr().out


def test_check_unknown_model_exits_2(tmp_path, capsys):
    """`fractal-opt check` with a model that is neither a path nor a known name returns 2 and lists the embedded models."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: smollm2-135m-instruc\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "smollm2-135m-instruct" in err and "Traceback" not in err


def test_passes_lists_every_registered_pass(capsys):
    """`fractal-opt passes` lists every registered pass name under its layer."""
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    for name in registry():
        assert name in out, f"pass {name!r} missing from `fractal-opt passes`"
    for layer in ("hardware", "model", "scheduling", "application"):
        assert layer in out


def test_passes_says_which_runtimes_run_here(capsys, monkeypatch, tmp_path):
    """Under the runtime pass, `fractal-opt passes` names every runtime and why one cannot run here."""
    from fractal_opt.runtimes.vllm import process

    monkeypatch.delenv("FRACTAL_OPT_VLLM", raising=False)
    monkeypatch.delenv("FRACTAL_OPT_VLLM_URL", raising=False)
    monkeypatch.setattr(process, "default_executable", lambda: tmp_path / "no-vllm" / "bin" / "vllm")
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    assert "transformers  runs here" in out
    assert "vllm          not here: the vllm runtime found no vLLM" in out and "setup-vllm" in out


def test_run_writes_results(tiny_dir, small_recipe, tmp_path, capsys):
    """`fractal-opt run RECIPE --out DIR --quiet` returns 0 and writes trace.json, report.md and recipe.yaml."""
    recipe = small_recipe(tiny_dir, limit=2, max_new_tokens=4, repeats=1, warmup=0, passes={"application": [{"max_new_tokens": {"limit": 2}}]})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0
    for name in ("trace.json", "report.md", "recipe.yaml"):
        assert (out / name).is_file(), name
    trace = json.loads((out / "trace.json").read_text())
    assert [s["pass"] for s in trace["steps"]] == ["max_new_tokens"]
    captured = capsys.readouterr()
    assert "max_new_tokens" in captured.out and "Wrote" in captured.out
    assert "baseline" not in captured.err and "measuring" not in captured.err, "--quiet still printed the progress line"
