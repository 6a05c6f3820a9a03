"""The plan -> llama.cpp mapping: which plan fields become ``CommonParams`` (load time; the same
settings become ``llama-server`` flags in :func:`.process.command`) or request fields (per
request), and which ones llama.cpp cannot honour (:func:`refusals`).

Pure functions of the plan (no model, no xllamacpp import except in :func:`common_params`), so
``LlamaCppEngine.refuse(plan)`` costs nothing and recipe checks can call it before any load.

Load-time settings (:func:`server_settings`) decide whether a loaded ``xllamacpp.Server`` can be
reused; request settings (:func:`request_body`) travel with every request, so a decoding pass never
reloads the model.
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, fields
from typing import Any

from ...engine.capabilities import Refusal
from ...engine.capabilities import refusals as table_refusals
from ...tower.batch_sizes import N_BATCH_DEFAULT, N_UBATCH_DEFAULT, batch_problems
from ...tower.plan import Plan
from ...weights.ladder import GGUF_METHODS
from .model_file import DTYPE_TYPES
from .placement_rules import PLACEMENT_REFUSALS
from .process import executable_problem, resolve_executable

__all__ = ["KV_CACHE_TYPES", "N_BATCH_DEFAULT", "N_UBATCH_DEFAULT", "REFUSALS", "ServerSettings", "batch_problems", "common_params", "describe", "llama_seed",
           "refusals", "replica_cores", "request_body", "server_settings"]

# plan.model.kv_bits -> llama.cpp cache type (ggml block formats: 32 values per block with one f16
# scale; q8_0 = 34 bytes per block, q4_0 = 18). llama.cpp has no 2-bit KV cache type.
KV_CACHE_TYPES: dict[int | None, str] = {None: "f16", 8: "q8_0", 4: "q4_0"}
FLASH_ATTENTION = {"auto": "LLAMA_FLASH_ATTN_TYPE_AUTO", "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED", "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED"}
KV_BYTES_PER_VALUE: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}

# KV-cache size when the plan sets no context_cap. llama.cpp allocates the whole cache when it
# loads (like a static cache), so "the model's 8192-token training context" per slot would reserve
# 8192 x 23 KB = 190 MB per slot for SmolLM2-135M (3 GB for 16 slots). Without a cap the slots share
# one pool (llama.cpp's unified KV cache): 4096 tokens, or 1024 per slot when there are more than
# four; 4096 holds the default suite's longest prompt (~600 tokens) plus any budget it asks for.
DEFAULT_KV_TOKENS = 4096
KV_TOKENS_PER_SLOT = 1024
# (quant_method, weight_bits) pairs the gguf backend writes (fractal_opt/weights/ladder.py).
GGUF_METHOD_BITS = tuple(GGUF_METHODS.items())



@dataclass(frozen=True)
class ServerSettings:
    """Everything fixed when an ``xllamacpp.Server`` loads; equal settings share one loaded server."""

    model_path: str
    threads: int | None  # decode threads, and prefill's batch threads; None = llama.cpp's default (its own count of the physical cores)
    slots: int  # n_parallel: requests decoded together by llama.cpp's continuous batching
    kv_tokens: int  # n_ctx: tokens the whole KV cache holds (all slots together)
    unified: bool  # True: slots share the kv_tokens pool; False: each slot owns kv_tokens / slots
    cache_type: str  # K and V cache type (f16 | q8_0 | q4_0)
    flash_attention: str = "auto"  # auto | on | off (llama.cpp's flash_attn_type)
    prefix_cache: bool = False  # reuse a prompt prefix's KV across requests (llama.cpp's prompt cache)
    n_batch: int | None = None  # tokens per llama_decode call; None = llama.cpp's default (N_BATCH_DEFAULT)
    n_ubatch: int | None = None  # tokens per forward pass; None = llama.cpp's default (N_UBATCH_DEFAULT)
    executable: str | None = None  # a llama-server to run as a child process (.process); None = xllamacpp in this process
    # Placement (.placed): rpc-servers started here and already running elsewhere, the address the
    # started ones listen on; copies of the server behind a router, and the cores each is pinned to.
    rpc_workers: int = 0
    rpc_endpoints: tuple[str, ...] = ()
    rpc_bind: str = "127.0.0.1"
    replicas: int = 1
    replica_cores: int | None = None

    @property
    def context_per_request(self) -> int:
        """Tokens of prompt + answer one request may hold."""
        return self.kv_tokens if self.unified else self.kv_tokens // self.slots


def refusals(plan: Plan) -> list[str]:
    """Every field of ``plan`` llama.cpp cannot honour, each as a reason naming field and value
    (the rows of :data:`REFUSALS`, in order).

    A field at its transformers default is accepted when llama.cpp's own behaviour is the same
    kind of thing (sdpa attention -> llama.cpp's attention kernel; float32 -> float32 activations
    over the GGUF's stored weight types).
    """
    return table_refusals(REFUSALS, plan)


_ACCELERATE = "accelerate placement is a transformers feature"
_CB_DEFAULTS = {"cb_max_batch_tokens": None, "cb_num_blocks": None, "cb_page_size": 256, "cb_max_memory_percent": None, "cb_scheduler": "fifo"}
_NOT_WIRED = "not wired to the llama.cpp runtime yet"


def _gguf(plan: Plan) -> bool:
    return plan.model.quant_backend == "gguf"


def _dtype_unmapped(plan: Plan) -> bool:
    return plan.hardware.dtype != "float32" and plan.hardware.dtype not in DTYPE_TYPES


def _batch_rows(name: str) -> tuple[Refusal, ...]:
    """n_batch / n_ubatch against llama.cpp's pair rule (:func:`batch_problems`)."""
    def problem(plan: Plan) -> str | None:
        return batch_problems(plan.hardware.n_batch, plan.hardware.n_ubatch).get(name)

    return (Refusal(f"hardware.{name}", lambda p: problem(p) is not None, lambda p: f"hardware.{name}={getattr(p.hardware, name)!r}: {problem(p)}"),)


def _kv_rows(name: str) -> Refusal:
    """n_batch / n_ubatch above the KV cache: llama_context runs min(n_ctx, n_batch) for a causal model, so the excess is never used."""
    def over_kv(plan: Plan) -> bool:
        v = getattr(plan.hardware, name)
        return isinstance(v, int) and v > _kv_tokens(plan)

    return Refusal(f"hardware.{name}", over_kv, lambda p: (
        f"hardware.{name}={getattr(p.hardware, name)!r}: exceeds the plan's KV cache of {_kv_tokens(p)} tokens (n_ctx), to which llama.cpp "
        "silently lowers it; set at most that, or raise model.context_cap"))


def _quant_skip_refused(plan: Plan) -> bool:
    m = plan.model
    return bool(m.quant_skip) and not (_gguf(plan) and tuple(m.quant_skip) == ("lm_head",))


def _kv_bits_refused(plan: Plan) -> bool:
    return plan.model.kv_cache == "quantized" and (plan.model.kv_bits not in KV_CACHE_TYPES or plan.model.kv_bits is None)


# The plan fields llama.cpp cannot honour, and why: one row each, in the order the reasons are listed.
REFUSALS: tuple[Refusal, ...] = (
    Refusal("hardware.device", lambda p: p.hardware.device not in ("cpu", "auto"), "the xllamacpp wheel installed here is a CPU build; use device: cpu"),
    Refusal("hardware.device_map", lambda p: p.hardware.device_map is not None, f"{_ACCELERATE}; llama.cpp runs the whole model on the CPU here"),
    Refusal("hardware.offload_folder", lambda p: p.hardware.offload_folder is not None, f"{_ACCELERATE}; llama.cpp runs the whole model on the CPU here"),
    Refusal("hardware.max_memory", lambda p: bool(p.hardware.max_memory), _ACCELERATE),
    Refusal("hardware.dtype", _dtype_unmapped, "llama.cpp computes in the GGUF's stored weight types; the dtypes it maps (a copy of the GGUF in that "
            f"type) are {['float32', *DTYPE_TYPES]}"),
    Refusal("hardware.attention", lambda p: p.hardware.attention != "sdpa",
            "transformers attention kernels do not exist in llama.cpp, which uses its own (flash attention is its own setting)"),
    Refusal("hardware.matmul_precision", lambda p: p.hardware.matmul_precision != "highest", "TF32 matmul precision is a torch setting; llama.cpp's CPU kernels have none"),
    Refusal("hardware.compile", lambda p: p.hardware.compile is not None, "torch.compile applies to torch models only; llama.cpp's kernels are compiled ahead of time"),
    Refusal("hardware.flash_attention", lambda p: p.hardware.flash_attention not in FLASH_ATTENTION, f"llama.cpp's flash attention is one of {list(FLASH_ATTENTION)}"),
    *_batch_rows("n_batch"), *_batch_rows("n_ubatch"), _kv_rows("n_batch"), _kv_rows("n_ubatch"),
    Refusal("hardware.runtime_path", lambda p: p.hardware.runtime_path is not None and executable_problem(p.hardware.runtime_path) is not None,
            lambda p: str(executable_problem(p.hardware.runtime_path))),
    Refusal("hardware.runtime_url", lambda p: p.hardware.runtime_url is not None,
            "a running server is vLLM's option; the llama_cpp runtime starts its own llama-server (runtime_path) or runs xllamacpp in this process"),
    *(Refusal(f"hardware.{name}", lambda p, n=name: getattr(p.hardware, n) != 1,
              "vLLM's split of each layer or of the stack over devices (runtime: vllm); llama.cpp spreads a model's layers over rpc-servers "
              "(split: {rpc_workers: N} or rpc_endpoints)") for name in ("tensor_parallel", "pipeline_parallel")),
    *PLACEMENT_REFUSALS,
    Refusal("hardware.prepack", lambda p: bool(p.hardware.prepack), "oneDNN prepacking is a torch feature; llama.cpp repacks quantized weights for the CPU by itself"),
    Refusal("model.quant_method", lambda p: _gguf(p) and (p.model.quant_method, p.model.weight_bits) not in GGUF_METHOD_BITS,
            f"the gguf backend writes {', '.join(f'{q} ({b} bits)' for q, b in GGUF_METHOD_BITS)}"),
    Refusal("model.weight_bits", lambda p: not _gguf(p) and (p.model.weight_bits is not None or p.model.quant_backend is not None or p.model.quant_method is not None),
            lambda p: (f"model.weight_bits={p.model.weight_bits!r}: llama.cpp serves a GGUF file: the {p.model.quant_backend or 'no'} backend quantizes "
                       f"transformers models; quantize the GGUF with the quantize pass's backend: gguf ({' / '.join(GGUF_METHODS)}) instead")),
    *(Refusal(f"model.{name}", lambda p, n=name: getattr(p.model, n) is not None, "a transformers quantization parameter; ggml's block types fix their own layout")
      for name in ("quant_group_size", "quant_sensitivity_max_kl")),
    Refusal("model.quant_skip", _quant_skip_refused, "a transformers quantization parameter; the gguf backend keeps the output head (skip: [lm_head]) or nothing"),
    Refusal("model.kv_cache", lambda p: p.model.kv_cache in ("offloaded", "off"), "llama.cpp keeps its KV cache in memory, always on (allowed: dynamic, static, quantized)"),
    Refusal("model.kv_bits", _kv_bits_refused,
            f"llama.cpp's quantized KV cache types are q8_0 and q4_0 (kv_bits 8 or 4); allowed: {[b for b in KV_CACHE_TYPES if b]}"),
    Refusal("model.kv_backend", lambda p: p.model.kv_cache == "quantized" and p.model.kv_backend not in (None, "native"),
            "quanto / hqq quantize transformers' cache; llama.cpp quantizes its own (kv_cache pass: backend: native)"),
    Refusal("model.kv_cache", lambda p: p.model.kv_cache not in ("offloaded", "off", "quantized", "dynamic", "static"),
            "unknown cache kind for llama.cpp (allowed: dynamic, static, quantized)"),
    Refusal("scheduling.batching", lambda p: p.scheduling.batching == "static",
            "llama.cpp has no padded static batches; its server batches continuously (batching: continuous)"),
    *(Refusal(f"scheduling.{name}", lambda p, n=name, d=default: getattr(p.scheduling, n) != d,
              "a setting of transformers' continuous batching; llama.cpp sizes its batch and KV cache itself") for name, default in _CB_DEFAULTS.items()),
    Refusal("application.num_beams", lambda p: p.application.num_beams > 1, "llama.cpp's server has no beam search"),
    Refusal("application.no_repeat_ngram_size", lambda p: bool(p.application.no_repeat_ngram_size),
            "llama.cpp has no n-gram ban (repetition_penalty, its repeat_penalty, is mapped)"),
    Refusal("application.prompt_budget", lambda p: p.application.prompt_budget is not None, "trimming needs the tokenizer in Python; " + _NOT_WIRED),
    Refusal("application.response_cache", lambda p: p.application.response_cache is not None, _NOT_WIRED),
    Refusal("application.prompt_lookup_tokens", lambda p: p.application.prompt_lookup_tokens is not None, "llama.cpp's n-gram speculation is not wired to this runtime yet"),
    Refusal("application.draft", lambda p: p.application.draft is not None, "llama.cpp's draft-model speculation needs a GGUF draft; not wired to this runtime yet"),
)


def _slots(plan: Plan) -> int:
    """llama.cpp's n_parallel: as many slots as the transformers server admits requests
    (max_concurrency, else its default), so both runtimes run the same number at once."""
    from ...serving.server import in_flight_limit

    return in_flight_limit(plan.scheduling)


def _kv_tokens(plan: Plan) -> int:
    """n_ctx: the tokens the whole KV cache holds. A context cap is a per-request limit, so each
    slot owns exactly that many tokens; without one the slots share one pool."""
    slots, cap = _slots(plan), plan.model.context_cap
    return cap * slots if cap else max(DEFAULT_KV_TOKENS, KV_TOKENS_PER_SLOT * slots)


def server_settings(plan: Plan, model_path: str, *, physical_cores: int | None = None) -> ServerSettings:
    """The load-time settings for ``plan``. ``physical_cores`` resolves ``threads: auto`` and a
    plan that sets no count: llama.cpp's own default is the physical cores too (common's
    ``cpu_get_num_math``), and stated, the count is what the census records, the export passes
    and ``n_threads`` / the batch threads get."""
    hw, m, s = plan.hardware, plan.model, plan.scheduling
    threads = hw.threads
    if not isinstance(threads, int):
        threads = physical_cores
    cores = replica_cores(plan, physical_cores)
    if cores is not None:  # a pinned replica runs no more threads than its cores
        threads = min(threads, cores) if isinstance(threads, int) else cores
    cache_type = KV_CACHE_TYPES[m.kv_bits] if m.kv_cache == "quantized" else "f16"
    return ServerSettings(
        model_path=model_path,
        threads=threads if isinstance(threads, int) else None,
        slots=_slots(plan),
        kv_tokens=_kv_tokens(plan),
        unified=m.context_cap is None,
        cache_type=cache_type,
        flash_attention=hw.flash_attention,
        prefix_cache=s.prefix_cache,
        n_batch=hw.n_batch,
        n_ubatch=hw.n_ubatch,
        executable=str(resolve_executable(hw.runtime_path)) if hw.runtime_path is not None else None,
        rpc_workers=hw.rpc_workers, rpc_endpoints=tuple(hw.rpc_endpoints), rpc_bind=hw.rpc_bind,
        replicas=s.replicas, replica_cores=cores,
    )


def replica_cores(plan: Plan, physical_cores: int | None) -> int | None:
    """The cores each replica is pinned to: the plan's, else the physical cores shared out; None
    for one replica the plan does not pin."""
    s = plan.scheduling
    if s.replica_cores is not None:
        return s.replica_cores
    if s.replicas > 1:
        return max(1, (physical_cores or 1) // s.replicas)
    return None


def common_params(settings: ServerSettings) -> Any:
    """``xllamacpp.CommonParams`` for ``settings`` (imports xllamacpp)."""
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = settings.model_path
    p.n_parallel = settings.slots
    p.kv_unified = settings.unified
    p.n_ctx = settings.kv_tokens
    if settings.n_batch is not None:
        p.n_batch = settings.n_batch
    if settings.n_ubatch is not None:
        p.n_ubatch = settings.n_ubatch
    if settings.threads is not None:
        p.cpuparams.n_threads = settings.threads
        p.cpuparams_batch.n_threads = settings.threads  # prefill uses the batch thread pool
    ggml_type = {"f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0"}[settings.cache_type]
    p.cache_type_k = getattr(xlc.ggml_type, ggml_type)
    p.cache_type_v = getattr(xlc.ggml_type, ggml_type)
    p.flash_attn_type = getattr(xlc.llama_flash_attn_type, FLASH_ATTENTION[settings.flash_attention])
    # Prefix reuse across requests (llama.cpp's prompt cache) makes TTFT measure a cache hit rather
    # than a prefill, so it is on only when the plan asks (scheduling.prefix_cache; request_body
    # sends the same cache_prompt).
    p.cache_prompt = settings.prefix_cache
    if not settings.prefix_cache:
        p.cache_ram_mib = 0
    p.warmup = True  # one empty decode at load, so the first timed request pays no first-touch cost
    p.verbosity = -1
    # No network listener. xllamacpp opens llama.cpp's HTTP front end next to the calls this process
    # makes (its port 0 meant a random loopback port that answered /v1/chat/completions, /slots and
    # /props to anyone on the host, past serve's key, queue and metrics). It needs one listener, so
    # it gets a Unix socket in a folder only this user may enter, and a random key nobody is told;
    # this process calls the server directly (handle_completions), never through it.
    p.hostnames = [_private_socket()]
    p.api_keys = [secrets.token_urlsafe(32)]
    p.endpoint_slots = False
    p.ui = False
    p.n_threads_http = 1  # the front end's worker threads (default: one per core, all idle here)
    return p


_SOCKETS = itertools.count()
_SOCKET_DIR: list[str] = []  # one private folder per process, made on first use and removed at exit


def _private_socket() -> str:
    """A fresh Unix socket path (llama.cpp's server takes a host ending in ``.sock`` as one) in a
    folder of mode 0700 (:func:`tempfile.mkdtemp`); under /tmp when $TMPDIR would make the path
    longer than a socket address holds (108 bytes)."""
    if not _SOCKET_DIR:
        folder = tempfile.mkdtemp(prefix="fractal-opt-llama-")
        if len(folder) > 80:
            shutil.rmtree(folder, ignore_errors=True)
            folder = tempfile.mkdtemp(prefix="fractal-opt-llama-", dir="/tmp")
        atexit.register(_remove_socket_dir, folder, os.getpid())
        _SOCKET_DIR.append(folder)
    return os.path.join(_SOCKET_DIR[0], f"server-{os.getpid()}-{next(_SOCKETS)}.sock")


def _remove_socket_dir(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child, whose exit would pull the folder from under its parent
        shutil.rmtree(folder, ignore_errors=True)


def request_body(plan: Plan, prompt: list[int], *, budget: int, seed: int, ignore_eos: bool) -> dict[str, Any]:
    """The completion request for ``prompt`` (token ids, rendered by fractal_opt: weights/prompts.py):
    decoding as ``plan.application`` says.

    Every sampling field is sent, even at its neutral value, because llama.cpp's own defaults
    differ from transformers' (top_k 40, top_p 0.95, min_p 0.05, temperature 0.8).
    """
    app = plan.application
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": budget,
        "stream": True,
        "stream_options": {"include_usage": True},  # the last chunk carries usage.prompt_tokens
        "n_probs": 1,  # each streamed token comes with its id (costs ~3% decode speed, measured)
        "cache_prompt": plan.scheduling.prefix_cache,
        "seed": llama_seed(seed),
        "repeat_penalty": app.repetition_penalty,
        "ignore_eos": ignore_eos,
    }
    if app.do_sample:
        body.update(temperature=app.temperature, top_p=app.top_p, top_k=app.top_k or 0, min_p=app.min_p or 0.0)
    else:
        body.update(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)  # greedy: the argmax token
    if app.stop:
        body["stop"] = list(app.stop)
    return body


def llama_seed(seed: int) -> int:
    """A request's seed (any signed 64-bit integer) as llama.cpp's: a 32-bit unsigned integer of
    which 0xFFFFFFFF means "a random seed", so seeds are taken modulo 2^32 - 1 (0 .. 2^32 - 2 unchanged)."""
    return seed % 0xFFFFFFFF


def describe(settings: ServerSettings) -> dict[str, Any]:
    """The settings as a JSON-friendly dict (for census and the trace)."""
    return {**{f.name: getattr(settings, f.name) for f in fields(settings)}, "context_per_request": settings.context_per_request}
