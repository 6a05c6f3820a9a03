"""Loading a plan's model: source, placement, dtype, attention kernel, quantization.

Called only by ``Engine.build`` (which caches the result by ``Plan.weights_key()``). Every
quantization backend goes through the same skip rules (fractal_opt.tower.quant_select), and what was
done is recorded on the model (``_fractal_quant``) so that :func:`.census.census` can report it:
the backend and method, the modules kept in full precision and, with sensitivity, each block's KL.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ...core.errors import EngineError
from ...core.machine import resolve_device
from ...tower.plan import Plan
from ...tower.quant_select import block_index, expand, skipped
from ...weights import models

__all__ = ["load"]


def _max_memory(spec: tuple[str, ...]) -> dict[int | str, str]:
    # "0=20GiB" -> {0: "20GiB"}: accelerate wants GPU indices as ints and "cpu"/"disk" as strings.
    out: dict[int | str, str] = {}
    for item in spec:
        key, size = item.split("=", 1)
        out[int(key) if key.isdigit() else key] = size
    return out


def load(plan: Plan, *, progress: Callable[[str], None] = print) -> tuple[Any, Any]:
    """Load the model and tokenizer as the plan says (weights, dtype, attention, placement, quantization)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = models.resolve(plan.source)
    path = models.materialize(source, progress=progress)
    hw, mp = plan.hardware, plan.model
    device = resolve_device(hw.device)
    kwargs = _load_kwargs(plan, torch, path, progress)
    record: dict[str, Any] | None = None
    if mp.weight_bits is not None:
        record = {"backend": mp.quant_backend, "method": mp.quant_method, "bits": mp.weight_bits, "group_size": mp.quant_group_size, "skip": list(mp.quant_skip)}
    if record is not None and mp.quant_backend == "bitsandbytes":
        config = AutoConfig.from_pretrained(path, trust_remote_code=mp.trust_remote_code)
        names, n_blocks = _linear_names_from_config(config)
        keep = expand(names, mp.quant_skip, n_blocks=n_blocks)
        kwargs["quantization_config"] = _bnb_config(mp.weight_bits, mp.quant_method, kwargs["dtype"], keep)
        kwargs.setdefault("device_map", device)
        record["skipped_modules"] = keep
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=mp.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if "device_map" not in kwargs and device != "cpu":
        model = model.to(device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left so new tokens line up
    if record is not None and mp.quant_backend in ("torchao", "quanto"):
        skip = tuple(mp.quant_skip)
        if mp.quant_sensitivity_max_kl is not None:
            from .sensitivity import choose_skips

            progress(f"quantize: measuring each block's sensitivity ({mp.quant_backend} {mp.weight_bits}-bit)")
            n_blocks = _n_blocks(model)
            report = choose_skips(
                model,
                tokenizer,
                quantize=lambda block, prefix: _quantize_post_load(block, plan, skip, prefix=prefix, n_blocks=n_blocks),
                skip=skip,
                n_blocks=n_blocks,
                max_kl=mp.quant_sensitivity_max_kl,
            )
            record["sensitivity"] = report
            skip = skip + tuple(f"block:{i}" for i in report["kept_blocks"])
            record["skip"] = list(skip)
        names, n_blocks = _linear_names(model)
        record["skipped_modules"] = expand(names, skip, n_blocks=n_blocks)
        _quantize_post_load(model, plan, skip)
    if record is not None:
        model._fractal_quant = record  # read by census.census()
    if hw.prepack:
        _prepack(model, hw.prepack)
    return model, tokenizer


def _load_kwargs(plan: Plan, torch: Any, path: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """``from_pretrained`` arguments for the plan's dtype, attention, placement and trust."""
    hw = plan.hardware
    kwargs: dict[str, Any] = {"dtype": getattr(torch, hw.dtype), "attn_implementation": hw.attention}
    if plan.model.trust_remote_code:  # the recipe's model: allows the folder's own Python code (weights/checks.py refuses it otherwise)
        progress(f"trust_remote_code: running the Python code in {path} (the recipe's model: allows it)")
        kwargs["trust_remote_code"] = True
    if hw.device_map is not None:
        kwargs["device_map"] = hw.device_map
        if hw.max_memory:
            kwargs["max_memory"] = _max_memory(hw.max_memory)
        if hw.offload_folder is not None:
            kwargs["offload_folder"] = hw.offload_folder
    return kwargs


def _prepack(model: Any, names: tuple[str, ...]) -> None:
    """Swap each named float32 CPU ``nn.Linear`` for oneDNN's prepacked ``MkldnnLinear``."""
    import torch
    from torch.utils import mkldnn

    from ...core.errors import closest

    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
            raise EngineError(f"prepack: the model has no module {name!r}.{closest(name, linear)}") from None
        weight = getattr(module, "weight", None)
        if type(module) is not torch.nn.Linear or type(weight) is not torch.nn.Parameter or weight.dtype != torch.float32 or weight.device.type != "cpu":
            what = f"{type(module).__name__} with {type(weight).__name__} weights" + (f" ({weight.dtype} on {weight.device})" if weight is not None else "")
            raise EngineError(f"prepack: {name!r} is a {what}; oneDNN prepacking takes a float32 torch.nn.Linear on the CPU (quantized modules cannot be prepacked)")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, mkldnn.MkldnnLinear(module, torch.float32))


# --------------------------------------------------------------------------- backends


def _bnb_config(bits: int, method: str | None, compute_dtype: Any, keep: list[str]) -> Any:
    from transformers import BitsAndBytesConfig

    # Full names, escaped: transformers matches skip entries as regexes anchored at the start.
    skip = [re.escape(n) for n in keep]
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=method or "nf4", bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=skip)


def _quantize_post_load(model: Any, plan: Plan, skip: tuple[str, ...], *, prefix: str = "", n_blocks: int | None = None) -> None:
    """Quantize the linear layers of ``model`` (or of a sub-module whose full name is ``prefix``)
    that ``skip`` does not keep, with the plan's post-load backend."""
    import torch

    mp = plan.model
    n_blocks = _n_blocks(model) if n_blocks is None else n_blocks

    def wanted(module: torch.nn.Module, fqn: str) -> bool:
        full = f"{prefix}.{fqn}" if prefix and fqn else (prefix or fqn)
        return isinstance(module, torch.nn.Linear) and not skipped(full, skip, n_blocks=n_blocks)

    if mp.quant_backend == "torchao":
        from torchao.quantization import quantize_

        quantize_(model, _torchao_config(mp.weight_bits or 8, mp.quant_method, mp.quant_group_size, plan), filter_fn=wanted)
    elif mp.quant_backend == "quanto":
        try:
            from optimum.quanto import freeze, qint4, qint8, quantize
        except ImportError:
            raise EngineError("backend 'quanto' needs the optimum-quanto package (pip install 'fractal-opt[quant]' or optimum-quanto)") from None
        include = [name for name, m in model.named_modules() if wanted(m, name)]
        if include:
            quantize(model, weights=qint8 if mp.weight_bits == 8 else qint4, include=include)
            freeze(model)
    else:
        raise EngineError(f"backend {mp.quant_backend!r} does not quantize a loaded model; post-load backends are torchao and quanto")


def _torchao_config(bits: int, method: str | None, group_size: int | None, plan: Plan) -> Any:
    import torch
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup

    if bits == 8:
        return Int8DynamicActivationInt8WeightConfig() if method == "dynamic" else Int8WeightOnlyConfig()
    if resolve_device(plan.hardware.device).startswith("cuda"):
        from torchao.quantization import Int4WeightOnlyConfig

        return Int4WeightOnlyConfig(group_size=group_size or 128)
    # Int4WeightOnlyConfig has no CPU packing in torchao 0.18 (cpu-passes.md); Intx does.
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size or 32))


# --------------------------------------------------------------------------- module names


def _linear_names(model: Any) -> tuple[list[str], int]:
    import torch

    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return names, _n_blocks(model)


def _linear_names_from_config(config: Any) -> tuple[list[str], int]:
    """Linear-layer names of a model built from ``config`` on the meta device (no weights read)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    return _linear_names(skeleton)


def _n_blocks(model: Any) -> int:
    indices = {i for n, _ in model.named_modules() if (i := block_index(n)) is not None}
    return max(indices) + 1 if indices else 0
