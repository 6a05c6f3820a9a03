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


def test_passes_json_carries_each_runtime_s_capabilities(capsys):
    """`fractal-opt passes --json` gives, under the runtime pass, each runtime's table: llama.cpp serves GGUF and exports to llama-server, vLLM takes a whole GPU."""
    assert main(["passes", "--json"]) == 0
    (runtime,) = [e for e in json.loads(capsys.readouterr().out) if e["name"] == "runtime"]
    caps = runtime["capabilities"]
    assert caps["llama_cpp"]["weights"] == "gguf" and caps["llama_cpp"]["export_targets"] == ["llama-server"]
    assert caps["vllm"]["whole_device"] == "accelerator" and "hardware.attention" in caps["vllm"]["refuses"]
    assert set(caps) == set(runtime["runtimes"])


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


def test_run_json_prints_a_summary_that_matches_the_trace(tiny_dir, small_recipe, tmp_path, capsys):
    """`fractal-opt run --json` prints one JSON object: each step's verdict as trace.json has it, and the files written."""
    recipe = small_recipe(tiny_dir, limit=2, max_new_tokens=4, repeats=1, warmup=0, passes={"application": [{"max_new_tokens": {"limit": 2}}]})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    trace = json.loads((out / "trace.json").read_text())
    assert [(s["pass"], s["status"], s["reason"]) for s in summary["steps"]] == [(s["pass"], s["status"], s["reason"]) for s in trace["steps"]]
    assert summary["final"]["status"] == trace["final"]["status"]
    assert str(out / "trace.json") in summary["files"] and summary["finished"] is True


def test_version_and_exit_codes_in_help(capsys):
    """`--version` prints the version and exits 0; `--help` documents the exit codes 0 / 1 / 2 / 130."""
    import fractal_opt

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fractal-opt {fractal_opt.__version__}"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out
    for code in ("0 ", "1 ", "2 ", "130"):
        assert f"  {code}" in out


def test_python_dash_m_runs_the_cli():
    """`python -m fractal_opt --version` works as a process (the package's __main__)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fractal_opt", "--version"], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("fractal-opt ")


def test_check_many_files_reports_each(tiny_dir, small_recipe, tmp_path, capsys):
    """`check a.yaml b.yaml`: each file is reported (valid or with all its problems); exit 2 when any is invalid."""
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(small_recipe(tiny_dir, passes={"hardware": ["dtype"]})))
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {tiny_dir}\nworkload: {{repeats: 0, max_new_tokens: -1}}\npasses:\n  hardware: [dtpe]\n")
    assert main(["check", str(good), str(bad)]) == 2
    captured = capsys.readouterr()
    assert f"{good}: valid" in captured.out
    assert "3 problems" in captured.err and "'repeats'" in captured.err and "'max_new_tokens'" in captured.err and "'dtpe'" in captured.err
    assert "2 files: 1 valid, 1 invalid." in captured.err
    assert main(["check", str(good), str(good)]) == 0


def test_check_json(tiny_dir, small_recipe, tmp_path, capsys):
    """`check --json` prints a machine-readable report: valid, per file its passes and the code it imports."""
    path = tmp_path / "ok.yaml"
    data = small_recipe(tiny_dir, passes={"hardware": ["dtype"]})
    data["quality"] = {"probes": ["mypkg.probes:score"], "allow_code": True}
    path.write_text(yaml.safe_dump(data))
    assert main(["check", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is True
    (entry,) = report["files"]
    assert entry["file"] == str(path) and entry["valid"] and entry["problems"] == []
    assert entry["imports"] == ["mypkg.probes:score"]
    assert entry["passes"] == [{"layer": "hardware", "pass": "dtype(dtype=bfloat16)"}]


def test_check_echoes_the_code_a_recipe_imports(tiny_dir, small_recipe, tmp_path, capsys):
    """A recipe with probes and allow_code is valid, and check says which code it would import (without importing it)."""
    data = small_recipe(tiny_dir)
    data["quality"] = {"probes": ["surely_not_installed_pkg:probe"], "allow_code": True}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["check", str(path)]) == 0
    assert "this recipe imports and runs: surely_not_installed_pkg:probe" in capsys.readouterr().out


def test_passes_json_and_machine_only_reasons(monkeypatch, capsys):
    """`passes --json` lists every pass; on a CPU without bf16 units and no GPU, matmul_precision is unavailable with the reason."""
    from fractal_opt.core.machine import Machine
    from fractal_opt.testing import cpu_machine

    monkeypatch.setattr(Machine, "probe", classmethod(lambda cls, *a, **k: cpu_machine()))
    assert main(["passes", "--json"]) == 0
    entries = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    assert set(entries) == set(registry())
    mp = entries["matmul_precision"]
    assert mp["available"] is False and "bf16" in mp["unavailable"] and "no CUDA GPU" in mp["unavailable"]
    assert {p["name"] for p in mp["params"]} == {"precision"}
    assert entries["dtype"]["available"] is True and entries["dtype"]["unavailable"] is None
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    assert "not available here: lower matmul precision needs TF32" in out


def test_schema_validates_shipped_recipes_and_refuses_a_bad_one(capsys):
    """`fractal-opt schema` prints a valid draft 2020-12 JSON Schema; every shipped recipe satisfies it
    (checked with the jsonschema package), and recipes with a misspelled pass, a wrong type or an
    out-of-range number do not."""
    from pathlib import Path

    import jsonschema

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    shipped = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
    assert shipped
    for path in shipped:
        errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
        assert not errors, f"{path.name}: {errors}"
    for bad in (
        {"model": "m", "passes": {"hardware": [{"dtpe": {}}]}},
        {"model": "m", "workload": {"repeats": "three"}},
        {"model": "m", "workload": {"max_new_tokens": 100_000_000_000}},
        {"model": "m", "passes": {"model": [{"quantize": {"bitz": 8}}]}},
        {"workload": {}},
        {"model": "m", "workloda": {}},
        {"model": "m", "version": 99},
    ):
        assert not validator.is_valid(bad), bad


def test_schema_covers_every_pass_and_top_level_key():
    """The schema is built from the registry and the recipe's keys: every pass and every top-level key is in it."""
    from fractal_opt.language.recipe import TOP_LEVEL
    from fractal_opt.language.schema import recipe_schema

    schema = recipe_schema()
    assert list(schema["properties"]) == list(TOP_LEVEL)
    text = json.dumps(schema["properties"]["passes"])
    for name in registry():
        assert f'"{name}"' in text, name


def test_tune_writes_a_recipe_that_searches_and_refuses_bad_input_first(tmp_path, capsys):
    """tune's recipe searches the hardware and model layers within the budget and loads as written;
    a bad budget or an unknown model exits 2 before anything is written."""
    from fractal_opt.cli.tune import tune_recipe
    from fractal_opt.language.recipe import load_recipe

    recipe = load_recipe(tune_recipe("smollm2-135m-instruct", suite="default", budget_s=360.0))
    assert [(p.name, p.layer.section) for p in recipe.passes] == [("search", "hardware"), ("search", "model")]
    assert recipe.workload.budget_s == 360.0
    written = tmp_path / "tune.yaml"
    assert main(["tune", "smollm2-135m-instruct", "--budget", "six", "--recipe", str(written), "--out", str(tmp_path / "out")]) == 2
    assert main(["tune", str(tmp_path / "no-such-model"), "--recipe", str(written), "--out", str(tmp_path / "out")]) == 2
    assert not written.exists()
    assert "time budget" in capsys.readouterr().err
