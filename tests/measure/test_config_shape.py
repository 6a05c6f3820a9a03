"""A model's shape from its config: the architecture's own defaults, and what the arithmetic does not model."""

from __future__ import annotations

from fractal_opt.measure.config_shape import architecture, resolve_config, shape_from_config


def test_mqa_and_missing_head_dim_defaults():
    """multi_query configs have one KV head; head_dim falls back to hidden / heads; GPT-2 style MLPs have 2 matrices."""
    shape = shape_from_config({"model_type": "gpt_bigcode", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100, "multi_query": True})
    assert shape.kv_heads == 1 and shape.head_dim == 16 and not shape.gated_mlp and shape.intermediate == 256


def test_kv_heads_default_to_the_attention_heads():
    """A config without num_key_value_heads is multi-head attention: as many KV heads as attention heads."""
    shape = shape_from_config({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 8, "vocab_size": 100})
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (8, 8, 16)


def test_gpt2_defaults_come_from_its_own_config_class():
    """A GPT-2 config that does not say tie_word_embeddings is tied, and its learned positions are counted beside the blocks."""
    resolved, notes = resolve_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 32})
    assert resolved["tie_word_embeddings"] is True and resolved["hidden_size"] == 64 and notes == []
    arch = architecture({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 32})
    assert arch.position_params == 32 * 64
    # positions + per block (o bias, MLP biases 256 + 64, two LayerNorm biases) + the final LayerNorm's bias
    assert arch.other_params == 32 * 64 + 2 * (64 + 256 + 64) + 2 * 2 * 64 + 64


def test_a_config_transformers_does_not_know_is_read_as_written_and_says_so():
    """An unknown model_type keeps its own numbers, and a note names the model_type and where it came from."""
    config = {"model_type": "my_own_lm", "num_hidden_layers": 3, "hidden_size": 96, "num_attention_heads": 3, "vocab_size": 100}
    resolved, notes = resolve_config(config, where="my/config.json")
    assert resolved == config
    assert notes == ["my/config.json: model_type 'my_own_lm' is not a transformers architecture: its config is read as written, without defaults"]


def test_multimodal_configs_count_their_language_model():
    """A config with a text_config is counted by its language model's sizes, not the outer wrapper's."""
    shape = shape_from_config({"model_type": "my_vlm", "vision_config": {"hidden_size": 1024},
                               "text_config": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                               "num_key_value_heads": 1, "vocab_size": 100}})
    assert (shape.layers, shape.hidden, shape.kv_heads, shape.model_type) == (2, 64, 1, "llama")
