"""Tiny offline models for tests and tutorials: a random-weight Llama with a byte-level BPE
tokenizer and a chat template (:func:`tiny_model`), its tokenizer alone, and a model folder a
fake engine can be pointed at. Nothing is downloaded; :mod:`fractal_opt.testing` re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "LLAMA_SHAPE", "fake_model_folder", "tiny_model", "tiny_tokenizer"]

# A chat template in the style of SmolLM2 (ChatML), so chat suites render as they would there.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)



# A small Llama-shaped config: enough for the budget, roofline and pre-flight arithmetic to count
# bytes and FLOPs, while a FakeEngine serves the requests.
LLAMA_SHAPE = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 512, "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 4096}


def fake_model_folder(path: str | Path, config: Mapping[str, Any] | None = None) -> Path:
    """A model folder the recipe checks accept (config.json, a safetensors header, a tokenizer
    file) for a :class:`FakeEngine`, which reads none of it. ``config`` defaults to a fake type."""
    import json
    import struct

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config) if config is not None else {"model_type": "fake"}), encoding="utf-8")
    header = b'{"__metadata__": {}}'
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (path / "tokenizer.json").write_text("{}", encoding="utf-8")
    return path


def tiny_tokenizer(path: str | Path, *, vocab_size: int = 512, chat_template: str | None = None) -> Any:
    """Write a byte-level BPE tokenizer trained on the shipped reference text (a fraction of a
    second; nothing downloaded) to ``path``, with :data:`CHAT_TEMPLATE` unless ``chat_template``
    says otherwise (``""``: none, as a base model ships). Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    from .quality.reference import reference_text

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(tokenizer_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([reference_text()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    template = CHAT_TEMPLATE if chat_template is None else chat_template
    if template:
        fast.chat_template = template
    fast.save_pretrained(path)
    return fast


def tiny_model(path: str | Path, *, hidden_size: int = 128, layers: int = 2, vocab_size: int = 512, seed: int = 0) -> Path:
    """Write a random-weight Llama and a byte-level BPE tokenizer with a chat template to ``path``.

    The tokenizer is trained on the shipped reference text in a fraction of a second; nothing is
    downloaded. Returns the folder, which a recipe's ``model:`` can name.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    fast = tiny_tokenizer(path, vocab_size=vocab_size)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as in SmolLM2
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(path)
    return path
