"""Where a model's config comes from: a dict, a config.json, the embedded model's GGUF header, or the hub."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import ModelSourceError
from fractal_opt.measure.budget import budget
from fractal_opt.measure.config_shape import shape_from_config
from fractal_opt.measure.config_source import load_config


@pytest.mark.integration  # reads the embedded model (GGUFReader maps the 98 MB file): ~6 s on 2 shared cores
def test_embedded_model_reads_gguf_metadata():
    """The embedded name resolves to its GGUF header: SmolLM2's shape without loading or converting any weights."""
    _, config = load_config("smollm2-135m-instruct")
    shape = shape_from_config(config)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.tied_embeddings) == (30, 3, 64, True)
    assert budget("smollm2-135m-instruct").params == 134_515_008  # the header is parsed once per file


def test_offline_hub_id_fails_fast_with_a_clear_message(monkeypatch):
    """A hub id that is not cached fails with 'offline' and what to pass instead (HF_HUB_OFFLINE set, no network touched)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="offline.*local model folder"):
        load_config("some-org/not-a-cached-model")


def test_a_dict_is_labelled_by_its_name_or_type():
    """A config dict comes back as a copy, labelled by _name_or_path, else by model_type."""
    config = {"model_type": "llama", "_name_or_path": "org/model"}
    label, loaded = load_config(config)
    assert (label, loaded) == ("org/model", config) and loaded is not config
    assert load_config({"model_type": "llama"})[0] == "llama"


@pytest.mark.parametrize(("text", "message"), [("{not json", "could not be read"), ("[1, 2]", "expected a JSON object, got list")])
def test_a_bad_config_json_names_the_file(tmp_path, text, message):
    """A config.json that is not JSON, or not an object, fails with the file's path and what is wrong."""
    path = tmp_path / "config.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ModelSourceError, match=message) as info:
        load_config(path)
    assert str(path) in str(info.value)
