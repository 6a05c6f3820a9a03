"""The budget calculator: what a model needs in memory and the fastest it can decode, before loading it.

``fractal_opt.budget(model_or_config, ...)`` and ``fractal-opt budget MODEL`` read a config (a
local model folder, a ``config.json`` path, a dict, the embedded model's name, a ``.gguf`` file, or
a hub id when online) and answer: parameter count, weight memory, KV-cache bytes per token and for
``context × batch``, how many sequences of that context fit in a given memory, and the decode
ceiling for a given bandwidth. The pipeline's pre-flight check uses the same arithmetic.

A transformers config is read through ``transformers.AutoConfig`` (nothing is downloaded), so
each architecture's own defaults apply: a GPT-2 config that does not say ``tie_word_embeddings``
is tied, as GPT-2 is. What the arithmetic models beyond the Llama layout: the GPT-2 layout's
biases and learned positions, and sliding-window layers (their KV cache holds at most the window).
What it does not model it says in ``Budget.notes``: multi-head latent attention (DeepSeek), and
hybrid stacks whose layers are not all attention (Mamba / linear attention).

Example:
    >>> from fractal_opt.measure.budget import budget
    >>> b = budget({"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
    ...             "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    ...             "vocab_size": 49152, "tie_word_embeddings": True}, context=2048, dtype="bfloat16")
    >>> b.params, b.kv_bytes_per_token
    (134515008, 23040)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelSourceError, RecipeError
from .roofline import (
    ModelShape,
    decode_ceiling_tokens_per_s,
    dtype_bits,
    kv_bytes_per_token,
    kv_values_per_token,
    weight_bytes,
    weight_bytes_read_per_token,
)

__all__ = ["BOUNDS", "Architecture", "Budget", "allowed", "architecture", "budget", "load_config", "out_of_bounds", "resolve_config", "shape_from_config"]

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
class Budget:
    """The answer of :func:`budget` (bytes are exact integers; GB = 10^9 bytes in :meth:`to_text`)."""

    model: str
    shape: ModelShape
    dtype: str
    weights_bits: int
    kv_bits: int
    context: int
    batch: int
    params: int
    active_params: int
    weight_bytes: int
    weight_read_bytes_per_token: int
    kv_bytes_per_token: int
    kv_bytes: int  # context × batch
    total_bytes: int  # weights + KV for context × batch
    memory_bytes: int | None
    sequences_that_fit: int | None  # sequences of `context` tokens that fit next to the weights
    bandwidth_bytes_per_s: float | None
    decode_ceiling_tokens_per_s: float | None  # aggregate over the batch, at the full context
    decode_ceiling_per_sequence: float | None
    other_params: int = 0  # counted beyond the shape's blocks: learned positions, the GPT-2 layout's biases
    sliding_layers: int = 0  # layers whose KV cache holds at most `sliding_window` tokens
    sliding_window: int | None = None
    notes: tuple[str, ...] = ()  # what the arithmetic does not model for this architecture

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        """A short human-readable table (what ``fractal-opt budget`` prints)."""
        s = self.shape
        gb = 1e9
        lines = [
            f"model            {self.model} ({s.model_type}: {s.layers} layers, hidden {s.hidden}, {s.heads} heads / {s.kv_heads} KV heads x {s.head_dim}, vocab {s.vocab}"
            + (", tied embeddings" if s.tied_embeddings else "") + (f", {s.experts} experts ({s.active_experts} active)" if s.experts > 1 else "") + ")",
            f"parameters       {self.params:,}" + (f" ({self.active_params:,} active per token)" if self.active_params != self.params else ""),
            f"weights          {self.weight_bytes / gb:.3f} GB ({self.dtype}" + (f", block linear layers at {self.weights_bits} bits" if self.weights_bits != dtype_bits(self.dtype) else "") + ")",
            f"KV cache         {self.kv_bytes_per_token:,} bytes/token at {self.kv_bits} bits = 2 x {s.layers} layers x {s.kv_heads} KV heads x {s.head_dim} x {self.kv_bits // 8 if self.kv_bits >= 8 else self.kv_bits / 8} bytes",
            f"KV for context   {self.kv_bytes / gb:.3f} GB ({self.context} tokens x batch {self.batch}"
            + (f"; {self.sliding_layers} of {s.layers} layers hold at most their {self.sliding_window}-token window" if self.sliding_layers else "") + ")",
            f"total            {self.total_bytes / gb:.3f} GB (weights + KV)",
        ]
        if self.memory_bytes is not None:
            fit = self.sequences_that_fit
            lines.append(f"fits in          {self.memory_bytes / gb:.1f} GB: {fit:,} sequences of {self.context} tokens" if fit else
                         f"fits in          {self.memory_bytes / gb:.1f} GB: no (the weights alone need {self.weight_bytes / gb:.3f} GB)")
        if self.bandwidth_bytes_per_s is not None:
            lines.append(f"decode ceiling   {self.decode_ceiling_tokens_per_s:.1f} tokens/s aggregate, {self.decode_ceiling_per_sequence:.1f} per sequence "
                         f"at {self.bandwidth_bytes_per_s / gb:.1f} GB/s ({self.weight_read_bytes_per_token / gb:.3f} GB of weights + KV of {self.context} tokens x {self.batch} per step)")
        lines += [f"warning          {note}" for note in self.notes]
        return "\n".join(lines)


def budget(
    model_or_config: str | Path | Mapping[str, Any],
    *,
    context: int = 2048,
    batch: int = 1,
    dtype: str = "bfloat16",
    weights_bits: int | None = None,
    kv_bits: int | None = None,
    memory_gb: float | None = None,
    bandwidth_gbs: float | None = None,
) -> Budget:
    """Memory and decode-speed budget of a model, from its config alone (no weights are loaded).

    Args:
        model_or_config: a config dict, a ``config.json`` path, a model folder, an embedded model
            name, a ``.gguf`` file, or a hub id (needs the network or the local HF cache).
        context: tokens per sequence (prompt + output) the KV cache must hold.
        batch: sequences served together.
        dtype: storage dtype of weights and (by default) the KV cache.
        weights_bits: bits per weight of the blocks' linear layers after quantization (None = dtype).
        kv_bits: bits per KV-cache element (None = dtype).
        memory_gb: device memory (10^9 bytes) to fit the weights and KV caches into.
        bandwidth_gbs: memory bandwidth (10^9 bytes/s) for the decode ceiling.

    Raises:
        RecipeError: invalid numbers or an unknown dtype; ModelSourceError when no config can be read.
    """
    for name, value in (("context", context), ("batch", batch), ("memory_gb", memory_gb), ("bandwidth_gbs", bandwidth_gbs)):
        if value is not None and (why := out_of_bounds(name, value)):
            raise RecipeError(f"budget: {name} {why}.")
    for name, value in (("weights_bits", weights_bits), ("kv_bits", kv_bits)):
        if value is not None and value not in BITS:
            raise RecipeError(f"budget: {name} must be one of {', '.join(map(str, BITS))}, got {value!r}.")
    bits = dtype_bits(dtype)
    label, config = load_config(model_or_config)
    arch = architecture(config, where=label)
    shape = arch.shape
    wbits = weights_bits or bits
    kbits = kv_bits or bits
    w = weight_bytes(shape, dtype_bits=bits, weights_bits=wbits) + arch.other_params * bits // 8
    # A token reads one row of a learned position table, as of the input embedding: only the biases count.
    w_read = weight_bytes_read_per_token(shape, dtype_bits=bits, weights_bits=wbits) + (arch.other_params - arch.position_params) * bits // 8
    kv_tok = kv_bytes_per_token(shape, kv_bits=kbits)
    per_layer = kv_tok // shape.layers
    full_layers = shape.layers - arch.sliding_layers
    kv_seq = per_layer * (full_layers * context + arch.sliding_layers * min(context, arch.sliding_window or context))
    kv = kv_seq * batch
    mem = int(memory_gb * 1e9) if memory_gb is not None else None
    fit = max(0, (mem - w) // kv_seq) if mem is not None else None
    bw = bandwidth_gbs * 1e9 if bandwidth_gbs is not None else None
    # The decode ceiling reads every sequence's cache at the full context: kv_seq / context per token.
    agg = decode_ceiling_tokens_per_s(weight_read_bytes=w_read, kv_bytes_per_token=kv_seq / context, context=context, batch=batch, bandwidth_bytes_per_s=bw) if bw else None
    return Budget(
        model=label, shape=shape, dtype=dtype, weights_bits=wbits, kv_bits=kbits, context=context, batch=batch,
        params=shape.params + arch.other_params, active_params=shape.active_params + arch.other_params, weight_bytes=w, weight_read_bytes_per_token=w_read,
        kv_bytes_per_token=kv_tok, kv_bytes=kv, total_bytes=w + kv, memory_bytes=mem, sequences_that_fit=fit,
        bandwidth_bytes_per_s=bw, decode_ceiling_tokens_per_s=agg, decode_ceiling_per_sequence=agg / batch if agg is not None else None,
        other_params=arch.other_params, sliding_layers=arch.sliding_layers, sliding_window=arch.sliding_window, notes=arch.notes,
    )


# --------------------------------------------------------------------------- bounds

# Sane bounds of the calculator's numbers (issue 13: `--context 1e20` printed 51,200,000,000,000 GB):
# name -> (integer?, lowest, highest, unit). The largest contexts in use are ~10 M tokens, the
# largest accelerator memories and bandwidths a few TB and tens of TB/s; the bounds leave room.
BOUNDS: dict[str, tuple[bool, float, float, str]] = {
    "context": (True, 1, 100_000_000, "tokens"),
    "batch": (True, 1, 1_000_000, "sequences"),
    "memory_gb": (False, 0.001, 1_000_000, "GB"),
    "bandwidth_gbs": (False, 0.001, 1_000_000, "GB/s"),
}
BITS = (2, 3, 4, 5, 6, 8, 16, 32)


def allowed(name: str) -> str:
    """What :data:`BOUNDS` allows for ``name``, in words: ``an integer from 1 to 100,000,000 tokens``."""
    integer, low, high, unit = BOUNDS[name]
    return f"{'an integer' if integer else 'a number'} from {low:,g} to {high:,.0f} {unit}"


def out_of_bounds(name: str, value: Any) -> str | None:
    """Why ``value`` is not a sane ``name`` (``got 1e+20, expected an integer from 1 to ...``), or None."""
    integer, low, high, _ = BOUNDS[name]
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not (math.isfinite(value) and low <= value <= high):
        return f"got {value!r}, expected {allowed(name)}"
    return None


# --------------------------------------------------------------------------- configs

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


def load_config(source: str | Path | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(label, config dict) from a dict, a config.json, a model folder, an embedded name, a .gguf
    file or a hub id. Raises ModelSourceError with what was tried when none can be read."""
    if isinstance(source, Mapping):
        return str(source.get("_name_or_path") or source.get("model_type") or "config"), dict(source)
    spec = str(source)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        return spec, _read_json(path)
    from .. import models

    src = models.resolve(spec)  # raises with the embedded names and the closest match
    if src.kind == "local":
        assert src.path is not None
        return spec, models.read_config(src.path)  # names the file and what is wrong with it
    if src.kind in ("embedded", "gguf"):
        assert src.path is not None
        models.check_files(src, complete=False)  # a junk or truncated GGUF header: a clear error, not gguf's ValueError
        return spec, _gguf_config(src.path)
    return spec, _hub_config(spec)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"config {str(path)!r} could not be read: {e}") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"config {str(path)!r}: expected a JSON object, got {type(data).__name__}.")
    return data


_GGUF_CONFIGS: dict[tuple[str, int], dict[str, Any]] = {}  # (path, mtime_ns) -> config: parsing a header takes seconds


def _gguf_config(path: Path) -> dict[str, Any]:
    """A transformers-style config from GGUF metadata (no tensor data is read; cached per file)."""
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _GGUF_CONFIGS:
        _GGUF_CONFIGS[key] = _read_gguf_config(path)
    return dict(_GGUF_CONFIGS[key])


def _read_gguf_config(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def get(key: str) -> Any:
        field = reader.fields.get(key)
        if field is None or not field.data:
            return None
        value = field.parts[field.data[0]]
        if field.types and field.types[0].name == "STRING":
            return bytes(value).decode("utf-8")
        return value.tolist()[0] if hasattr(value, "tolist") else value

    arch = get("general.architecture") or "llama"
    vocab = get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "model_type": arch,
        "num_hidden_layers": get(f"{arch}.block_count"),
        "hidden_size": get(f"{arch}.embedding_length"),
        "intermediate_size": get(f"{arch}.feed_forward_length"),
        "num_attention_heads": get(f"{arch}.attention.head_count"),
        "num_key_value_heads": get(f"{arch}.attention.head_count_kv"),
        "head_dim": get(f"{arch}.attention.key_length") or get(f"{arch}.rope.dimension_count"),
        "vocab_size": vocab,
        # GGUF stores no separate output matrix when the head is tied to the token embedding.
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }
    return {k: v for k, v in config.items() if v is not None}  # a key the header lacks takes the architecture's default


def _hub_config(repo_id: str) -> dict[str, Any]:
    """config.json of a hub model: the local HF cache first, then the hub (after a 3 s reachability
    check, so an offline machine fails at once instead of after huggingface_hub's ~25 s of retries)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import hf_hub_download

    try:
        return _read_json(Path(hf_hub_download(repo_id, "config.json", local_files_only=True)))
    except Exception:
        pass  # not cached: ask the hub
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    hint = "Pass a local model folder or a config.json path instead."
    if not offline:
        try:
            socket.create_connection((host, 443), timeout=3).close()
        except OSError as e:
            offline = True
            hint = f"({host} is unreachable: {e}). " + hint
    if offline:
        raise ModelSourceError(f"model {repo_id!r}: it is a hub id, its config.json is not in the local Hugging Face cache, and this machine is offline {hint}")
    try:
        path = hf_hub_download(repo_id, "config.json")
    except Exception as e:  # unknown or gated repo: the cause is in the message
        raise ModelSourceError(f"model {repo_id!r}: could not fetch its config.json from the hub ({type(e).__name__}: {str(e)[:200]}). {hint}") from None
    return _read_json(Path(path))
