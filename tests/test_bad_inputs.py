"""Bad input is refused before work starts: exit 2, one message naming the file and the field, no
traceback, no weights loaded.

The corpus is tests/data/bad/ (recipes, suites, eval sets, model folders, GGUF files; its
README.md says how each was made). Every case runs in-process through ``fractal_opt.cli.main``
from that folder, so the recipes name their files by relative paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fractal_opt.cli import main

BAD = Path(__file__).resolve().parent / "data" / "bad"

# (recipe under tests/data/bad/recipes, substrings the message must hold: the file, the field, the value / what is allowed)
RECIPES = [
    ("not-utf8.yaml", ["not-utf8.yaml", "not UTF-8", "line 2"]),
    ("not-yaml.yaml", ["not-yaml.yaml", "not valid YAML", "line 3"]),
    ("not-a-mapping.yaml", ["not-a-mapping.yaml", "expected a mapping"]),
    ("newer-version.yaml", ["newer-version.yaml", "'version'", "99", "Upgrade"]),
    ("version-not-a-number.yaml", ["'version'", "'one'"]),
    ("repeats-huge.yaml", ["'repeats'", "100000000000000000000", "[1, 10,000]"]),
    ("repeats-negative.yaml", ["'repeats'", "-3", "[1, 10,000]"]),
    ("max-new-tokens-float.yaml", ["'max_new_tokens'", "1e+20", "expected int"]),
    ("timeout-inf.yaml", ["timeout-inf.yaml", "'timeout_s'", "inf", "finite"]),
    ("guard-nan.yaml", ["guard-nan.yaml", "policy.guards.kl_mean.max", "nan", "finite"]),
    ("batch-size-huge.yaml", ["'batch_size'", "99999999999", "[1, 65,536]"]),
    ("context-cap-huge.yaml", ["(context_cap)", "'tokens'", "100000000000", "10,000,000"]),
    ("fraction-over-one.yaml", ["'top_p'", "7.0", "[0, 1]"]),
    ("probes-without-opt-in.yaml", ["probes-without-opt-in.yaml", "'probes'", "os:system", "allow_code: true"]),
    ("suite-missing.yaml", ["suite-missing.yaml", "'suite'", "suites/nowhere.yaml", "does not exist"]),
    ("suite-not-utf8.yaml", ["'suite'", "suites/not-utf8.yaml", "not UTF-8", "byte 24"]),
    ("suite-not-yaml.yaml", ["'suite'", "suites/not-yaml.yaml", "not valid YAML", "line 3"]),
    ("suite-bad-json.yaml", ["'suite'", "suites/bad-json.jsonl", "line 2 is not valid JSON"]),
    ("suite-empty.yaml", ["suites/empty.yaml", "non-empty list of requests"]),
    ("suite-bad-requests.yaml", ["4 problems", "'prompt' must be a non-empty string", "'messages' must be", "request 2 must be a mapping", "'no-text'"]),
    ("eval-not-utf8.yaml", ["'eval'", "evals/not-utf8.yaml", "not UTF-8"]),
    ("eval-not-yaml.yaml", ["'eval'", "evals/not-yaml.yaml", "not valid YAML"]),
    ("eval-bad-json.yaml", ["'eval'", "evals/bad-json.jsonl", "line 2 is not valid JSON"]),
    ("eval-bad-items.yaml", ["3 problems", "item 0 needs", "not a valid regex", "unknown match 'fuzzy'"]),
    ("prompt-over-positions.yaml", ["suites/long-prompt.yaml", "'too-long'", "80 tokens", "model's positions (64)"]),
    ("prompt-over-context-cap.yaml", ["'forty'", "40 tokens", "context_cap pass's cap (32)"]),
    ("model-config-not-json.yaml", ["config-not-json/config.json", "not valid JSON", "line 2"]),
    ("model-config-not-utf8.yaml", ["config-not-utf8/config.json", "not UTF-8"]),
    ("model-config-is-a-list.yaml", ["config-is-a-list/config.json", "JSON list", "expected an object"]),
    ("model-no-config.yaml", ["models/no-config", "no config.json"]),
    ("model-no-weights.yaml", ["models/no-weights", "no weights"]),
    ("model-no-tokenizer.yaml", ["models/no-tokenizer", "no tokenizer"]),
    ("model-junk-safetensors.yaml", ["junk-safetensors/model.safetensors", "not a valid safetensors file"]),
    ("gguf-junk.yaml", ["junk.gguf", "not a GGUF file", "b'PK"]),
    ("gguf-empty.yaml", ["empty.gguf", "is empty"]),
    ("gguf-truncated.yaml", ["truncated.gguf", "truncated"]),
    ("gguf-version-99.yaml", ["version-99.gguf", "GGUF version 99"]),
    ("many-problems.yaml", ["4 problems", "'workloda'", "'repeats'", "'dtpe'", "'bitz'"]),
    ("alias-bomb.yaml", ["alias-bomb.yaml", "more than 100,000 values with aliases expanded"]),
    ("model-name-too-long.yaml", ["model-name-too-long.yaml", "'model'", "300 characters", "cannot be used as a path", "File name too long"]),
]


@pytest.fixture(autouse=True)
def _in_corpus(monkeypatch):
    """Run from tests/data/bad, and fail the test if anything would load a model's weights."""
    import fractal_opt.runtimes
    import fractal_opt.weights.models

    def no_weights(*args, **kwargs):
        raise AssertionError("bad input reached a model load")

    monkeypatch.chdir(BAD)
    monkeypatch.setattr(fractal_opt.weights.models, "materialize", no_weights)
    monkeypatch.setattr(fractal_opt.runtimes.RUNTIMES, "build", no_weights)


def _refused(argv: list[str], capsys) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    out = captured.err + captured.out
    assert code == 2, f"{argv} exited {code}:\n{out}"
    assert "Traceback" not in out
    return out


@pytest.mark.parametrize(("name", "expected"), RECIPES, ids=[name for name, _ in RECIPES])
def test_check_refuses_bad_recipe(name, expected, capsys):
    """`fractal-opt check` on each malformed input exits 2 with a message naming the file, the field and the value."""
    out = _refused(["check", f"recipes/{name}"], capsys)
    for text in expected:
        assert text in out, f"{text!r} missing from:\n{out}"


def test_the_corpus_good_recipe_is_valid(capsys):
    """The corpus's one valid recipe passes: the refusals above come from the bad part, not the setup."""
    assert main(["check", "recipes/good.yaml"]) == 0
    assert "valid" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["not-utf8.yaml", "gguf-junk.yaml", "model-junk-safetensors.yaml", "model-config-not-json.yaml", "prompt-over-positions.yaml",
                                  "probes-without-opt-in.yaml", "suite-not-utf8.yaml"])
def test_run_refuses_before_any_work(name, tmp_path, capsys):
    """`fractal-opt run` refuses the same inputs before building anything (no model load, exit 2).

    Not yet for a folder missing its weights or tokenizer: recipe loading checks only the files
    that are there (``models.check_files(complete=False)``), since the pipeline tests stand in a
    model with a config-only folder; ``check`` refuses those folders."""
    _refused(["run", f"recipes/{name}", "--out", str(tmp_path / "out"), "--quiet"], capsys)


def test_generate_refuses_before_any_work(capsys):
    """`fractal-opt generate` with a damaged model file exits 2 without loading anything."""
    _refused(["generate", "recipes/gguf-truncated.yaml", "hello"], capsys)


def test_prompt_over_a_gguf_models_positions(tmp_path, capsys):
    """A prompt that cannot fit a GGUF model's context_length is refused from the header alone
    (a lower bound on its tokens: bytes over the longest token's bytes)."""
    import numpy as np
    from gguf import GGUFWriter

    gguf = tmp_path / "ctx32.gguf"
    writer = GGUFWriter(str(gguf), "llama")
    writer.add_context_length(32)
    writer.add_token_list(["a", "bb", "ccc"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    suite = tmp_path / "suite.yaml"
    suite.write_text("requests:\n  - id: long\n    prompt: " + "x" * 300 + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {gguf}\nworkload: {{suite: {suite}, max_new_tokens: 4}}\n")
    out = _refused(["check", str(recipe)], capsys)
    assert "at least 100 tokens" in out and "model's positions (32)" in out
    # The header scan (hand-written for speed) reads what the gguf package's own reader reads.
    from gguf import GGUFReader

    from fractal_opt.weights.models import gguf_metadata

    meta = gguf_metadata(str(gguf))
    assert meta["llama.context_length"] == GGUFReader(str(gguf)).fields["llama.context_length"].contents() == 32
    assert meta["tokenizer.longest_token_bytes"] == 3


# (argv, substrings of argparse's or our message)
ARGUMENTS = [
    (["check"], ["the following arguments are required: RECIPE"]),
    (["check", "recipes"], ["'recipes'", "is a folder"]),
    (["check", "recipes/nowhere.yaml"], ["recipes/nowhere.yaml", "does not exist"]),
    (["no-such-command"], ["invalid choice: 'no-such-command'"]),
    (["passes", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["generate", "recipes/good.yaml"], ["the following arguments are required: prompt"]),
    (["serve", "recipes/good.yaml", "--drain-s", "nan"], ["serve --drain-s", "nan", "finite"]),
    (["serve", "recipes/good.yaml", "--body-timeout-s", "inf"], ["serve --body-timeout-s", "inf", "finite number > 0"]),
    (["serve", "recipes/good.yaml", "--max-connections", "0"], ["serve --max-connections", "got 0"]),
    (["serve", "recipes/good.yaml", "--timeout-s", "0"], ["serve --timeout-s", "got 0.0", "> 0"]),
    (["serve", "recipes/good.yaml", "--seed", str(2**64)], ["serve --seed", str(2**64), "signed 64-bit"]),
    (["serve", "recipes/good.yaml", "--max-tokens-over-cap", "lower"], ["invalid choice: 'lower'", "'cap'"]),
    (["run", "recipes/good.yaml", "--out", ""], ["run --out: got ''", "folder path"]),
]


@pytest.mark.parametrize(("argv", "expected"), ARGUMENTS, ids=[" ".join(a) for a, _ in ARGUMENTS])
def test_bad_arguments_exit_2(argv, expected, capsys):
    """Bad command-line arguments exit 2 with argparse's (or our) message, in-process, no traceback."""
    out = _refused(argv, capsys)
    for text in expected:
        assert text in out, f"{text!r} missing from:\n{out}"


def test_check_json_lists_every_file_and_problem(capsys):
    """`check --json` over many files: one entry per file, every problem of each, exit 2 if any is bad."""
    files = ["recipes/good.yaml", "recipes/many-problems.yaml", "recipes/probes-without-opt-in.yaml"]
    assert main(["check", *files, "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is False
    by_file = {r["file"]: r for r in report["files"]}
    assert list(by_file) == files
    assert by_file["recipes/good.yaml"]["valid"] and by_file["recipes/good.yaml"]["problems"] == []
    assert len(by_file["recipes/many-problems.yaml"]["problems"]) == 4
    assert by_file["recipes/probes-without-opt-in.yaml"]["imports"] == ["os:system"]


# Hostile files, written at test time (too large to keep in the corpus): each must be refused with
# exit 2, no traceback, in under a second and 200 MB. They run in one child process so its peak
# memory is theirs alone; the parent asserts on what it reports.
_BOMB = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"] + [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
_PLACES = {  # where the bomb goes: a key path of the recipe
    "name": "name: {}", "model": "model: {}", "workload.suite": "workload:\n  suite: {}", "workload.load": "workload:\n  load: {}",
    "policy.guards": "policy:\n  guards: {}", "passes": "passes: {}", "targets": "targets: {}",
}


def _hostile_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, a substring its refusal must hold)."""
    bomb = "[" + ", ".join(_BOMB) + "]"
    files: dict[str, tuple[str, str]] = {}
    for place, template in _PLACES.items():
        head = "" if place == "model" else "model: models/positions-64\n"
        files[f"bomb-{place}.yaml"] = (head + template.format(bomb) + "\n", "with aliases expanded")
    files["keys-500k.yaml"] = ("model: models/positions-64\nworkload:\n" + "".join(f"  k{i}: {i}\n" for i in range(500_000)), "at most 1 MiB")
    files["passes-200k.yaml"] = ("model: models/positions-64\npasses:\n  hardware:\n" + "  - {threads: {count: 1}}\n" * 200_000, "at most 1 MiB")
    files["guards-400k.yaml"] = ("model: models/positions-64\npolicy:\n  guards:\n" + "".join(f"    g{i}: {{max: 1}}\n" for i in range(400_000)), "at most 1 MiB")
    files["deep-flow.yaml"] = ("model: models/positions-64\nname: " + "[" * 100_000 + "]" * 100_000 + "\n", "nesting depth")
    files["deep-block.yaml"] = ("model: models/positions-64\nname:\n" + "".join("  " * i + "-\n" for i in range(1, 400)), "deeper than 64 levels")
    (folder / "deep.jsonl").write_text('{"prompt": "hi"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    files["suite-deep-jsonl.yaml"] = (f"model: models/positions-64\nworkload: {{suite: {folder / 'deep.jsonl'}}}\n", "line 2 is nested deeper")
    out = {}
    for name, (text, expected) in files.items():
        (folder / name).write_text(text)
        out[name] = (folder / name, expected)
    return out


_MEASURE = """
import io, json, sys, time
from contextlib import redirect_stderr, redirect_stdout
from fractal_opt.cli import main
results = {}
for path in sys.argv[1:]:
    err = io.StringIO()
    t = time.perf_counter()
    with redirect_stderr(err), redirect_stdout(err):
        code = main(["check", path])
    results[path] = {"code": code, "s": time.perf_counter() - t, "out": err.getvalue()}
# VmHWM: this process's own peak (ru_maxrss would carry the forking pytest's across exec)
results["peak_mb"] = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024
print(json.dumps(results))
"""


def test_hostile_recipes_are_refused_fast_and_small(tmp_path):
    """An alias bomb under every key, 10 MB recipes, 100,000-deep nesting (YAML and a suite's JSONL):
    exit 2 naming the file and the limit, no traceback, each in under a second, under 200 MB."""
    import subprocess
    import sys

    files = _hostile_files(tmp_path)
    args = [str(path) for path, _ in files.values()]
    import os

    env = {**os.environ, "PYTHONPATH": str(BAD.parents[2])}  # this checkout's fractal_opt, whatever is installed
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *args], cwd=BAD, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    for name, (path, expected) in files.items():
        r = results[str(path)]
        assert r["code"] == 2, f"{name} exited {r['code']}: {r['out'][-500:]}"
        assert "Traceback" not in r["out"] and expected in r["out"] and name in r["out"], f"{name}: {r['out'][-500:]}"
        assert r["s"] < 1.0, f"{name} took {r['s']:.2f} s"
    assert results["peak_mb"] < 200, f"peak RSS {results['peak_mb']:.0f} MB"
