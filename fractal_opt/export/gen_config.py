"""``--to generation-config``: the plan's decoding defaults as a model folder's generation_config.json.

Any transformers-based server starts every request from that file (``transformers serve`` among
them), so this target holds decoding only: how the model is loaded and scheduled belongs to the
server that loads it. The keys (:data:`GEN_CONFIG`) are shared with ``--to transformers-serve``.
"""

from __future__ import annotations

import json
from typing import Any

from ..tower.plan import Plan
from .common import SHARED, Export, Where

__all__ = ["GEN_CONFIG", "RUNTIME", "TABLE", "build", "generation_config"]

RUNTIME = "transformers"  # the fractal_opt runtime that reads generation_config.json the same way

GEN_CONFIG: dict[str, tuple[str, str]] = {
    # generation_config.json: the decoding defaults a transformers model folder carries.
    "application.max_new_tokens": ("config", "max_new_tokens"),
    "application.stop": ("config", "stop_strings"),
    "application.do_sample": ("config", "do_sample"),
    "application.temperature": ("config", "temperature"),
    "application.top_p": ("config", "top_p"),
    "application.top_k": ("config", "top_k"),
    "application.min_p": ("config", "min_p"),
    "application.num_beams": ("config", "num_beams"),
    "application.repetition_penalty": ("config", "repetition_penalty"),
    "application.no_repeat_ngram_size": ("config", "no_repeat_ngram_size"),
    "application.prompt_lookup_tokens": ("config", "prompt_lookup_num_tokens"),
    "application.draft": ("lost", "a draft model is passed to generate() as assistant_model; no generation_config.json key names it"),
    "application.draft_tokens": ("config", "num_assistant_tokens"),
    "model.kv_cache": ("config", "cache_implementation (static / quantized / offloaded; off -> use_cache false)"),
    "model.kv_bits": ("config", "cache_config.nbits"),
    "model.kv_backend": ("config", "cache_config.backend"),
    "model.context_cap": ("config", "max_cache_len with a static cache; otherwise the cap is a client-side limit"),
    "model.trust_remote_code": ("lost", "a loading option (from_pretrained(trust_remote_code=True)), not a generation setting"),
}

_LOAD_LOST = {  # how the weights are loaded: no generation_config.json key (a launch flag at most)
    "hardware.device": "where the weights load", "hardware.device_map": "accelerate placement", "hardware.max_memory": "accelerate placement caps",
    "hardware.offload_folder": "disk offload", "hardware.dtype": "the weights' dtype", "hardware.threads": "torch's thread count",
    "hardware.attention": "the attention kernel", "hardware.matmul_precision": "torch's float32 matmul precision", "hardware.compile": "torch.compile",
    "hardware.prepack": "oneDNN weight prepacking", "hardware.flash_attention": "llama.cpp's flash attention",
    "hardware.n_batch": "llama.cpp's tokens per decode call", "hardware.n_ubatch": "llama.cpp's tokens per forward pass",
    "hardware.tensor_parallel": "vLLM's tensor parallelism", "hardware.pipeline_parallel": "vLLM's pipeline parallelism",
    "hardware.rpc_workers": "llama.cpp's split over rpc-servers", "hardware.rpc_endpoints": "llama.cpp's split over rpc-servers",
    "hardware.rpc_bind": "the rpc-servers' listen address",
    "model.weight_bits": "weight quantization", "model.quant_backend": "weight quantization", "model.quant_method": "weight quantization",
    "model.quant_group_size": "weight quantization", "model.quant_skip": "weight quantization", "model.quant_sensitivity_max_kl": "weight quantization",
}
_SCHED_LOST = ("batching", "max_concurrency", "streaming", "prefix_cache", "cb_max_batch_tokens", "cb_num_blocks", "cb_page_size", "cb_max_memory_percent", "cb_scheduler",
               "replicas", "replica_cores", "router")

TABLE: dict[str, tuple[str, str]] = {
    **SHARED,
    **{k: ("lost", f"{why}: how the model is loaded, not a decoding default (generation_config.json holds decoding only)") for k, why in _LOAD_LOST.items()},
    **{f"scheduling.{k}": ("lost", "scheduling belongs to the server that loads the model, not to generation_config.json") for k in _SCHED_LOST},
    **GEN_CONFIG,
}


def generation_config(plan: Plan) -> dict[str, Any]:
    """The generation_config.json keys for the plan's decoding defaults (transformers' names)."""
    a, m = plan.application, plan.model
    cfg: dict[str, Any] = {"do_sample": a.do_sample}
    if a.max_new_tokens is not None:
        cfg["max_new_tokens"] = a.max_new_tokens
    if a.do_sample:
        cfg.update(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k or 0)
        if a.min_p is not None:
            cfg["min_p"] = a.min_p
    if a.num_beams > 1:
        cfg.update(num_beams=a.num_beams, early_stopping=True)
    if a.repetition_penalty != 1.0:
        cfg["repetition_penalty"] = a.repetition_penalty
    if a.no_repeat_ngram_size:
        cfg["no_repeat_ngram_size"] = a.no_repeat_ngram_size
    if a.stop:
        cfg["stop_strings"] = list(a.stop)
    if a.prompt_lookup_tokens:
        cfg["prompt_lookup_num_tokens"] = a.prompt_lookup_tokens
    if a.draft:
        cfg["num_assistant_tokens"] = a.draft_tokens
    if m.kv_cache == "off":
        cfg["use_cache"] = False
    elif m.kv_cache in ("static", "quantized", "offloaded"):
        cfg["cache_implementation"] = m.kv_cache
        if m.kv_cache == "static" and m.context_cap is not None:
            cfg["max_cache_len"] = m.context_cap
        if m.kv_cache == "quantized":
            cfg["cache_config"] = {"backend": m.kv_backend or "quanto", "nbits": m.kv_bits or 4}
    return cfg


def build(plan: Plan, where: Where, out: Export) -> dict[str, str]:
    """generation_config.json alone; nothing is launched, so no field needs a reason of its own."""
    out.files["generation_config.json"] = json.dumps(generation_config(plan), indent=2, sort_keys=True) + "\n"
    return {}
