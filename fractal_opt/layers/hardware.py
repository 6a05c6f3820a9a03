"""Layer 1, hardware: where and how the math runs (dtype, threads, attention kernel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import RecipeError
from ..machine import Machine
from ..passes import Layer, Pass, register
from ..plan import Plan

__all__ = ["Attention", "Dtype", "Threads"]


@register
@dataclass(frozen=True, kw_only=True)
class Dtype(Pass):
    """Run weights and activations in a narrower float type (fewer bytes per decode token).

    On a CPU without bf16 matrix instructions the half types read half the bytes per decode step
    but compute prefill in slow emulated kernels: a trade the policy judges, not this pass.
    """

    name = "dtype"
    layer = Layer.HARDWARE

    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.hardware.dtype == self.dtype:
            return f"the plan already runs in {self.dtype}"
        device = plan.hardware.device
        if device.startswith("cuda") and self.dtype == "bfloat16" and machine.has_cuda and not machine.cuda_bf16:
            return "this GPU has no bfloat16 support (compute capability < 8.0); use float16"
        if device == "mps" and self.dtype == "bfloat16":
            return "bfloat16 is not supported on every MPS device; use float16"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", dtype=self.dtype)


@register
@dataclass(frozen=True, kw_only=True)
class Threads(Pass):
    """Set torch's intra-op thread count (``auto`` = the physical cores of this machine)."""

    name = "threads"
    layer = Layer.HARDWARE

    count: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.count, int) and self.count < 1:
            raise RecipeError(f"pass 'threads', parameter 'count': got {self.count}, expected an integer >= 1 or 'auto'.")

    def resolve(self, machine: Machine) -> int:
        """The thread count this pass asks for on ``machine``."""
        return machine.physical_cores if self.count == "auto" else self.count

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.hardware.device != "cpu":
            return f"thread count only matters for CPU inference; the plan runs on {plan.hardware.device}"
        if isinstance(self.count, int) and self.count > machine.logical_cores:
            return f"count={self.count} exceeds the {machine.logical_cores} logical cores of this machine"
        return None

    def apply(self, plan: Plan) -> Plan:
        # "auto" stays symbolic in the plan so that a recipe moves between machines; the engine
        # resolves it to the physical cores of the machine it runs on. An int pins it.
        return plan.replace_section("hardware", threads=self.count)


@register
@dataclass(frozen=True, kw_only=True)
class Attention(Pass):
    """Choose the attention kernel: eager (reference), sdpa (torch fused), flash_attention_2 (CUDA)."""

    name = "attention"
    layer = Layer.HARDWARE

    implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.hardware.attention == self.implementation:
            return f"the plan already uses {self.implementation} attention"
        if self.implementation == "flash_attention_2":
            if (why := self.unavailable(machine)) is not None:
                return why
            if not plan.hardware.device.startswith("cuda"):
                return "flash_attention_2 needs a CUDA GPU; this plan runs on " + plan.hardware.device
            if plan.hardware.dtype == "float32":
                return "flash_attention_2 runs only in float16 or bfloat16; add a dtype pass first"
        return None

    def unavailable(self, machine: Machine) -> str | None:
        if self.implementation == "flash_attention_2":
            if not machine.has_cuda:
                return "flash_attention_2 needs a CUDA GPU (GPU-only pass)"
            if not machine.has_package("flash-attn"):
                return "flash_attention_2 needs the flash-attn package (pip install flash-attn)"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", attention=self.implementation)
