"""The census of a built transformers model: what it holds, and its KV-cache arithmetic.

``census(model, plan)`` counts the bytes of every parameter by storage type (looking inside
quantized tensor subclasses), the linear layers and how many of them are quantized, what the
quantization recorded on the model (``_fractal_quant``, set by :mod:`.loading`), the device map,
and, given the plan, the KV-cache bytes per 1k tokens. The KV numbers use the same arithmetic as
the roofline and the pre-flight (:mod:`fractal_opt.measure.roofline`), so the three agree.

Example:
    >>> census(model, plan)["quantized_linear_layers"]   # doctest: +SKIP
    210
"""

from __future__ import annotations

from typing import Any

from ...measure.budget import shape_from_config
from ...measure.roofline import dtype_bits, kv_bytes_per_token, quantized_kv_bytes_per_token
from ...tower.plan import Plan

__all__ = ["census", "kv_census"]


def _tensor_bytes(t: Any) -> int:
    """Bytes a tensor really holds, looking inside quantized tensor subclasses."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _is_quantized(module: Any) -> bool:
    import torch

    weight = getattr(module, "weight", None)
    if weight is None:
        return False
    data = weight.data if type(weight) is torch.nn.Parameter else weight
    return type(data).__name__ not in ("Tensor", "Parameter") or data.dtype in (torch.int8, torch.uint8)


def census(model: Any, plan: Plan | None = None) -> dict[str, Any]:
    """What the built model holds: bytes by storage type, how many linear layers are quantized,
    what the quantization kept in full precision, and (given the plan) the KV-cache arithmetic."""
    import torch

    by_type: dict[str, int] = {}
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:  # tied weights (lm_head = embed_tokens) count once
            continue
        seen.add(id(p))
        data = p.data if type(p) is torch.nn.Parameter else p
        kind = type(data).__name__
        key = str(data.dtype).removeprefix("torch.") if kind in ("Tensor", "Parameter") else f"{kind}({str(data.dtype).removeprefix('torch.')})"
        if kind == "Int8Params":
            key = "int8(bitsandbytes)"
        by_type[key] = by_type.get(key, 0) + _tensor_bytes(data)
    from torch.utils.mkldnn import MkldnnLinear

    for m in model.modules():  # prepacked weights are buffers of their own (a copy where the weight was tied)
        if isinstance(m, MkldnnLinear):
            by_type["mkldnn(float32)"] = by_type.get("mkldnn(float32)", 0) + _tensor_bytes(m.weight)
    # quanto swaps nn.Linear for QLinear (a subclass), so isinstance still finds it.
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = sum(1 for m in linear if _is_quantized(m))
    out: dict[str, Any] = {"bytes_by_type": by_type, "weight_bytes": sum(by_type.values()), "linear_layers": len(linear), "quantized_linear_layers": quantized}
    record = getattr(model, "_fractal_quant", None)
    if record is not None:
        out["quantization"] = record
    device_map = getattr(model, "hf_device_map", None)
    if device_map and len(set(device_map.values())) > 1:
        placed: dict[str, int] = {}
        for where in device_map.values():
            placed[str(where)] = placed.get(str(where), 0) + 1
        out["device_map"] = placed  # modules per device ("disk" = offloaded)
    if plan is not None:
        out.update(kv_census(model.config, plan))
    return out


def kv_census(config: Any, plan: Plan) -> dict[str, Any]:
    """KV-cache memory from the model config, with the roofline's arithmetic
    (:func:`fractal_opt.measure.roofline.kv_bytes_per_token`: 2 (K and V) x layers x kv_heads x
    head_dim x bytes per token).

    Returns bytes per 1k tokens of context for the plan's cache and for the plain cache in the
    plan's dtype, the bytes saved, and (static cache with a context cap) the bytes reserved up
    front per sequence. Quantized caches count their payload plus one scale and one zero-point per
    group of values (:func:`~fractal_opt.measure.roofline.quantized_kv_bytes_per_token`), and leave
    out the newest 128 tokens (residual_length) that stay in full precision: a per-1k figure for
    long contexts.
    """
    shape = shape_from_config(config.to_dict(), where="model config")
    layers = shape.layers
    bits = dtype_bits(plan.hardware.dtype)
    full = kv_bytes_per_token(shape, kv_bits=bits) * 1000
    mp = plan.model
    if mp.kv_cache == "quantized" and mp.kv_bits:
        stored = int(quantized_kv_bytes_per_token(shape, kv_bits=mp.kv_bits, scale_bits=bits) * 1000)
    elif mp.kv_cache == "off":
        stored = 0  # nothing kept: every step recomputes the whole sequence instead
    elif mp.kv_cache == "offloaded":
        stored = int(full * min(layers, 2) / layers)  # device-resident: the current layer and the prefetched next one
    else:
        stored = full
    out: dict[str, Any] = {"kv_cache": mp.kv_cache, "kv_bytes_per_1k_tokens": stored, "kv_bytes_per_1k_tokens_plain": full, "kv_bytes_saved_per_1k_tokens": full - stored}
    if mp.context_cap is not None:
        out["context_cap"] = mp.context_cap
        out["kv_bytes_at_cap"] = stored * mp.context_cap // 1000  # one sequence at the cap (the static cache reserves this)
    return out
