"""The weight ladder: types below the source's bits a weight, most bits first; never "quantized
up"; each made by llama.cpp's own tools (the converter, llama-quantize) or, without them, refused
naming the command that builds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fractal_opt.core.errors import ModelSourceError
from fractal_opt.weights import ladder as ladder_module
from fractal_opt.weights.ladder import GGUF_METHODS, LADDER, WEIGHT_TYPES, gguf_file, ladder, source_type, type_problem
from fractal_opt.weights.models import ModelSource, resolve


def _folder(tmp_path: Path, dtype: str | None) -> ModelSource:
    folder = tmp_path / f"model-{dtype}"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], **({"dtype": dtype} if dtype else {})}
    (folder / "config.json").write_text(json.dumps(config))
    return ModelSource(str(folder), "local", folder)


def test_a_folder_is_of_its_checkpoint_dtype_and_offers_the_whole_ladder(tmp_path):
    """A bfloat16 folder is BF16 (float32 when config.json names none); every ladder type is below
    16 bits, offered most bits first."""
    assert source_type(_folder(tmp_path, "bfloat16")) == "BF16"
    assert source_type(_folder(tmp_path, None)) == "F32"
    assert ladder(_folder(tmp_path, "float16")) == LADDER
    bits = [WEIGHT_TYPES[t].bits for t in LADDER]
    assert bits == sorted(bits, reverse=True)


def test_the_ladder_never_quantizes_up(monkeypatch):
    """From the embedded Q4_1 GGUF (5 bits a weight) only the 4-bit types are offered; Q8_0 is
    refused as more bytes for the same information; widening to BF16 (the dtype pass) is allowed."""
    try:
        source = resolve("smollm2-135m-instruct")
    except ModelSourceError as e:
        pytest.skip(str(e))
    assert source_type(source) == "Q4_1"
    assert ladder(source) == ("Q4_K_M", "Q4_0", "IQ4_XS")
    assert "more bytes, not more precision" in (type_problem(source, "Q8_0") or "")
    assert type_problem(source, "BF16", widen=True) is None


def test_k_quants_need_llama_quantize_and_say_how_to_build_it(tmp_path, monkeypatch):
    """Without llama-quantize a folder still gets the converter's types (F32 / BF16 / F16 / Q8_0)
    and the K-quants are refused naming make setup-llama-native; an unknown type names the valid ones."""
    monkeypatch.setattr(ladder_module, "native_tool", lambda name: tmp_path / "no" / name)
    source = _folder(tmp_path, "bfloat16")
    assert type_problem(source, "Q8_0") is None and type_problem(source, "F32", widen=True) is None
    assert "make setup-llama-native" in (type_problem(source, "Q4_K_M") or "")
    assert "Q4_K_M" in (type_problem(source, "Q4_K_X") or "")
    with pytest.raises(ModelSourceError, match="make setup-llama-native"):
        gguf_file(source, "Q6_K", progress=lambda m: None)


def test_the_quantize_pass_methods_are_the_ladder():
    """Every ladder type is a quantize-pass method (lower case) filed under its whole bits; Q4_0 is 4 bits' default."""
    assert {m.upper() for m in GGUF_METHODS} == set(LADDER)
    assert next(m for m, b in GGUF_METHODS.items() if b == 4) == "q4_0"
