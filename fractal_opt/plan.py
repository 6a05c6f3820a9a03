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

    runtime: str = "transformers"  # the inference engine that serves the plan (fractal_opt.runtimes)
    device: str = "cpu"  # cpu | cuda | cuda:N | mps; "auto" resolves when the engine builds
    device_map: str | None = None  # accelerate placement over several devices: auto | balanced | balanced_low_0 | sequential
    max_memory: tuple[str, ...] = ()  # per-device caps for device_map, "device=size" ("0=20GiB", "cpu=64GiB")
    offload_folder: str | None = None  # where device_map spills weights that fit nowhere (disk offload)
    dtype: str = "float32"  # float32 | bfloat16 | float16
    threads: int | str | None = None  # torch intra-op threads; "auto" = physical cores; None = torch's default
    attention: str = "sdpa"  # transformers' default kernel for Llama-family models
    matmul_precision: str = "highest"  # torch.set_float32_matmul_precision: highest | high | medium (TF32 on CUDA)
    compile: str | None = None  # torch.compile mode of the decode step: default | reduce-overhead | max-autotune
    prepack: tuple[str, ...] = ()  # Linear modules whose weights are repacked for oneDNN (CPU, float32): "lm_head"


@dataclass(frozen=True, kw_only=True)
class ModelPlan:
    """Layer 2: what the model stores and moves."""

    weight_bits: int | None = None  # None = weights stay in the hardware dtype
    quant_backend: str | None = None  # torchao | bitsandbytes | quanto (resolved from "auto" by the pass)
    quant_method: str | None = None  # weight_only | dynamic (torchao) | int8 | nf4 | fp4 (bitsandbytes)
    quant_group_size: int | None = None  # weights per scale (torchao 4-bit); None = the backend's own layout
    quant_skip: tuple[str, ...] = ()  # modules left unquantized: names, globs, first:N / last:N (see quant_select.py)
    quant_sensitivity_max_kl: float | None = None  # keep the most KL-sensitive blocks unquantized until KL <= this
    kv_cache: str = "dynamic"  # dynamic | static | quantized | offloaded | off
    kv_bits: int | None = None  # quantized KV cache: 2 | 4 | 8 bits
    kv_backend: str | None = None  # quantized KV cache: quanto | hqq
    context_cap: int | None = None  # max prompt + generated tokens per request; sizes the static cache


@dataclass(frozen=True, kw_only=True)
class SchedulingPlan:
    """Layer 3: how requests share the machine."""

    batching: str = "sequential"  # sequential | static | continuous
    batch_size: int = 1  # requests per padded batch (static batching)
    max_wait_ms: float = 10.0  # static: how long a batch waits for more requests before it starts
    max_concurrency: int | None = None  # requests in flight at once; None = batch_size (static), 16 (continuous)
    streaming: bool = True  # callers get tokens as they are generated (False: all at the end)
    max_queue: int = 256  # requests waiting for a slot; a full queue rejects new ones (RequestRejected)
    timeout_s: float | None = None  # per-request deadline from submission; None = no deadline
    # Continuous batching (transformers' ContinuousBatchingConfig); None = sized by the server.
    cb_max_batch_tokens: int | None = None  # tokens per forward pass (prefill chunks + decodes)
    cb_num_blocks: int | None = None  # paged KV-cache blocks; None = enough for max_concurrency requests
    cb_page_size: int = 256  # tokens per KV-cache page (transformers' default)
    cb_max_memory_percent: float | None = None  # share of free memory for the KV cache (only when cb_num_blocks is None and set)
    cb_scheduler: str = "fifo"  # fifo | prefill_first


@dataclass(frozen=True, kw_only=True)
class ApplicationPlan:
    """Layer 4: how much work a request asks for."""

    max_new_tokens: int | None = None  # cap on generated tokens; None = the workload's budget
    stop: tuple[str, ...] = ()  # stop sequences (generation ends once one appears in the output)
    do_sample: bool = False  # greedy unless a decoding pass turns sampling on
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None  # drop tokens below min_p x the top token's probability (sampling)
    num_beams: int = 1  # > 1 = beam search (no streaming: only end-to-end time is measured)
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0  # 0 = off
    prompt_budget: int | None = None  # max prompt tokens (chat template included); None = no trimming
    prompt_strategy: str = "recent_turns"  # recent_turns | head_tail | drop_chunks (see prompting.py)
    head_share: float = 0.5  # head_tail: share of the kept tokens taken from the head
    response_cache: str | None = None  # None | exact | semantic: whole responses reused
    cache_max_entries: int = 1024
    cache_ttl_s: float | None = None  # None = entries never expire
    cache_threshold: float = 0.9  # semantic: min cosine similarity of the last user message
    prompt_lookup_tokens: int | None = None  # speculative tokens drafted from prompt n-grams
    draft: str | None = None  # assisted decoding: draft model source (same tokenizer)
    draft_tokens: int = 5  # tokens the draft proposes per step
    # None of these change the main model's weights or its next-token distributions, so they are
    # in neither weights_key() nor numerics_key(); the draft model is cached by the engine itself.


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
        return (
            self.source, hw.runtime, hw.device, hw.device_map, hw.max_memory, hw.offload_folder, hw.dtype, hw.attention, hw.prepack,
            m.weight_bits, m.quant_backend, m.quant_method, m.quant_group_size, m.quant_skip, m.quant_sensitivity_max_kl,
        )

    def numerics_key(self) -> tuple:
        """The fields that can change next-token distributions (the model-level quality probes)."""
        m = self.model
        return (*self.weights_key(), self.hardware.matmul_precision, self.hardware.compile, m.kv_cache, m.kv_bits, m.kv_backend)

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
