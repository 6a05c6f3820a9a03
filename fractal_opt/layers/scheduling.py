"""Layer 3, scheduling: how requests share the machine.

- ``batching``: one at a time (sequential), left-padded static batches, or transformers'
  continuous batching (requests join and leave the running batch at every step).
- ``concurrency``: the most requests in flight; ``mode: ramp`` searches for the highest level that
  meets every guard: it doubles the level until a guard trips, then bisects.
- ``streaming``: callers get tokens as they are generated, or all at the end.
- ``queue``: a bounded queue and a per-request timeout.
- ``prefix_cache``: the server reuses the KV cache of a prompt prefix it has seen (llama.cpp, vLLM, transformers' continuous batching).

These passes change how requests are served, so the pipeline judges them under load (the
workload's ``load`` profile): aggregate output tokens/s is the objective, TTFT / ITL percentiles
are guards a recipe sets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..core.errors import RecipeError
from ..core.machine import Machine
from ..tower.passes import Layer, Pass, SearchContext, StepResult, register
from ..tower.plan import Plan

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
        # A runtime's own quantized cache (backend native: llama.cpp's q8_0 / q4_0, vLLM's fp8) is
        # the cache its batching runs on; the other kinds are transformers' caches, which batch only dynamic.
        own_cache = plan.model.kv_cache == "quantized" and plan.model.kv_backend == "native"
        if self.mode in ("static", "continuous") and plan.model.kv_cache != "dynamic" and not own_cache:
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
    """Limit the requests in flight; ``mode: ramp`` searches for the highest limit that meets every guard.

    The search runs as pipeline steps, one level each, every level judged against the last level
    that held (start small, never jump to hundreds and fall over): from ``start`` it doubles the
    level until one fails or ``max_limit`` is reached, then bisects between the last level that
    held and the first that failed until they are ``resolution`` apart. A level holds, and is
    kept, when no guard trips (a TTFT / ITL SLO of the recipe, memory headroom, failed requests)
    and throughput is not worse beyond noise ("no change" holds: the search wants the highest
    level that holds); it fails when a guard trips or throughput gets worse, on two measurements
    that agree: a level whose first measurement trips is measured once more, and only a second
    trip counts (when the second holds, it stands: one noisy round cannot end the search early).
    A step that fails to run, or is refused (a KV cache that does not fit), fails its level at
    once. The answer, "max concurrency that meets TTFT p90 <= 4 s: 12", is in the trace
    (``searches``) and the last step's reason: set latency SLOs, or the search climbs while
    throughput merely holds. Under a closed-loop load the offered concurrency follows the level.
    ``levels: [8, ..., 64]`` (older recipes) is read as ``start: 8, max_limit: 64``.
    """

    name = "concurrency"
    layer = Layer.SCHEDULING

    mode: Literal["fixed", "ramp"] = "fixed"
    limit: int = 8
    start: int = 1
    max_limit: int = 128
    resolution: int = 1
    levels: tuple[int, ...] = ()

    @classmethod
    def shown_params(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """As any pass's, with a fixed limit always shown: ``concurrency(mode=fixed, limit=8)``."""
        shown = super().shown_params(params)
        if params.get("mode", "fixed") == "fixed" and "limit" in params:
            shown["limit"] = params["limit"]
        return shown

    def __post_init__(self) -> None:
        where = "pass 'concurrency', parameter"
        if self.levels:
            if any(b <= a for a, b in zip(self.levels, self.levels[1:])) or self.levels[0] < 1:
                raise RecipeError(f"{where} 'levels': got {list(self.levels)}, expected rising integers >= 1 like [8, 16, 32] (or use start / max_limit).")
            if (self.start, self.max_limit) != (1, 128):
                raise RecipeError(f"{where} 'levels': give either levels (read as the search's first and last level) or start / max_limit, not both.")
            # An older recipe's fixed levels: the search covers the same range.
            object.__setattr__(self, "start", self.levels[0])
            object.__setattr__(self, "max_limit", max(self.levels[-1], self.levels[0]))
            object.__setattr__(self, "levels", ())
        for field_name in ("limit", "start", "resolution"):
            if getattr(self, field_name) < 1:
                raise RecipeError(f"{where} '{field_name}': got {getattr(self, field_name)}, expected an integer >= 1.")
        if self.max_limit < self.start:
            raise RecipeError(f"{where} 'max_limit': got {self.max_limit}, expected an integer >= start ({self.start}).")

    def params(self) -> dict:
        """Only the fields the mode reads: a search's range, or a fixed limit (reports, written recipes)."""
        if self.mode == "ramp":
            return {"mode": "ramp", "start": self.start, "max_limit": self.max_limit, "resolution": self.resolution}
        return {"mode": "fixed", "limit": self.limit}

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.scheduling.batching == "sequential":
            return "sequential serving runs one request at a time; apply batching (static or continuous) first"
        return None

    def apply(self, plan: Plan) -> Plan:
        limit = self.limit if self.mode == "fixed" else self.start
        changes: dict = {"max_concurrency": limit}
        if plan.scheduling.batching == "static":
            changes["batch_size"] = limit  # a static batch is its requests in flight
        return plan.replace_section("scheduling", **changes)

    # ------------------------------------------------------------------ the search
    def next_step(self, history: Sequence[StepResult], *, context: SearchContext | None = None) -> Pass | None:
        """A fixed pass at the next level to measure, from the levels measured so far (None: done).

        Doubling from ``start`` while levels hold, then bisection between the highest level that
        held and the lowest that failed; a level that tripped once is measured again first. The
        search starts no lower than the requests the kept plan already serves at once under the
        load (``context``): a level below them only offers less work, so it measures worse than the
        kept plan without any SLO failing, and that "worse" would end the search before it reached
        the levels above (from 4 under 8 clients served at once, 16 was never tried).
        """
        if self.mode == "fixed":
            return None if history else self
        start = self.start
        if context is not None and (floor := _kept_in_flight(context)) is not None:
            start = min(max(start, floor), self.max_limit)
        level = _next_level(_verdicts(history), start=start, max_limit=self.max_limit, resolution=self.resolution)
        return None if level is None else Concurrency(mode="fixed", limit=level)

    def holds(self, outcome: str) -> str | None:
        """A level that trips nothing and costs no throughput ("no change") holds and is kept, so
        the plan's limit is the highest level measured to hold, not a larger default."""
        if outcome == "no_change":
            return "no guard tripped (the concurrency search keeps the highest level that holds)"
        return None

    def conclusion(self, history: Sequence[StepResult], *, guards: Sequence[Any] = (), context: SearchContext | None = None) -> dict[str, Any] | None:
        """The search's answer: the highest level that held, the limits it was found under, and
        every level with its measurements ("max concurrency that meets TTFT p90 <= 4 s: 12")."""
        if self.mode == "fixed":
            return None
        verdicts = _verdicts(history)
        held = [level for level, v in verdicts.items() if v == "held"]
        failed = sorted(level for level, v in verdicts.items() if v == "failed")
        best = max(held, default=None)
        slos = [text for g in guards if (text := _slo_text(g))]
        question = "max concurrency that meets " + " and ".join(slos) if slos else "max concurrency that holds (no absolute latency SLO set: the guards in force, throughput not worse)"
        measurements = sum(r.status in ("kept", "rolled_back") for r in history)
        if best is None and not measurements:
            value = "not found: no level could be measured (the skipped or failed steps say why)"
        elif best is None:
            value = f"none: {failed[0] if failed else self.start} already fails"
        elif best >= self.max_limit and not failed:
            value = f"{best} or more (the search's max_limit; no level up to it failed)"
        else:
            value = str(best)
        order = list(dict.fromkeys(r.step.limit for r in history))  # levels in the order first tried
        per_level = {level: [r.status for r in history if r.step.limit == level] for level in order}
        measured = sum(any(s in ("kept", "rolled_back") for s in statuses) for statuses in per_level.values())
        trail = ", ".join(f"{level} {verdicts[level]}" + _measurements_text(per_level[level]) for level in order)
        return {
            "pass": self.name,
            "question": question,
            "value": best,
            "answer": f"{question}: {value}",
            "levels_measured": measured,
            "measurements": measurements,
            "levels": [{"limit": level, "verdict": verdicts[level], "statuses": per_level[level]} for level in order],
            "summary": f"{measured} levels measured in {measurements} measurements: {trail}",
        }


def _kept_in_flight(context: SearchContext) -> int | None:
    """The requests ``context``'s kept plan serves at once under the workload's closed load (None
    without a closed load: the offered load then does not follow the level)."""
    workload = context.workload
    profile = workload.load_profile() if getattr(workload, "load", None) else None
    if profile is None or profile.mode != "closed" or profile.capacity:
        return None
    s = context.plan.scheduling
    limit = {"sequential": 1, "static": s.batch_size}.get(s.batching, s.max_concurrency or profile.concurrency)
    return min(limit, s.max_concurrency or limit, profile.concurrency)


def _verdicts(history: Sequence[StepResult]) -> dict[int, str]:
    """Each level's verdict so far: held (kept, or the plan already had it), failed (two trips, a
    failure or a refusal) or pending (one trip: it is measured again)."""
    out: dict[int, str] = {}
    for r in history:
        level = r.step.limit  # type: ignore[attr-defined]
        if out.get(level) in ("held", "failed"):
            continue
        if r.status in ("kept", "unchanged"):
            out[level] = "held"
        elif r.status == "rolled_back":
            out[level] = "failed" if out.get(level) == "pending" else "pending"
        else:  # failed or skipped: a crash or a refusal is not noise, measuring it again would not help
            out[level] = "failed"
    return out


def _measurements_text(statuses: list[str]) -> str:
    """`` (tripped twice)``, `` (tripped, then held)``; nothing for a level measured once."""
    if len(statuses) < 2:
        return ""
    words = [{"kept": "held", "rolled_back": "tripped", "failed": "failed to run", "skipped": "refused"}.get(s, s) for s in statuses]
    return " (tripped twice)" if words == ["tripped", "tripped"] else f" ({', then '.join(words)})"


def _next_level(verdicts: dict[int, str], *, start: int, max_limit: int, resolution: int) -> int | None:
    """The level the search measures next, or None when it is done."""
    for level, verdict in verdicts.items():
        if verdict == "pending":
            return level  # a single trip is measured once more before it counts
    held = [level for level, v in verdicts.items() if v == "held"]
    failed = [level for level, v in verdicts.items() if v == "failed"]
    low = max(held, default=0)
    high = min((level for level in failed if level > low), default=None)
    if not verdicts:
        return start
    if high is None:  # still doubling
        if low >= max_limit:
            return None
        return min(2 * low, max_limit)
    if high - low <= resolution:
        return None
    return (low + high) // 2  # strictly between: high - low >= 2 (nothing held yet: low = 0)


def _slo_text(guard: Any) -> str | None:
    """``TTFT p90 <= 4 s`` for an absolute limit on a latency, throughput or memory metric (a
    quality guard such as ``kl_mean`` is not a service level, and relative limits are not either)."""
    metric = getattr(guard, "metric", "")
    if not any(unit in metric for unit in ("_ms", "tokens_per_s", "_mb")):
        return None
    parts = []
    if getattr(guard, "max", None) is not None:
        parts.append(f"{_metric_label(metric)} <= {_amount(metric, guard.max)}")
    if getattr(guard, "min", None) is not None:
        parts.append(f"{_metric_label(metric)} >= {_amount(metric, guard.min)}")
    return " and ".join(parts) or None


def _metric_label(metric: str) -> str:
    """``ttft_ms_p90`` -> ``TTFT p90``, ``throughput_tokens_per_s`` -> ``throughput``."""
    words = metric.split("_")
    percentile = words[-1] if words[-1].startswith("p") and words[-1][1:].isdigit() else ""
    head = words[0].upper() if words[0] in ("ttft", "itl", "tpot") else words[0]
    return f"{head} {percentile}".strip()


def _amount(metric: str, value: float) -> str:
    """A guard's limit in the metric's unit: ms from 1000 up in seconds (``4 s``), tokens/s, MB."""
    if "_ms" in metric:
        return f"{value / 1000:g} s" if value >= 1000 else f"{value:g} ms"
    if metric.endswith("tokens_per_s"):
        return f"{value:g} tokens/s"
    if metric.endswith("_mb"):
        return f"{value:g} MB"
    return f"{value:g}"


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
    """Let the server reuse the KV cache of a prompt prefix it has already computed (llama.cpp, vLLM,
    transformers' continuous batching).

    Chat turns and RAG prompts share long prefixes (a system prompt, the earlier turns), so a
    server that keeps their keys/values skips most of the prefill: it attacks TTFT. Off by default,
    because the measured suite repeats its prompts and a cached prefix then makes TTFT a cache hit:
    keep it for workloads whose real traffic shares prefixes. On transformers it is the paged
    cache's block sharing (whole pages of ``cb_page_size`` tokens), so it needs continuous batching.
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
