"""A model's shape from its config, with the architecture's own defaults: what the budget counts.

A transformers config is read through ``transformers.AutoConfig.for_model`` (nothing is
downloaded, no remote code runs), so each architecture's defaults apply: a GPT-2 config that does
not say ``tie_word_embeddings`` is tied, as GPT-2 is. :func:`architecture` adds what the Llama
layout of :class:`~fractal_opt.measure.roofline.ModelShape` leaves out (the GPT-2 layout's biases
and learned positions, sliding-window layers) and names in ``notes`` what the arithmetic does not
model (multi-head latent attention, hybrid stacks whose layers are not all attention).

Example:
    >>> from fractal_opt.measure.config_shape import shape_from_config
    >>> shape = shape_from_config({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
    ...                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100})
    >>> shape.kv_heads, shape.head_dim
    (2, 16)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import ModelSourceError
from .roofline import ModelShape, kv_values_per_token

__all__ = ["Architecture", "architecture", "resolve_config", "shape_from_config"]

# Architectures whose MLP has two matrices (up, down) instead of the gated three (gate, up, down).
_UNGATED = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "gpt_bigcode", "starcoder2"}
# The GPT-2 layout: learned position embeddings, a bias on every linear layer and LayerNorms with
# a bias (ModelShape counts the Llama layout: q/k/v biases at most, RMSNorms without one).
_GPT2_LAYOUT = {"gpt2", "gpt_bigcode"}
# Layer kinds of transformers' ``layer_types`` that hold a KV cache.
_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}
# Standard config names whose value a flat config states and the resolved one must keep (a
# composite model_type such as gemma3 would otherwise put them beside a default text_config).
_CHECKED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class Architecture:
    """What :func:`architecture` reads from a config: the shape, the parameters beyond it, the
    sliding-window layers, and what the arithmetic does not model (``notes``)."""

    shape: ModelShape
    other_params: int = 0
    position_params: int = 0  # of other_params: learned position embeddings
    sliding_layers: int = 0
    sliding_window: int | None = None
    notes: tuple[str, ...] = ()


def architecture(config: Mapping[str, Any], *, where: str = "config") -> Architecture:
    """The :class:`ModelShape` of a config with transformers' defaults, and what it leaves out."""
    resolved, notes = resolve_config(config, where=where)
    shape = _shape(resolved, where=where)
    c, hidden, layers = resolved, shape.hidden, shape.layers
    position = other = 0
    if shape.model_type in _GPT2_LAYOUT:
        position = int(_first(c, "n_positions", "max_position_embeddings") or 0) * hidden
        # o and MLP biases (q/k/v's are the shape's attention_bias), two LayerNorms per block and
        # the final one with a bias each: ModelShape counts their weights as RMSNorms.
        other = position + layers * (hidden + shape.intermediate + hidden) + layers * 2 * hidden + hidden
    types = [str(t) for t in (c.get("layer_types") or [])]
    window = c.get("sliding_window")
    sliding = 0
    if types:
        sliding = sum(t == "sliding_attention" for t in types) if window else 0
        others = sorted({t for t in types if t not in _ATTENTION_LAYERS})
        if others:
            n = sum(t not in _ATTENTION_LAYERS for t in types)
            notes.append(f"hybrid layers: {n} of {len(types)} are {', '.join(others)}, not attention; their state is not a KV cache, "
                         "and the KV and parameter numbers here count every layer as attention (an over-estimate)")
        if any(t == "chunked_attention" for t in types):
            notes.append("chunked attention layers are counted at the full context (their cache holds one chunk: an over-estimate)")
    elif window and c.get("use_sliding_window", True) is not False:
        sliding = layers  # Mistral-style: every layer attends within the window
    if shape.model_type in _HYBRID and not any(n.startswith("hybrid") for n in notes):
        notes.append(f"{shape.model_type} is a hybrid stack (state-space / linear-attention layers beside attention): "
                     "the KV and parameter numbers here count every layer as attention")
    if c.get("kv_lora_rank"):
        latent = layers * (int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim") or 0))
        notes.append(f"multi-head latent attention (kv_lora_rank {c['kv_lora_rank']}): runtimes that cache the latent (vLLM, llama.cpp) hold "
                     f"{latent:,} values per token ({layers} layers x (kv_lora_rank + qk_rope_head_dim)), not the "
                     f"{kv_values_per_token(shape):,} of full K/V heads counted here; the attention parameters are approximate")
    return Architecture(shape=shape, other_params=other, position_params=position, sliding_layers=sliding,
                        sliding_window=int(window) if sliding else None, notes=tuple(notes))


# Model types whose stacks mix attention with state-space or linear-attention layers; configs that
# list their kinds in ``layer_types`` are read from it instead.
_HYBRID = {"jamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2", "qwen3_next", "mamba", "mamba2",
           "falcon_mamba", "recurrent_gemma", "rwkv", "minimax"}


def resolve_config(config: Mapping[str, Any], *, where: str = "config") -> tuple[dict[str, Any], list[str]]:
    """The config with transformers' per-architecture defaults (``AutoConfig.for_model``), the
    language model's part of a multimodal one, under the standard names (``hidden_size``, ...).

    Returns the dict and notes: a config transformers does not know (or cannot read) is used as
    written, and the notes say so. Nothing is downloaded; no remote code runs.
    """
    raw = dict(config)
    notes: list[str] = []
    model_type = raw.get("model_type")
    try:
        from transformers import AutoConfig
    except ImportError:
        return _flatten(raw), ["transformers is not installed: the config is read as written, without per-architecture defaults"]
    if not model_type:
        return _flatten(raw), notes
    try:
        resolved = AutoConfig.for_model(str(model_type), **{k: v for k, v in raw.items() if k != "model_type"})
    except ValueError:  # a model_type transformers does not know
        return _flatten(raw), [f"{where}: model_type {model_type!r} is not a transformers architecture: its config is read as written, without defaults"]
    except Exception as e:  # noqa: BLE001 (a config transformers' own validation rejects: read as written, and say so)
        return _flatten(raw), [f"{where}: transformers could not read the config ({type(e).__name__}: {str(e)[:160]}): read as written, without defaults"]
    text = resolved.get_text_config()
    out = dict(text.to_dict())
    out["model_type"] = text.model_type if text.model_type else str(model_type)
    for name in (*_CHECKED, "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings", "sliding_window", "layer_types"):
        value = getattr(text, name, None)
        if value is not None:
            out[name] = value
    # Tied embeddings are the outer config's decision in multimodal wrappers.
    out["tie_word_embeddings"] = bool(getattr(text, "tie_word_embeddings", None) if getattr(resolved, "tie_word_embeddings", None) is None else resolved.tie_word_embeddings)
    flat = _flatten(raw)
    stated = {name: _first(flat, *_ALIASES[name]) for name in _CHECKED}
    if any(value is not None and out.get(name) != value for name, value in stated.items()):
        return flat, [f"{where}: transformers' {type(resolved).__name__} did not keep the config's own sizes; read as written, without defaults"]
    return out, notes


_ALIASES = {"num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"), "hidden_size": ("hidden_size", "n_embd", "d_model"),
            "num_attention_heads": ("num_attention_heads", "n_head"), "vocab_size": ("vocab_size",)}


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model (``text_config``), keeping the outer model_type if it has none."""
    if isinstance(config.get("text_config"), Mapping):
        return {**config["text_config"], "model_type": config["text_config"].get("model_type", config.get("model_type"))}
    return config


def _first(config: Mapping[str, Any], *names: str) -> Any:
    for n in names:
        if config.get(n) is not None:
            return config[n]
    return None


def shape_from_config(config: Mapping[str, Any], *, where: str = "config") -> ModelShape:
    """Read a :class:`ModelShape` from a transformers config dict, with the architecture's own
    defaults (:func:`resolve_config`): what the pre-flight and the census use."""
    return _shape(resolve_config(config, where=where)[0], where=where)


def _shape(config: Mapping[str, Any], *, where: str) -> ModelShape:
    """A :class:`ModelShape` from a resolved config (Llama, Mistral, Qwen, GPT-2 names).

    ``num_key_value_heads`` defaults to the attention heads (multi-head attention) and to 1 for
    ``multi_query`` configs; ``head_dim`` defaults to hidden / heads.
    """
    config = _flatten(dict(config))
    if config.get("is_encoder_decoder"):
        raise ModelSourceError(f"{where}: {config.get('model_type')} is an encoder-decoder model; this calculator understands decoder-only transformers.")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    vocab = _first(config, "vocab_size")
    missing = [n for n, v in (("num_hidden_layers", layers), ("hidden_size", hidden), ("num_attention_heads", heads), ("vocab_size", vocab)) if v is None]
    if missing:
        raise ModelSourceError(f"{where}: the config has no {', '.join(missing)}; it is not a decoder-only transformer config this calculator understands (keys: {sorted(config)[:20]}).")
    kv_heads = _first(config, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if config.get("multi_query") else heads
    model_type = str(config.get("model_type", "unknown"))
    experts = int(_first(config, "num_local_experts", "num_experts", "n_routed_experts") or 1)
    return ModelShape(
        layers=int(layers), hidden=int(hidden), heads=int(heads), kv_heads=int(kv_heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate=int(_first(config, "moe_intermediate_size" if experts > 1 else "intermediate_size", "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden),
        vocab=int(vocab), tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        gated_mlp=model_type not in _UNGATED, attention_bias=bool(config.get("attention_bias", model_type in ("qwen2", *_GPT2_LAYOUT))),
        experts=experts, active_experts=int(_first(config, "num_experts_per_tok", "moe_topk") or 1) if experts > 1 else 1,
        model_type=model_type,
    )


