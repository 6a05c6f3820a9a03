"""Layer 2, model: what the model stores and moves (weight quantization, KV cache)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..machine import Machine
from ..passes import Layer, Pass, register
from ..plan import Plan

__all__ = ["KVCache", "Quantize"]

# Which package implements each backend (for check messages and the machine's package census).
BACKEND_PACKAGES = {"torchao": "torchao", "bitsandbytes": "bitsandbytes"}


@register
@dataclass(frozen=True, kw_only=True)
class Quantize(Pass):
    """Store linear-layer weights in 8 or 4 bits (weight-only) to cut the bytes read per decode token.

    ``backend: auto`` picks what works on the plan's device: bitsandbytes on CUDA; torchao on CPU
    (int8 weight-only decoded SmolLM2 at ~16 tokens/s there against ~8 for bitsandbytes int8;
    ../shared/research/cpu-passes.md). 4 bits: torchao int4 weight-only with ``group_size`` groups
    (``IntxWeightOnlyConfig``), or bitsandbytes nf4. ``skip`` keeps modules in full precision.
    """

    name = "quantize"
    layer = Layer.MODEL

    bits: Literal[8, 4] = 8
    backend: Literal["auto", "torchao", "bitsandbytes"] = "auto"
    group_size: int = 32  # weights per scale at 4 bits (torchao); ignored at 8 bits (per channel)
    skip: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        from ..errors import RecipeError

        if self.group_size < 1 or self.group_size & (self.group_size - 1):
            raise RecipeError(f"pass 'quantize', parameter 'group_size': got {self.group_size}, expected a power of two such as 32, 64 or 128.")

    def resolve_backend(self, plan: Plan) -> str:
        if self.backend != "auto":
            return self.backend
        return "bitsandbytes" if plan.hardware.device.startswith("cuda") else "torchao"

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.model.weight_bits is not None:
            return f"the plan's weights are already quantized to {plan.model.weight_bits} bits"
        backend = self.resolve_backend(plan)
        package = BACKEND_PACKAGES[backend]
        if not machine.has_package(package):
            return f"backend {backend!r} needs the {package} package (pip install {package})"
        if plan.hardware.device == "mps":
            return f"backend {backend!r} has no MPS kernels"
        return None

    def unavailable(self, machine: Machine) -> str | None:
        backends = [self.backend] if self.backend != "auto" else ["bitsandbytes" if machine.has_cuda else "torchao"]
        for backend in backends:
            package = BACKEND_PACKAGES[backend]
            if not machine.has_package(package):
                return f"backend {backend!r} needs the {package} package (pip install {package})"
        return None

    def apply(self, plan: Plan) -> Plan:
        group = self.group_size if self.bits == 4 else None
        return plan.replace_section("model", weight_bits=self.bits, quant_backend=self.resolve_backend(plan), quant_group_size=group, quant_skip=self.skip)


@register
@dataclass(frozen=True, kw_only=True)
class KVCache(Pass):
    """Choose how attention keys/values are kept between decode steps: dynamic, static, or off.

    ``off`` recomputes the whole sequence at every step; it exists to show what the cache buys
    (the pipeline rolls it back on any workload longer than a few tokens).
    """

    name = "kv_cache"
    layer = Layer.MODEL

    implementation: Literal["dynamic", "static", "off"] = "static"

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.model.kv_cache == self.implementation:
            return f"the plan already uses the {self.implementation} KV cache"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("model", kv_cache=self.implementation)
