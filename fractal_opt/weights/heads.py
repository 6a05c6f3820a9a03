"""A model's attention heads, read from its files, and whether a tensor-parallel degree divides them.

Tensor parallelism gives each rank a share of every layer's attention heads, so vLLM requires the
degree to divide the query heads, and the key/value heads either to be divisible by it or to
divide it (then each KV head is replicated on ``degree / kv_heads`` ranks): vLLM's
``ModelConfig.verify_with_parallel_config`` and its ``get_num_kv_heads``. Checked here from the
config.json or GGUF header alone, so a recipe with such a split is refused by ``fractal-opt
check`` before anything loads.

Example:
    >>> divides_heads(9, 3, 2)
    'the model has 9 attention heads, which tensor parallel degree 2 does not divide (degrees that do: [1, 3, 9])'
"""

from __future__ import annotations

from .models import ModelSource, gguf_metadata, read_config, resolve

__all__ = ["attention_heads", "divides_heads", "tensor_parallel_problem"]


def attention_heads(source: ModelSource) -> tuple[int, int] | None:
    """``(query heads, key/value heads)`` from the model's files; None where they do not say (a hub id)."""
    if source.kind in ("gguf", "embedded") and source.path is not None:
        meta = gguf_metadata(str(source.path))
        arch = meta.get("general.architecture", "llama")
        heads, kv = meta.get(f"{arch}.attention.head_count"), meta.get(f"{arch}.attention.head_count_kv")
    elif source.kind == "local" and source.path is not None:
        config = read_config(source.path)
        config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    else:
        return None
    if not isinstance(heads, int) or heads < 1:
        return None
    return heads, kv if isinstance(kv, int) and kv >= 1 else heads


def divides_heads(heads: int, kv_heads: int, degree: int) -> str | None:
    """Why tensor parallel ``degree`` cannot split ``heads`` query and ``kv_heads`` key/value heads, or None."""
    if heads % degree:
        fits = [d for d in range(1, heads + 1) if heads % d == 0]
        return f"the model has {heads} attention heads, which tensor parallel degree {degree} does not divide (degrees that do: {fits})"
    if kv_heads % degree and degree % kv_heads:
        return f"the model has {kv_heads} key/value heads: tensor parallel degree {degree} must divide them or be a multiple of them"
    return None


def tensor_parallel_problem(model: str, degree: int) -> str | None:
    """Why ``model`` (a recipe's model value) cannot be split ``degree`` ways by tensor parallelism, or None (also when its files do not say)."""
    if degree <= 1:
        return None
    heads = attention_heads(resolve(model))
    return None if heads is None else divides_heads(*heads, degree)
