"""What a GGUF file holds, read from its header (fractal_opt.weights.model_headers: no model load).

The pipeline reads ``weight_bytes`` (memory guard, roofline) and ``quantized_linear_layers`` (did
quantization apply); the KV keys mirror the transformers runtime's ``kv_census`` so reports compare
both runtimes with the same names.
"""

from __future__ import annotations

from typing import Any

from ...engine.protocol import ContextLimit
from ...weights.model_headers import gguf_header
from .settings import KV_BYTES_PER_VALUE, ServerSettings, describe

__all__ = ["context_limits", "eos_token_id", "gguf_census"]

# ggml storage types that hold full-precision values; any other type is a quantized block format.
_FULL_PRECISION = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})


def _read(path: str) -> dict[str, Any]:
    """Tensor bytes by type and the attention shape from the GGUF header (cached per file version)."""
    header = gguf_header(path)
    by_type: dict[str, int] = {}
    linear = quantized = 0
    for t in header.tensors:
        kind = t.type_name
        by_type[kind] = by_type.get(kind, 0) + t.n_bytes
        # 2-D weights of the blocks and the output head are the "linear layers"; the token
        # embedding is a lookup table, counted in bytes but not as a linear layer.
        if len(t.shape) == 2 and t.name.endswith(".weight") and not t.name.startswith("token_embd"):
            linear += 1
            quantized += kind not in _FULL_PRECISION
    field = header.metadata.get
    arch = field("general.architecture") or "llama"
    heads = int(field(f"{arch}.attention.head_count") or 1)
    return {
        "bytes_by_type": by_type,
        "linear_layers": linear,
        "quantized_linear_layers": quantized,
        "architecture": arch,
        "layers": int(field(f"{arch}.block_count") or 0),
        "kv_heads": int(field(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(field(f"{arch}.attention.key_length") or int(field(f"{arch}.embedding_length") or 0) // heads),
        "n_ctx_train": field(f"{arch}.context_length"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    }


def eos_token_id(path: str) -> int | None:
    """The GGUF's end-of-sequence token id (None when its metadata names none)."""
    eos = _read(path)["eos_token_id"]
    return None if eos is None else int(eos)


def context_limits(settings: ServerSettings) -> list[ContextLimit]:
    """What bounds one request: llama.cpp's context per request (its share of the KV cache: past it
    llama.cpp refuses a prompt and ends an answer) and the GGUF's trained context, when it says one."""
    s = settings
    pool = f"n_ctx {s.kv_tokens:,} shared by {s.slots} slot(s)" if s.unified else f"n_ctx {s.kv_tokens:,} over {s.slots} slot(s)"
    out = [ContextLimit(s.context_per_request, "llama.cpp's context per request", f"{pool}; the context_cap pass sets it")]
    trained = _read(s.model_path)["n_ctx_train"]
    if isinstance(trained, int) and trained > 0:
        out.append(ContextLimit(trained, "the model's context", "the GGUF's context_length"))
    return out


def gguf_census(settings: ServerSettings, *, context_cap: int | None) -> dict[str, Any]:
    """The census keys the pipeline reads, for the GGUF and llama.cpp settings of ``settings``.

    KV bytes: 2 (K and V) x layers x kv_heads x head_dim x bytes per value of the cache type, per
    1k tokens. llama.cpp allocates the whole cache (``kv_tokens``) at load, reported as
    ``kv_bytes_allocated``.
    """
    info = _read(settings.model_path)
    values_per_token = 2 * info["layers"] * info["kv_heads"] * info["head_dim"]
    stored = int(values_per_token * KV_BYTES_PER_VALUE[settings.cache_type] * 1000)
    plain = int(values_per_token * KV_BYTES_PER_VALUE["f16"] * 1000)
    by_type = dict(info["bytes_by_type"])
    out: dict[str, Any] = {
        "runtime": "llama_cpp",
        "bytes_by_type": by_type,
        "weight_bytes": sum(by_type.values()),
        "weight_types": sorted(by_type),
        "linear_layers": info["linear_layers"],
        "quantized_linear_layers": info["quantized_linear_layers"],
        "kv_cache": settings.cache_type,
        "kv_bytes_per_1k_tokens": stored,
        "kv_bytes_per_1k_tokens_plain": plain,  # llama.cpp's default f16 cache
        "kv_bytes_saved_per_1k_tokens": plain - stored,
        "kv_bytes_allocated": stored * settings.kv_tokens // 1000,
        "threads": settings.threads,  # n_threads and the batch threads it ran with (what an export passes)
        "llama_cpp": describe(settings),
    }
    if context_cap is not None:
        out["context_cap"] = context_cap
        out["kv_bytes_at_cap"] = stored * context_cap // 1000
    return out
