"""Plan -> ``vllm serve`` engine args: every plan field maps, is refused with a reason, or is applied
per request / by the client.

Three pure functions, so the mapping is testable without vLLM:

- :func:`refusals` lists a reason per plan field vLLM cannot honour (the runner skips such a step);
- :func:`engine_args` builds the ``vllm serve`` command-line flags, :func:`server_env` its
  environment (threads, device selection);
- :func:`sampling` builds the per-request JSON fields of ``/v1/chat/completions``.

:data:`FIELDS` says, for every plan field, where it goes; ``tests/runtimes/test_vllm_engine_args.py`` fails
when a plan field is missing from it, so a new field cannot be silently ignored by this runtime.

Example:
    >>> from fractal_opt.tower.plan import Plan
    >>> plan = Plan(source="smollm2-135m-instruct").replace_section("model", context_cap=2048)
    >>> engine_args(plan)[:4]
    ['--dtype', 'float32', '--max-model-len', '2048']
"""

from __future__ import annotations

import json
from typing import Any

from ...engine.capabilities import Refusal
from ...engine.capabilities import refusals as table_refusals
from ...serving.sampling import Decoding

__all__ = ["FIELDS", "REFUSALS", "engine_args", "ranks", "refusals", "sampling", "server_env", "threads_bind"]

# Where each plan field goes. "arg": a `vllm serve` flag; "env": the server's environment;
# "request": a per-request JSON field; "client": the HTTP client / fractal_opt's Server (queue,
# deadlines, streaming delivery); "refuse": honoured only at its default value, refused otherwise;
# "select": chooses this runtime and which vLLM serves it.
FIELDS: dict[str, str] = {
    "hardware.runtime": "select",
    "hardware.runtime_path": "select",
    "hardware.runtime_url": "select",
    "hardware.tensor_parallel": "arg",
    "hardware.pipeline_parallel": "arg",
    "hardware.rpc_workers": "refuse",
    "hardware.rpc_endpoints": "refuse",
    "hardware.rpc_bind": "refuse",
    "hardware.flash_attention": "refuse",
    "hardware.n_batch": "refuse",
    "hardware.n_ubatch": "refuse",
    "hardware.device": "env",
    "hardware.device_map": "refuse",
    "hardware.max_memory": "refuse",
    "hardware.offload_folder": "refuse",
    "hardware.dtype": "arg",
    "hardware.threads": "env",
    "hardware.attention": "refuse",
    "hardware.matmul_precision": "refuse",
    "hardware.compile": "arg",
    "hardware.prepack": "refuse",
    "model.weight_bits": "arg",
    "model.quant_backend": "arg",
    "model.quant_method": "arg",
    "model.quant_group_size": "refuse",
    "model.quant_skip": "refuse",
    "model.quant_sensitivity_max_kl": "refuse",
    "model.kv_cache": "arg",
    "model.kv_bits": "arg",
    "model.kv_backend": "arg",
    "model.context_cap": "arg",
    "model.trust_remote_code": "arg",
    "scheduling.batching": "arg",
    "scheduling.batch_size": "refuse",
    "scheduling.max_wait_ms": "refuse",
    "scheduling.max_concurrency": "arg",
    "scheduling.streaming": "client",
    "scheduling.prefix_cache": "arg",
    "scheduling.max_queue": "client",
    "scheduling.timeout_s": "client",
    "scheduling.cb_max_batch_tokens": "arg",
    "scheduling.cb_num_blocks": "arg",
    "scheduling.cb_page_size": "arg",
    "scheduling.cb_max_memory_percent": "arg",
    "scheduling.cb_scheduler": "refuse",
    "scheduling.replicas": "arg",
    "scheduling.replica_cores": "refuse",
    "scheduling.router": "refuse",
    "application.max_new_tokens": "request",
    "application.stop": "request",
    "application.do_sample": "request",
    "application.temperature": "request",
    "application.top_p": "request",
    "application.top_k": "request",
    "application.min_p": "request",
    "application.num_beams": "refuse",
    "application.repetition_penalty": "request",
    "application.no_repeat_ngram_size": "refuse",
    "application.prompt_budget": "refuse",
    "application.prompt_strategy": "refuse",
    "application.head_share": "refuse",
    "application.response_cache": "refuse",
    "application.cache_max_entries": "refuse",
    "application.cache_ttl_s": "refuse",
    "application.cache_threshold": "refuse",
    "application.prompt_lookup_tokens": "arg",
    "application.draft": "arg",
    "application.draft_tokens": "arg",
    "application.chat_template": "client",  # fractal_opt renders the prompt and sends token ids (weights/prompts.py)
}

_DTYPES = ("float32", "bfloat16", "float16")
_CPU_MEMORY_SHARE = 0.4  # on the CPU build: share of node memory that must be free at start (see engine_args)
_DEFAULT_PAGE = 256  # plan's cb_page_size default (transformers'); left to vLLM (CPU 128, GPU 16)
_CONTINUOUS_DEFAULT_IN_FLIGHT = 16  # the Server's limit when the plan names none (serving/server.py)
_PROMPT_LOOKUP_NGRAM = 2  # transformers' max_matching_ngram_size default, so speculation matches the baseline's


def _on_cpu(plan: Any) -> bool:
    """GPU-only vLLM features are refused unless the plan names a GPU: with ``auto`` the vLLM
    build decides the platform, and this module cannot see which build it will be."""
    return str(plan.hardware.device) in ("cpu", "auto")


def refusals(plan: Any) -> list[str]:
    """One reason per plan field the vllm runtime cannot honour (the rows of :data:`REFUSALS`, in
    order); empty when it can serve the plan. Each reason names the field, its value, and what
    vLLM offers instead."""
    return table_refusals(REFUSALS, plan)


def _kv_quantized(plan: Any, backend_ok: bool | None = None) -> bool:
    m = plan.model
    return m.kv_cache == "quantized" and (backend_ok is None or (m.kv_backend in (None, "native")) == backend_ok)


def _speculation_field(plan: Any) -> str:
    return "prompt_lookup_tokens" if plan.application.prompt_lookup_tokens else "draft"


_MAX_MEMORY = ("vLLM caps memory with a share of each GPU (scheduling.cb_max_memory_percent -> --gpu-memory-utilization) or, on the CPU build, a "
               "KV-cache size in GiB ($VLLM_CPU_KVCACHE_SPACE, default 4), not per-device sizes.")

# The plan fields vLLM cannot honour, and why: one row each, in the order the reasons are listed.
REFUSALS: tuple[Refusal, ...] = (
    Refusal("hardware.device", lambda p: p.hardware.device == "mps" or str(p.hardware.device).startswith("xpu"),
            "the vllm runtime serves on cpu (vllm-cpu build) or cuda GPUs."),
    Refusal("hardware.device_map", lambda p: p.hardware.device_map is not None,
            "vLLM places weights itself; split over GPUs with tensor_parallel / pipeline_parallel instead."),
    Refusal("hardware.max_memory", lambda p: bool(p.hardware.max_memory), lambda p: f"hardware.max_memory={list(p.hardware.max_memory)!r}: {_MAX_MEMORY}"),
    Refusal("hardware.offload_folder", lambda p: p.hardware.offload_folder is not None, "vLLM has no disk offload of weights."),
    Refusal("hardware.dtype", lambda p: p.hardware.dtype not in _DTYPES, f"vLLM's --dtype takes {list(_DTYPES)}."),
    Refusal("hardware.attention", lambda p: p.hardware.attention != "sdpa", "a transformers attention kernel; vLLM chooses its own paged-attention backend."),
    Refusal("hardware.matmul_precision", lambda p: p.hardware.matmul_precision != "highest", "vLLM exposes no float32 matmul precision (TF32) setting."),
    Refusal("hardware.prepack", lambda p: bool(p.hardware.prepack), lambda p: (
        f"hardware.prepack={list(p.hardware.prepack)!r}: oneDNN prepacking is transformers-runtime only; vLLM's CPU build packs its own kernels.")),
    Refusal("model.weight_bits", lambda p: p.model.weight_bits is not None and _quant_refusal(p) is not None, lambda p: str(_quant_refusal(p))),
    Refusal("model.quant_group_size", lambda p: p.model.quant_group_size is not None, lambda p: (
        f"model.quant_group_size={p.model.quant_group_size}: vLLM's on-load quantization (fp8, bitsandbytes) has a fixed layout.")),
    Refusal("model.quant_skip", lambda p: bool(p.model.quant_skip), lambda p: (
        f"model.quant_skip={list(p.model.quant_skip)!r}: vLLM's on-load quantization quantizes every Linear layer; it takes no skip list.")),
    Refusal("model.quant_sensitivity_max_kl", lambda p: p.model.quant_sensitivity_max_kl is not None, lambda p: (
        f"model.quant_sensitivity_max_kl={p.model.quant_sensitivity_max_kl}: needs per-module skips, which vLLM's on-load quantization does not take.")),
    Refusal("hardware.flash_attention", lambda p: p.hardware.flash_attention != "auto",
            "llama.cpp's flash-attention switch; vLLM chooses its own attention backend (flash attention on GPUs that have it)."),
    Refusal("hardware.n_batch", lambda p: p.hardware.n_batch is not None, lambda p: (
        f"hardware.n_batch={p.hardware.n_batch}: llama.cpp's tokens per decode call; vLLM's tokens per step is scheduling.cb_max_batch_tokens "
        "(batching pass, max_batch_tokens -> --max-num-batched-tokens).")),
    Refusal("hardware.n_ubatch", lambda p: p.hardware.n_ubatch is not None, lambda p: (
        f"hardware.n_ubatch={p.hardware.n_ubatch}: llama.cpp's tokens per forward pass; vLLM has no physical batch size apart from its tokens "
        "per step (scheduling.cb_max_batch_tokens).")),
    Refusal("model.kv_cache", lambda p: p.model.kv_cache in ("offloaded", "off"), "vLLM always keeps a paged KV cache in device memory."),
    Refusal("model.kv_backend", lambda p: _kv_quantized(p, backend_ok=False),
            "quanto / hqq quantize transformers' cache; vLLM quantizes its own (kv_cache pass: backend: native, bits: 8 -> fp8)."),
    Refusal("model.kv_bits", lambda p: _kv_quantized(p, backend_ok=True) and p.model.kv_bits != 8, lambda p: (
        f"model.kv_bits={p.model.kv_bits}: vLLM stores the KV cache in 8-bit fp8 only (kv_cache_dtype fp8); 2 and 4 bits are not offered.")),
    Refusal("model.kv_bits", lambda p: _kv_quantized(p, backend_ok=True) and p.model.kv_bits == 8 and _on_cpu(p),
            lambda p: "model.kv_bits=8: the fp8 KV cache is a GPU feature; vllm-cpu keeps the cache in the model dtype."),
    Refusal("scheduling.batching", lambda p: p.scheduling.batching == "static", lambda p: (
        f"scheduling.batching='static' (batch_size={p.scheduling.batch_size}): vLLM schedules continuously; padded static batches do not exist there.")),
    Refusal("scheduling.cb_scheduler", lambda p: p.scheduling.cb_scheduler != "fifo",
            "vLLM schedules first-come-first-served (or by priority), not prefill-first."),
    Refusal("application.num_beams", lambda p: p.application.num_beams > 1,
            lambda p: f"application.num_beams={p.application.num_beams}: vLLM's OpenAI server streams no beam search."),
    Refusal("application.no_repeat_ngram_size", lambda p: bool(p.application.no_repeat_ngram_size), lambda p: (
        f"application.no_repeat_ngram_size={p.application.no_repeat_ngram_size}: vLLM's sampler has no n-gram ban (it offers "
        "repetition/presence/frequency penalties).")),
    Refusal("application.prompt_budget", lambda p: p.application.prompt_budget is not None, lambda p: (
        f"application.prompt_budget={p.application.prompt_budget}: prompt trimming is not wired into the vllm runtime yet (it needs the tokenizer "
        "on the client side).")),
    Refusal("application.response_cache", lambda p: p.application.response_cache is not None, "the response cache is not wired into the vllm runtime yet."),
    Refusal("application.prompt_lookup_tokens", lambda p: bool(p.application.prompt_lookup_tokens and p.application.draft), lambda p: (
        f"application.prompt_lookup_tokens={p.application.prompt_lookup_tokens} with application.draft={p.application.draft!r}: vLLM runs one "
        "speculative method at a time.")),
    Refusal("application.draft", lambda p: bool(p.application.prompt_lookup_tokens or p.application.draft) and _on_cpu(p), lambda p: (
        f"application.{_speculation_field(p)}={getattr(p.application, _speculation_field(p))!r}: speculative decoding is not supported by vLLM's CPU build.")),
    *(Refusal(f"hardware.{name}", lambda p, n=name: bool(getattr(p.hardware, n)) and getattr(p.hardware, n) != "127.0.0.1",
              "llama.cpp's split over rpc-servers; vLLM splits a model with tensor / pipeline parallel (split: {tensor: N})")
      for name in ("rpc_workers", "rpc_endpoints", "rpc_bind")),
    Refusal("scheduling.replica_cores", lambda p: p.scheduling.replica_cores is not None,
            "vLLM binds each data-parallel rank's threads itself (its CPU build: VLLM_CPU_OMP_THREADS_BIND, set from the machine's cores)"),
    Refusal("scheduling.router", lambda p: p.scheduling.router not in ("auto",),
            lambda p: f"scheduling.router={p.scheduling.router!r}: vLLM's replicas are its data-parallel ranks behind its own front end (router: auto)"),
)


def _quant_refusal(plan: Any) -> str | None:
    m = plan.model
    where = f"model.weight_bits={m.weight_bits} (quant_backend={m.quant_backend!r}, quant_method={m.quant_method!r})"
    if _on_cpu(plan):
        return f"{where}: vllm-cpu quantizes nothing on load; serve a pre-quantized checkpoint (AWQ / GPTQ folder) as the model source instead."
    if _quantization(plan) is None:
        return f"{where}: vLLM quantizes on load to fp8 (weight_bits 8, backend torchao / auto) or bitsandbytes 4-bit (weight_bits 4, backend bitsandbytes, method nf4); nothing else."
    return None


def _quantization(plan: Any) -> str | None:
    """vLLM's ``--quantization`` for the plan's weight bits, or None when there is no equivalent."""
    m = plan.model
    if m.weight_bits == 8 and m.quant_backend in (None, "auto", "torchao"):
        return "fp8"  # dynamic per-tensor fp8 weights: vLLM's 8-bit on-load quantization
    if m.weight_bits == 4 and m.quant_backend == "bitsandbytes" and m.quant_method in (None, "nf4"):
        return "bitsandbytes"
    return None


def _placement_args(plan: Any) -> list[str]:
    """The flags that spread ``plan`` over ranks: tensor, pipeline and data parallel degrees."""
    hw, args = plan.hardware, []
    if hw.tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(hw.tensor_parallel)]
    if hw.pipeline_parallel > 1:
        args += ["--pipeline-parallel-size", str(hw.pipeline_parallel)]
    if plan.scheduling.replicas > 1:
        args += ["--data-parallel-size", str(plan.scheduling.replicas)]  # vLLM's own data-parallel ranks behind its own front end
    if _on_cpu(plan) and ranks(plan) > 1:
        # The CPU build runs each rank as a process of its own (its multiprocessing executor; Ray is for GPU nodes).
        args += ["--distributed-executor-backend", "mp"]
    return args


def engine_args(plan: Any, *, draft_model: str | None = None) -> list[str]:
    """The ``vllm serve MODEL`` flags for ``plan`` (call :func:`refusals` first: refused fields are
    not represented here).

    Args:
        plan: the Plan to serve.
        draft_model: the draft model's local folder (``plan.application.draft`` materialized).
    """
    hw, m, s = plan.hardware, plan.model, plan.scheduling
    args = ["--dtype", hw.dtype]
    if m.context_cap is not None:
        args += ["--max-model-len", str(m.context_cap)]
    if m.trust_remote_code:
        args.append("--trust-remote-code")
    if hw.compile is None:
        # The plan's default is no compilation; vLLM's default compiles and captures graphs (a
        # minute or more of start-up), so eager keeps the baseline comparable and start-up short.
        args.append("--enforce-eager")
    quant = _quantization(plan) if m.weight_bits is not None else None
    if quant:
        args += ["--quantization", quant]
    if m.kv_cache == "quantized" and m.kv_bits == 8:
        args += ["--kv-cache-dtype", "fp8"]
    if s.batching == "sequential":
        args += ["--max-num-seqs", "1"]
    else:
        args += ["--max-num-seqs", str(s.max_concurrency or _CONTINUOUS_DEFAULT_IN_FLIGHT)]
    if s.cb_max_batch_tokens is not None:
        args += ["--max-num-batched-tokens", str(s.cb_max_batch_tokens)]
        # A budget below the context cap only works with prefill split into chunks.
        args.append("--enable-chunked-prefill")
    if s.cb_num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(s.cb_num_blocks)]
    if s.cb_page_size != _DEFAULT_PAGE:
        args += ["--block-size", str(s.cb_page_size)]
    if s.cb_max_memory_percent is not None:
        # vLLM's share of each GPU for weights + activations + KV cache; on the CPU build (despite
        # its name) the share of the NUMA node's memory it requires free at start.
        args += ["--gpu-memory-utilization", str(s.cb_max_memory_percent)]
    elif _on_cpu(plan):
        # vllm-cpu 0.32 refuses to start unless 92% of NUMA node 0's memory is free ("Available
        # memory on node 0 (11.4/13.84 GiB) on startup is less than desired CPU memory utilization
        # (0.92, 12.73 GiB)", seen here with a 2 GB process beside it); the KV cache itself is
        # $VLLM_CPU_KVCACHE_SPACE GiB, so a smaller share leaves room for the caller.
        args += ["--gpu-memory-utilization", str(_CPU_MEMORY_SHARE)]
    # vLLM caches prefixes by default. The measurement suite repeats identical prompts, so a cached
    # prefix would make TTFT a cache hit instead of a prefill: it is on only when the plan says so,
    # and stated either way so the trace shows which.
    args.append("--enable-prefix-caching" if s.prefix_cache else "--no-enable-prefix-caching")
    args += _placement_args(plan)
    spec = _speculative(plan, draft_model)
    if spec:
        args += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    return args


def ranks(plan: Any) -> int:
    """vLLM worker processes the plan runs: tensor x pipeline x data-parallel degrees."""
    return plan.hardware.tensor_parallel * plan.hardware.pipeline_parallel * plan.scheduling.replicas


def threads_bind(plan: Any, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for the CPU build: one block of ``cpus`` per rank, ``|`` between ranks ("0|1": rank 0 on CPU 0, rank 1 on CPU 1)."""
    n = ranks(plan)
    each = max(1, len(cpus) // n)
    return "|".join(",".join(str(c) for c in cpus[i * each:(i + 1) * each]) for i in range(n))


def _speculative(plan: Any, draft_model: str | None) -> dict[str, Any] | None:
    a = plan.application
    if a.prompt_lookup_tokens:
        return {"method": "ngram", "num_speculative_tokens": a.prompt_lookup_tokens, "prompt_lookup_max": _PROMPT_LOOKUP_NGRAM, "prompt_lookup_min": 1}
    if a.draft:
        return {"method": "draft_model", "model": draft_model or a.draft, "num_speculative_tokens": a.draft_tokens}
    return None


def server_env(plan: Any, *, physical_cores: int | None = None) -> dict[str, str]:
    """Environment variables the server process needs for ``plan`` (merged over the caller's).

    vLLM's CPU worker cuts torch to one thread unless OMP_NUM_THREADS is set, so the plan's
    thread count goes there (``"auto"``: ``physical_cores``, the probed machine's); ``cuda:N``
    pins the server to GPU N.
    """
    env: dict[str, str] = {}
    threads = plan.hardware.threads
    if isinstance(threads, int):
        env["OMP_NUM_THREADS"] = str(threads)
    elif threads == "auto" and physical_cores:
        env["OMP_NUM_THREADS"] = str(physical_cores)
    if str(plan.hardware.device).startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = str(plan.hardware.device).split(":", 1)[1]
    if plan.hardware.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    if _on_cpu(plan) and ranks(plan) > 1:
        import os

        cpus = sorted(os.sched_getaffinity(0))[: physical_cores or None]
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind(plan, cpus)  # each rank on its own cores (vLLM's CPU installation docs)
        env.pop("OMP_NUM_THREADS", None)  # the bind sets each rank's count
    # The CPU build's KV-cache size ($VLLM_CPU_KVCACHE_SPACE, GiB) is no plan field: the server
    # inherits it from the caller's environment.
    return env


def sampling(plan: Any, max_new_tokens: int, *, ignore_eos: bool = False, seed: int = 0) -> dict[str, Any]:
    """The per-request JSON fields of ``/v1/chat/completions`` for the plan's decoding settings."""
    a = plan.application
    body: dict[str, Any] = {"max_tokens": max_new_tokens, "seed": seed}
    if a.do_sample:
        body.update(temperature=a.temperature, top_p=a.top_p)
        if a.top_k is not None:
            body["top_k"] = a.top_k
        if a.min_p is not None:
            body["min_p"] = a.min_p
    else:
        body["temperature"] = 0.0  # greedy in vLLM
    if a.repetition_penalty != 1.0:
        body["repetition_penalty"] = a.repetition_penalty  # vLLM's is the transformers (CTRL) penalty
    if a.stop:
        body["stop"] = list(a.stop)
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def sampling_fields(decoding: Decoding, seed: int) -> dict[str, Any]:
    """vLLM's per-request sampling fields for one request's own decoding (``Server.decoding(ticket)``),
    sent over the plan's (:func:`.engine_args.sampling`): vLLM samples per request anyway."""
    if not decoding.do_sample:
        return {"temperature": 0.0, "top_p": 1.0}  # greedy in vLLM
    out: dict[str, Any] = {"temperature": decoding.temperature, "top_p": decoding.top_p, "seed": seed if decoding.seed is None else decoding.seed}
    if decoding.top_k is not None:
        out["top_k"] = decoding.top_k
    if decoding.min_p is not None:
        out["min_p"] = decoding.min_p
    return out
