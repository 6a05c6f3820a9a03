"""Layer 4, application: how much work a request asks for (token budget, decoding parameters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import RecipeError
from ..machine import Machine
from ..passes import Layer, Pass, register
from ..plan import Plan

__all__ = ["Decoding", "MaxNewTokens"]


@register
@dataclass(frozen=True, kw_only=True)
class MaxNewTokens(Pass):
    """Cap the tokens generated per request: the fastest token is the one never generated."""

    name = "max_new_tokens"
    layer = Layer.APPLICATION

    limit: int = 256

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise RecipeError(f"pass 'max_new_tokens', parameter 'limit': got {self.limit}, expected an integer >= 1.")

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.application.max_new_tokens == self.limit:
            return f"the plan already caps generation at {self.limit} tokens"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("application", max_new_tokens=self.limit)


@register
@dataclass(frozen=True, kw_only=True)
class Decoding(Pass):
    """Set the decoding strategy: greedy, or sampling with temperature / top_p / top_k; repetition penalty.

    Sampled decoding is measured with the workload's fixed seed, so runs stay comparable.
    """

    name = "decoding"
    layer = Layer.APPLICATION

    strategy: Literal["greedy", "sample"] = "greedy"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        problems = []
        if self.temperature <= 0:
            problems.append(f"'temperature' must be > 0 (use strategy: greedy for deterministic output), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"'top_p' must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            problems.append(f"'top_k' must be >= 1 or null, got {self.top_k}")
        if self.repetition_penalty <= 0:
            problems.append(f"'repetition_penalty' must be > 0 (1.0 = off), got {self.repetition_penalty}")
        if problems:
            raise RecipeError("pass 'decoding': " + "; ".join(problems) + ".")

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if self.apply(plan).application == plan.application:
            return "the plan already decodes with these parameters"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section(
            "application",
            do_sample=self.strategy == "sample",
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
        )
