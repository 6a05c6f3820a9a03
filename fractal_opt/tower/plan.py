"""Plan: a frozen description of a deployment, one section per layer of the tower.

Every default means "what a newcomer gets with plain transformers": float32 weights, the default
(sdpa) attention, torch's default thread count, a dynamic KV cache, one request at a time and
greedy decoding up to the workload's token budget. Passes never mutate a plan; they return a new
one with :func:`dataclasses.replace`, so rolling a pass back means keeping the previous plan.

Example:
    >>> from fractal_opt.tower.plan import Plan
    >>> plan = Plan(source="smollm2-135m-instruct")
    >>> plan.hardware.dtype
    'float32'
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AFFECTS",
    "SECTIONS",
    "ApplicationPlan",
    "HardwarePlan",
    "ModelPlan",
    "Plan",
    "SchedulingPlan",
    "fields_affecting",
]

# What a change of a field affects, tagged on every field (``field(metadata=...)``) so that the
# engine cache key and the quality-probe key are derived, never hand-listed:
#   weights   the loaded model itself (a new value loads or converts the weights again);
#   numerics  the next-token distributions of the same weights (the model-level quality probes);
#   runtime   only how requests are served or how much work they ask for.
AFFECTS = ("weights", "numerics", "runtime")
WEIGHTS = {"affects": "weights"}
NUMERICS = {"affects": "numerics"}
RUNTIME = {"affects": "runtime"}


def _non_default(section: Any) -> dict[str, Any]:
    """The fields of a section dataclass that differ from their defaults."""
    out = {}
    for f in dataclasses.fields(section):
        default = f.default if f.default is not dataclasses.MISSING else (f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        value = getattr(section, f.name)
        if value != default:
            out[f.name] = value
    return out


def _section_repr(self: Any) -> str:
    """``HardwarePlan(dtype='bfloat16')``: only what differs from the defaults."""
    return f"{type(self).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in _non_default(self).items()) + ")"


@dataclass(frozen=True, kw_only=True)
class HardwarePlan:
    """Layer 1: where and how the math runs."""

    __repr__ = _section_repr

    runtime: str = field(default="transformers", metadata=WEIGHTS)  # the inference engine that serves the plan (fractal_opt.runtimes)
    device: str = field(default="cpu", metadata=WEIGHTS)  # cpu | cuda | cuda:N | mps; "auto" resolves when the engine builds
    device_map: str | None = field(default=None, metadata=WEIGHTS)  # accelerate placement over several devices: auto | balanced | balanced_low_0 | sequential
    max_memory: tuple[str, ...] = field(default=(), metadata=WEIGHTS)  # per-device caps for device_map, "device=size" ("0=20GiB", "cpu=64GiB")
    offload_folder: str | None = field(default=None, metadata=WEIGHTS)  # where device_map spills weights that fit nowhere (disk offload)
    dtype: str = field(default="float32", metadata=WEIGHTS)  # float32 | bfloat16 | float16
    threads: int | str | None = field(default=None, metadata=RUNTIME)  # torch intra-op threads; "auto" = physical cores; None = torch's default
    attention: str = field(default="sdpa", metadata=WEIGHTS)  # transformers' default kernel for Llama-family models
    matmul_precision: str = field(default="highest", metadata=NUMERICS)  # torch.set_float32_matmul_precision: highest | high | medium (TF32 on CUDA)
    compile: str | None = field(default=None, metadata=NUMERICS)  # torch.compile mode of the decode step: default | reduce-overhead | max-autotune
    prepack: tuple[str, ...] = field(default=(), metadata=WEIGHTS)  # Linear modules whose weights are repacked for oneDNN (CPU, float32): "lm_head"
    flash_attention: str = field(default="auto", metadata=NUMERICS)  # llama.cpp's flash-attention kernel: auto | on | off
    # llama.cpp's batch sizes (None = llama.cpp's own: 2048 / 512). A prompt is fed in llama_decode
    # calls of at most n_batch tokens, each run as forward passes of at most n_ubatch tokens, so
    # they set the matmul shapes of prefill: numerics, like any kernel choice.
    n_batch: int | None = field(default=None, metadata=NUMERICS)  # llama.cpp: tokens per decode call, all slots together (logical batch)
    n_ubatch: int | None = field(default=None, metadata=NUMERICS)  # llama.cpp: tokens per forward pass (physical batch), <= n_batch
    runtime_path: str | None = field(default=None, metadata=WEIGHTS)  # vllm: the `vllm` executable (None = $FRACTAL_OPT_VLLM, then .venv-vllm/bin/vllm); llama_cpp: a llama-server executable or "native" (None = xllamacpp in this process)
    runtime_url: str | None = field(default=None, metadata=WEIGHTS)  # vllm: base URL of a running OpenAI-compatible server (then nothing is started)
    tensor_parallel: int = field(default=1, metadata=WEIGHTS)  # vllm: GPUs each layer is split over (--tensor-parallel-size)
    pipeline_parallel: int = field(default=1, metadata=WEIGHTS)  # vllm: GPUs / nodes the layers are split over (--pipeline-parallel-size)
    # llama.cpp RPC (the split pass): the model's layers spread over rpc-server processes, each a
    # ggml backend of its own; llama-server keeps the rest and drives them (--rpc).
    rpc_workers: int = field(default=0, metadata=WEIGHTS)  # rpc-servers started on this machine, each on its own cores (0 = no split)
    rpc_endpoints: tuple[str, ...] = field(default=(), metadata=WEIGHTS)  # "host:port" of rpc-servers already running elsewhere (started by nobody here)
    rpc_bind: str = field(default="127.0.0.1", metadata=WEIGHTS)  # the address started rpc-servers listen on (loopback: the protocol has no authentication)


@dataclass(frozen=True, kw_only=True)
class ModelPlan:
    """Layer 2: what the model stores and moves."""

    __repr__ = _section_repr

    weight_bits: int | None = field(default=None, metadata=WEIGHTS)  # None = weights stay in the hardware dtype
    quant_backend: str | None = field(default=None, metadata=WEIGHTS)  # torchao | bitsandbytes | quanto (resolved from "auto" by the pass)
    quant_method: str | None = field(default=None, metadata=WEIGHTS)  # weight_only | dynamic (torchao) | int8 | nf4 | fp4 (bitsandbytes)
    quant_group_size: int | None = field(default=None, metadata=WEIGHTS)  # weights per scale (torchao 4-bit); None = the backend's own layout
    quant_skip: tuple[str, ...] = field(default=(), metadata=WEIGHTS)  # modules left unquantized: names, globs, first:N / last:N (see quant_select.py)
    quant_sensitivity_max_kl: float | None = field(default=None, metadata=WEIGHTS)  # keep the most KL-sensitive blocks unquantized until KL <= this
    kv_cache: str = field(default="dynamic", metadata=NUMERICS)  # dynamic | static | quantized | offloaded | off
    kv_bits: int | None = field(default=None, metadata=NUMERICS)  # quantized KV cache: 2 | 4 | 8 bits
    kv_backend: str | None = field(default=None, metadata=NUMERICS)  # quantized KV cache: quanto | hqq
    context_cap: int | None = field(default=None, metadata=RUNTIME)  # max prompt + generated tokens per request; sizes the static cache
    # Run the model folder's own Python code (config.json's auto_map) when transformers loads it:
    # only where the recipe's model: says trust_remote_code: true (language/model_spec.py).
    trust_remote_code: bool = field(default=False, metadata=WEIGHTS)


@dataclass(frozen=True, kw_only=True)
class SchedulingPlan:
    """Layer 3: how requests share the machine."""

    __repr__ = _section_repr

    batching: str = field(default="sequential", metadata=RUNTIME)  # sequential | static | continuous
    batch_size: int = field(default=1, metadata=RUNTIME)  # requests per padded batch (static batching)
    max_wait_ms: float = field(default=10.0, metadata=RUNTIME)  # static: how long a batch waits for more requests before it starts
    max_concurrency: int | None = field(default=None, metadata=RUNTIME)  # requests in flight at once; None = batch_size (static), 16 (continuous)
    streaming: bool = field(default=True, metadata=RUNTIME)  # callers get tokens as they are generated (False: all at the end)
    prefix_cache: bool = field(default=False, metadata=RUNTIME)  # llama.cpp / vllm: reuse the KV of a prompt prefix seen before (off: every TTFT includes a full prefill)
    max_queue: int = field(default=256, metadata=RUNTIME)  # requests waiting for a slot; a full queue rejects new ones (RequestRejected)
    timeout_s: float | None = field(default=None, metadata=RUNTIME)  # per-request deadline from submission; None = no deadline
    # Continuous batching (transformers' ContinuousBatchingConfig); None = sized by the server.
    cb_max_batch_tokens: int | None = field(default=None, metadata=RUNTIME)  # tokens per forward pass (prefill chunks + decodes)
    cb_num_blocks: int | None = field(default=None, metadata=RUNTIME)  # paged KV-cache blocks; None = enough for max_concurrency requests
    cb_page_size: int = field(default=256, metadata=RUNTIME)  # tokens per KV-cache page (transformers' default)
    cb_max_memory_percent: float | None = field(default=None, metadata=RUNTIME)  # share of free memory for the KV cache (when cb_num_blocks is None)
    cb_scheduler: str = field(default="fifo", metadata=RUNTIME)  # fifo | prefill_first
    # Replicas (the replicas pass): copies of the whole plan, each on its own cores, behind a router.
    replicas: int = field(default=1, metadata=RUNTIME)  # servers of the plan (1 = the plan's own server alone)
    replica_cores: int | None = field(default=None, metadata=RUNTIME)  # cores each replica is pinned to; None = 1 replica unpinned, else the cores / replicas
    router: str = field(default="auto", metadata=RUNTIME)  # in front of several replicas: auto (the runtime's own where it has one: vllm's data-parallel front end; else haproxy) | haproxy


@dataclass(frozen=True, kw_only=True)
class ApplicationPlan:
    """Layer 4: how much work a request asks for."""

    __repr__ = _section_repr

    max_new_tokens: int | None = field(default=None, metadata=RUNTIME)  # cap on generated tokens; None = the workload's budget
    stop: tuple[str, ...] = field(default=(), metadata=RUNTIME)  # stop sequences (generation ends once one appears in the output)
    do_sample: bool = field(default=False, metadata=RUNTIME)  # greedy unless a decoding pass turns sampling on
    temperature: float = field(default=1.0, metadata=RUNTIME)
    top_p: float = field(default=1.0, metadata=RUNTIME)
    top_k: int | None = field(default=None, metadata=RUNTIME)
    min_p: float | None = field(default=None, metadata=RUNTIME)  # drop tokens below min_p x the top token's probability (sampling)
    num_beams: int = field(default=1, metadata=RUNTIME)  # > 1 = beam search (no streaming: only end-to-end time is measured)
    repetition_penalty: float = field(default=1.0, metadata=RUNTIME)
    no_repeat_ngram_size: int = field(default=0, metadata=RUNTIME)  # 0 = off
    prompt_budget: int | None = field(default=None, metadata=RUNTIME)  # max prompt tokens (chat template included); None = no trimming
    prompt_strategy: str = field(default="recent_turns", metadata=RUNTIME)  # recent_turns | head_tail | drop_chunks (see prompting.py)
    head_share: float = field(default=0.5, metadata=RUNTIME)  # head_tail: share of the kept tokens taken from the head
    response_cache: str | None = field(default=None, metadata=RUNTIME)  # None | exact | semantic: whole responses reused
    cache_max_entries: int = field(default=1024, metadata=RUNTIME)
    cache_ttl_s: float | None = field(default=None, metadata=RUNTIME)  # None = entries never expire
    cache_threshold: float = field(default=0.9, metadata=RUNTIME)  # semantic: min cosine similarity of the last user message
    prompt_lookup_tokens: int | None = field(default=None, metadata=RUNTIME)  # speculative tokens drafted from prompt n-grams
    draft: str | None = field(default=None, metadata=RUNTIME)  # assisted decoding: draft model source (same tokenizer)
    draft_tokens: int = field(default=5, metadata=RUNTIME)  # tokens the draft proposes per step
    # How a request becomes the prompt (fractal_opt/weights/prompts.py): None = the model's own chat
    # template, or plain completion text for a model without one; "none" = plain text; else a Jinja
    # chat template of the recipe's. Every runtime receives the same token ids.
    chat_template: str | None = field(default=None, metadata=RUNTIME)
    # None of these change the main model's weights or its next-token distributions (runtime), so
    # they are in neither weights_key() nor numerics_key(); the engine caches the draft model itself.


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

    source: str = field(metadata=WEIGHTS)
    hardware: HardwarePlan = field(default_factory=HardwarePlan)
    model: ModelPlan = field(default_factory=ModelPlan)
    scheduling: SchedulingPlan = field(default_factory=SchedulingPlan)
    application: ApplicationPlan = field(default_factory=ApplicationPlan)
    applied: tuple[str, ...] = ()

    def __repr__(self) -> str:
        """A few lines: the source, then per section only the fields that differ from the defaults."""
        lines = [f"Plan(source={self.source!r}"]
        for name in SECTIONS:
            changed = _non_default(getattr(self, name))
            if changed:
                lines.append(f"  {name}: " + ", ".join(f"{k}={v!r}" for k, v in changed.items()))
        if self.applied:
            lines.append(f"  applied: {', '.join(self.applied)}")
        return lines[0] + ")" if len(lines) == 1 else "\n".join(lines) + ")"

    def replace_section(self, section: str, /, **changes: Any) -> Plan:
        """Return a copy with ``changes`` made to one section (``"hardware"``, ``"model"``, ...)."""
        new_section = dataclasses.replace(getattr(self, section), **changes)
        return dataclasses.replace(self, **{section: new_section})

    def with_applied(self, name: str) -> Plan:
        """Return a copy that records ``name`` as the latest applied pass."""
        return dataclasses.replace(self, applied=(*self.applied, name))

    def weights_key(self) -> tuple:
        """The values of the fields tagged ``weights``; plans sharing it share one loaded model."""
        return (self.source, *self._values("weights"))

    def numerics_key(self) -> tuple:
        """The weights key plus the fields tagged ``numerics``: what can change next-token
        distributions (the model-level quality probes)."""
        return (*self.weights_key(), *self._values("numerics"))

    def _values(self, affects: str) -> tuple:
        return tuple(getattr(getattr(self, section), name) for section, name in fields_affecting(affects))

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


@functools.cache
def fields_affecting(affects: str) -> tuple[tuple[str, str], ...]:
    """``(section, field)`` of every section field tagged ``affects`` (one of :data:`AFFECTS`), in order.

    Example:
        >>> ("hardware", "dtype") in fields_affecting("weights")
        True
    """
    if affects not in AFFECTS:
        raise ValueError(f"unknown tag {affects!r}; fields affect one of {list(AFFECTS)}")
    return tuple((name, f.name) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f.metadata.get("affects") == affects)
