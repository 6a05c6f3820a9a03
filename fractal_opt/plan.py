"""Plan: a frozen description of a deployment, one section per layer of the tower.

Every default means "what a newcomer gets with plain transformers": float32 weights, the default
(sdpa) attention, torch's default thread count, a dynamic KV cache, one request at a time and
greedy decoding up to the workload's token budget. Passes never mutate a plan; they return a new
one with :func:`dataclasses.replace`, so rolling a pass back means keeping the previous plan.

Example:
    >>> from fractal_opt.plan import Plan
    >>> plan = Plan(source="smollm2-135m-instruct")
    >>> plan.hardware.dtype
    'float32'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SECTIONS",
    "ApplicationPlan",
    "HardwarePlan",
    "ModelPlan",
    "Plan",
    "SchedulingPlan",
]


@dataclass(frozen=True, kw_only=True)
class HardwarePlan:
    """Layer 1: where and how the math runs."""

    device: str = "cpu"  # cpu | cuda | mps; "auto" resolves when the engine builds
    dtype: str = "float32"  # float32 | bfloat16 | float16
    threads: int | str | None = None  # torch intra-op threads; "auto" = physical cores; None = torch's default
    attention: str = "sdpa"  # transformers' default kernel for Llama-family models


@dataclass(frozen=True, kw_only=True)
class ModelPlan:
    """Layer 2: what the model stores and moves."""

    weight_bits: int | None = None  # None = weights stay in the hardware dtype
    quant_backend: str | None = None  # torchao | bitsandbytes (resolved from "auto" by the pass)
    quant_group_size: int | None = None  # weights per scale (4-bit); None = per channel
    quant_skip: tuple[str, ...] = ()  # module names left unquantized (mixed precision)
    kv_cache: str = "dynamic"  # dynamic | static | off


@dataclass(frozen=True, kw_only=True)
class SchedulingPlan:
    """Layer 3: how requests share the machine."""

    batching: str = "sequential"  # sequential | static
    batch_size: int = 1  # requests per padded batch (static batching)


@dataclass(frozen=True, kw_only=True)
class ApplicationPlan:
    """Layer 4: how much work a request asks for."""

    max_new_tokens: int | None = None  # cap on generated tokens; None = the workload's budget
    do_sample: bool = False  # greedy unless a decoding pass turns sampling on
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float = 1.0


SECTIONS: dict[str, type] = {
    "hardware": HardwarePlan,
    "model": ModelPlan,
    "scheduling": SchedulingPlan,
    "application": ApplicationPlan,
}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A whole deployment: the model source plus one section per layer.

    ``applied`` lists the names of the passes that produced this plan, in order.
    """

    source: str
    hardware: HardwarePlan = field(default_factory=HardwarePlan)
    model: ModelPlan = field(default_factory=ModelPlan)
    scheduling: SchedulingPlan = field(default_factory=SchedulingPlan)
    application: ApplicationPlan = field(default_factory=ApplicationPlan)
    applied: tuple[str, ...] = ()

    def replace_section(self, section: str, /, **changes: Any) -> Plan:
        """Return a copy with ``changes`` made to one section (``"hardware"``, ``"model"``, ...)."""
        new_section = dataclasses.replace(getattr(self, section), **changes)
        return dataclasses.replace(self, **{section: new_section})

    def with_applied(self, name: str) -> Plan:
        """Return a copy that records ``name`` as the latest applied pass."""
        return dataclasses.replace(self, applied=(*self.applied, name))

    def weights_key(self) -> tuple:
        """The fields that decide the loaded weights; plans sharing it share one loaded model."""
        hw, m = self.hardware, self.model
        return (self.source, hw.device, hw.dtype, hw.attention, m.weight_bits, m.quant_backend, m.quant_group_size, m.quant_skip)

    def numerics_key(self) -> tuple:
        """The fields that can change next-token distributions (the model-level quality probes)."""
        return (*self.weights_key(), self.model.kv_cache)

    def to_dict(self) -> dict[str, Any]:
        """A JSON/YAML-friendly dict (tuples become lists)."""
        out: dict[str, Any] = {"source": self.source}
        for name in SECTIONS:
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(self, name)).items()}
        out["applied"] = list(self.applied)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`."""
        sections = {}
        for name, section_cls in SECTIONS.items():
            values = dict(data.get(name) or {})
            for f in dataclasses.fields(section_cls):
                if isinstance(f.default, tuple) and f.name in values:
                    values[f.name] = tuple(values[f.name])
            sections[name] = section_cls(**values)
        return cls(source=data["source"], applied=tuple(data.get("applied", ())), **sections)
