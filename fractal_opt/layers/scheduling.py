"""Layer 3, scheduling: how requests share the machine.

- ``batching``: one at a time (sequential), left-padded static batches, or transformers'
  continuous batching (requests join and leave the running batch at every step).
- ``concurrency``: the most requests in flight; ``mode: ramp`` tries rising levels (8, 16, 32, ...)
  and stops at the last one where no guard trips.
- ``streaming``: callers get tokens as they are generated, or all at the end.
- ``queue``: a bounded queue and a per-request timeout.
- ``prefix_cache``: the server reuses the KV cache of a prompt prefix it has seen (llama.cpp, vLLM).

These passes change how requests are served, so the pipeline judges them under load (the
workload's ``load`` profile): aggregate output tokens/s is the objective, TTFT / ITL percentiles
are guards a recipe sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import RecipeError
from ..machine import Machine
from ..passes import Layer, Pass, register
from ..plan import Plan

__all__ = ["Batching", "Concurrency", "PrefixCache", "Queue", "Streaming"]


@register
@dataclass(frozen=True, kw_only=True)
class Batching(Pass):
    """Serve requests one at a time, in left-padded batches, or with continuous batching.

    A batch shares each weight read among its requests: decode is bound by bytes moved, so the
    machine produces more tokens per second in total while each request gets a little slower.
    Continuous batching (transformers' ``init_continuous_batching``, paged KV cache) also lets a
    request join when it arrives and leave when it ends, instead of waiting for a whole batch.
    ``max_batch_tokens`` / ``num_blocks`` / ``page_size`` / ``max_memory_percent`` / ``scheduler``
    are its ContinuousBatchingConfig; null lets the server size them.
    """

    name = "batching"
    layer = Layer.SCHEDULING

    mode: Literal["sequential", "static", "continuous"] = "static"
    batch_size: int = 8
    max_wait_ms: float = 10.0
    max_batch_tokens: int | None = None
    num_blocks: int | None = None
    page_size: int = 256
    max_memory_percent: float | None = None
    scheduler: Literal["fifo", "prefill_first"] = "fifo"

    def __post_init__(self) -> None:
        problems = []
        if self.batch_size < 1:
            problems.append(f"'batch_size': got {self.batch_size}, expected an integer >= 1")
        if self.max_wait_ms < 0:
            problems.append(f"'max_wait_ms': got {self.max_wait_ms}, expected a number of milliseconds >= 0")
        for field_name in ("max_batch_tokens", "num_blocks"):
            value = getattr(self, field_name)
            if value is not None and value < 1:
                problems.append(f"'{field_name}': got {value}, expected an integer >= 1 or null")
        if self.page_size < 4:  # transformers' paged cache needs at least 4 tokens per page
            problems.append(f"'page_size': got {self.page_size}, expected an integer >= 4")
        if self.max_memory_percent is not None and not 0 < self.max_memory_percent <= 1:
            problems.append(f"'max_memory_percent': got {self.max_memory_percent}, expected a fraction in (0, 1] or null")
        if problems:
            raise RecipeError("pass 'batching', parameter " + "; ".join(problems) + ".")

    def unavailable(self, machine: Machine) -> str | None:
        if self.mode == "continuous" and not machine.has_package("transformers"):
            return "continuous batching needs transformers (pip install 'transformers>=5')"
        return None

    def check(self, plan: Plan, machine: Machine) -> str | None:
        # What continuous batching cannot honour in the rest of the plan (beams, stop strings, ...)
        # is the runtime's to say: Engine.refuse, asked by the runner after this check.
        if self.mode in ("static", "continuous") and plan.model.kv_cache != "dynamic":
            return f"{self.mode} batching needs a dynamic KV cache in this engine; the plan's KV cache is {plan.model.kv_cache!r}"
        attention = plan.hardware.attention
        if self.mode == "continuous" and attention not in ("sdpa", "eager") and not attention.startswith(("flash", "paged")):
            return f"continuous batching supports sdpa, eager and flash attention; the plan uses {attention!r}"
        return None

    def apply(self, plan: Plan) -> Plan:
        size = 1 if self.mode == "sequential" else self.batch_size
        changes: dict = {"batching": self.mode, "batch_size": size, "max_wait_ms": self.max_wait_ms}
        if self.mode == "continuous":
            changes.update(
                cb_max_batch_tokens=self.max_batch_tokens,
                cb_num_blocks=self.num_blocks,
                cb_page_size=self.page_size,
                cb_max_memory_percent=self.max_memory_percent,
                cb_scheduler=self.scheduler,
            )
        return plan.replace_section("scheduling", **changes)


@register
@dataclass(frozen=True, kw_only=True)
class Concurrency(Pass):
    """Limit the requests in flight; ``mode: ramp`` steps up through ``levels`` while no guard trips.

    A ramp is run by the pipeline as one step per level, smallest first (start small and step
    up, never jump to hundreds and fall over). A level holds, and is kept, when no guard trips and
    throughput does not get worse beyond noise (a ramp looks for the highest level that holds, so
    "no change" holds too); the ramp stops at the first level where a guard trips (a TTFT / ITL
    SLO of the recipe, memory headroom, failed requests), throughput gets worse, or the step
    fails. The last kept level is the answer: set latency SLOs, or it climbs while throughput
    merely holds. Under a closed-loop load the offered concurrency follows the level, so each
    level is measured with that many clients.
    """

    name = "concurrency"
    layer = Layer.SCHEDULING

    mode: Literal["fixed", "ramp"] = "fixed"
    limit: int = 8
    levels: tuple[int, ...] = (8, 16, 32, 64)

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise RecipeError(f"pass 'concurrency', parameter 'limit': got {self.limit}, expected an integer >= 1.")
        if not self.levels or any(b <= a for a, b in zip(self.levels, self.levels[1:])) or self.levels[0] < 1:
            raise RecipeError(f"pass 'concurrency', parameter 'levels': got {list(self.levels)}, expected rising integers >= 1 like [8, 16, 32].")

    def params(self) -> dict:
        """Only the fields the mode reads: a ramp's levels, or a fixed limit (reports, written recipes)."""
        if self.mode == "ramp":
            return {"mode": "ramp", "levels": list(self.levels)}
        return {"mode": "fixed", "limit": self.limit}

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.scheduling.batching == "sequential":
            return "sequential serving runs one request at a time; apply batching (static or continuous) first"
        return None

    def apply(self, plan: Plan) -> Plan:
        limit = self.limit if self.mode == "fixed" else self.levels[0]
        changes: dict = {"max_concurrency": limit}
        if plan.scheduling.batching == "static":
            changes["batch_size"] = limit  # a static batch is its requests in flight
        return plan.replace_section("scheduling", **changes)

    def expand(self) -> list[Pass]:
        """The fixed-level passes a ramp runs, smallest first (just ``self`` when fixed)."""
        if self.mode == "fixed":
            return [self]
        return [Concurrency(mode="fixed", limit=level) for level in self.levels]

    def stop(self, status: str, outcome: str) -> str | None:
        """A ramp steps up only from a level that held (was kept): a tripped guard, a worse
        throughput, a failure or a skip ends it, and the last kept level is the answer."""
        if status == "kept":
            return None
        why = {"guard": "a guard tripped", "worse": "throughput got worse", "unmeasured": "its objective could not be measured"}.get(outcome, "")
        what = {"rolled_back": "was rolled back", "failed": "failed", "skipped": "was skipped"}.get(status, status)
        return f"the previous level {what}" + (f" ({why})" if why and status == "rolled_back" else "")

    def holds(self, outcome: str) -> str | None:
        """A level that trips nothing and costs no throughput ("no change") holds and is kept, so
        the plan's limit is the highest level measured to hold, not a larger default."""
        if outcome == "no_change":
            return "no guard tripped (a concurrency ramp keeps the highest level that holds)"
        return None


@register
@dataclass(frozen=True, kw_only=True)
class Streaming(Pass):
    """Stream tokens to callers as they are generated (on), or hand over the whole answer (off).

    Streaming does not make tokens faster; it makes the first one visible sooner: the TTFT a
    caller sees is the first token's arrival with streaming on and the last token's without.
    """

    name = "streaming"
    layer = Layer.SCHEDULING

    enabled: bool = True

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("scheduling", streaming=self.enabled)


@register
@dataclass(frozen=True, kw_only=True)
class PrefixCache(Pass):
    """Let the server reuse the KV cache of a prompt prefix it has already computed (llama.cpp, vLLM).

    Chat turns and RAG prompts share long prefixes (a system prompt, the earlier turns), so a
    server that keeps their keys/values skips most of the prefill: it attacks TTFT. Off by default,
    because the measured suite repeats its prompts and a cached prefix then makes TTFT a cache hit:
    keep it for workloads whose real traffic shares prefixes. transformers refuses it.
    """

    name = "prefix_cache"
    layer = Layer.SCHEDULING

    enabled: bool = True

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("scheduling", prefix_cache=self.enabled)


@register
@dataclass(frozen=True, kw_only=True)
class Queue(Pass):
    """Bound the waiting queue and give each request a deadline: overload is refused, not absorbed.

    A request that finds ``max_queue`` requests waiting is rejected at once (RequestRejected); one
    that is not done ``timeout_s`` seconds after submission is stopped and its cache freed.
    """

    name = "queue"
    layer = Layer.SCHEDULING

    max_queue: int = 64
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise RecipeError(f"pass 'queue', parameter 'max_queue': got {self.max_queue}, expected an integer >= 1.")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise RecipeError(f"pass 'queue', parameter 'timeout_s': got {self.timeout_s}, expected seconds > 0 or null (no deadline).")

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("scheduling", max_queue=self.max_queue, timeout_s=self.timeout_s)
