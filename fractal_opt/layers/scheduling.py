"""Layer 3, scheduling: how requests share the machine (sequential vs padded static batches)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import RecipeError
from ..machine import Machine
from ..passes import Layer, Pass, register
from ..plan import Plan

__all__ = ["Batching"]


@register
@dataclass(frozen=True, kw_only=True)
class Batching(Pass):
    """Serve requests one at a time (sequential) or in left-padded batches of up to ``batch_size``.

    A batch shares each weight read among its requests: decode is bound by bytes moved, so the
    machine produces more tokens per second in total while each request gets a little slower.
    """

    name = "batching"
    layer = Layer.SCHEDULING

    mode: Literal["sequential", "static"] = "static"
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise RecipeError(f"pass 'batching', parameter 'batch_size': got {self.batch_size}, expected an integer >= 1.")

    def check(self, plan: Plan, machine: Machine) -> str | None:
        size = 1 if self.mode == "sequential" else self.batch_size
        if (plan.scheduling.batching, plan.scheduling.batch_size) == (self.mode, size):
            return f"the plan already serves requests {self.mode} with batch size {size}"
        if plan.model.kv_cache == "static" and self.mode == "static":
            return "padded batches need a dynamic KV cache in this engine; the plan uses a static cache"
        return None

    def apply(self, plan: Plan) -> Plan:
        size = 1 if self.mode == "sequential" else self.batch_size
        return plan.replace_section("scheduling", batching=self.mode, batch_size=size)
