"""Loading a plan's model: source, dtype, attention kernel, device, quantization; and the census.

Called only by ``Engine.build`` (which caches the result by ``Plan.weights_key()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import models
from .plan import Plan

__all__ = ["census", "load", "resolve_device"]


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"



def load(plan: Plan, *, progress=print) -> tuple[Any, Any]:
    """Load the model and tokenizer as the plan says (weights, dtype, attention, device, quantization)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = models.resolve(plan.source)
    path = models.materialize(source, progress=progress)
    hw, mp = plan.hardware, plan.model
    device = resolve_device(hw.device)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, hw.dtype), "attn_implementation": hw.attention}
    if mp.weight_bits is not None and mp.quant_backend == "bitsandbytes":
        from transformers import BitsAndBytesConfig

        if mp.weight_bits == 8:
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(mp.quant_skip))
        else:
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=kwargs["dtype"], llm_int8_skip_modules=list(mp.quant_skip)
            )
        kwargs["device_map"] = device
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if "device_map" not in kwargs and device != "cpu":
        model = model.to(device)
    if mp.weight_bits is not None and mp.quant_backend == "torchao":
        _quantize_torchao(model, mp.weight_bits, mp.quant_group_size, mp.quant_skip)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left so new tokens line up
    return model, tokenizer


def _quantize_torchao(model: Any, bits: int, group_size: int | None, skip: Sequence[str]) -> None:
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup, quantize_

    # int8: per-channel weight-only (the fastest int8 path on CPU, see cpu-passes.md). int4: the
    # Intx config, the one torchao int4 path with CPU kernels (Int4WeightOnlyConfig is GPU-only).
    config = Int8WeightOnlyConfig() if bits == 8 else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size or 32))

    def wanted(module: torch.nn.Module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and not any(fqn == s or fqn.endswith("." + s) or fqn.startswith(s + ".") for s in skip)

    quantize_(model, config, filter_fn=wanted)


def _tensor_bytes(t: Any) -> int:
    """Bytes a tensor really holds, looking inside quantized tensor subclasses."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def census(model: Any) -> dict[str, Any]:
    """What the built model holds: bytes by storage type, and how many linear layers are quantized."""
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
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = sum(1 for m in linear if type(m.weight.data if type(m.weight) is torch.nn.Parameter else m.weight).__name__ not in ("Tensor", "Parameter") or m.weight.dtype in (torch.int8, torch.uint8))
    return {"bytes_by_type": by_type, "weight_bytes": sum(by_type.values()), "linear_layers": len(linear), "quantized_linear_layers": quantized}
