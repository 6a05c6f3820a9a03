"""``--to llama-server``: llama.cpp's ``llama-server`` command, from the mapping the llama_cpp
runtime measures with (:mod:`fractal_opt.runtimes.llama_cpp.settings`; the flags are
:func:`fractal_opt.runtimes.llama_cpp.process.command`'s), decoding defaults as flags.

llama-server reads the GGUF itself, so the model is the file the runtime measured: the embedded
or given GGUF, or its re-quantized / widened copy when a kept pass made one.
"""

from __future__ import annotations

import dataclasses

from ..core.errors import ModelSourceError
from ..tower.plan import Plan
from .common import SHARED, TORCH_ONLY, Export, Where, stream, thread_count

__all__ = ["RUNTIME", "TABLE", "build", "rpc_addresses"]

RUNTIME = "llama_cpp"  # the fractal_opt runtime that measures the same server

TABLE: dict[str, tuple[str, str]] = {
    **SHARED,
    "hardware.device": ("lost", "llama-server's device is its build (-ngl offloads layers to a GPU build); fractal_opt measured the CPU build"),
    "hardware.device_map": ("lost", "accelerate placement is a transformers feature"),
    "hardware.max_memory": ("lost", "accelerate placement is a transformers feature"),
    "hardware.offload_folder": ("lost", "accelerate placement is a transformers feature"),
    "hardware.dtype": ("arg", "--model: llama.cpp computes in the GGUF's own weight types; bfloat16 / float16 name the copy widened to that type"),
    "hardware.runtime_path": ("select", "the llama-server fractal_opt ran (native: built for the measuring CPU by make setup-llama-native); build one for the target's CPU"),
    "hardware.threads": ("arg", "--threads / --threads-batch"),
    "hardware.attention": ("lost", "llama.cpp uses its own attention kernel"),
    "hardware.matmul_precision": ("lost", TORCH_ONLY),
    "hardware.compile": ("lost", "llama.cpp's kernels are compiled ahead of time"),
    "hardware.prepack": ("lost", "llama.cpp repacks weights for the CPU by itself"),
    "hardware.flash_attention": ("arg", "--flash-attn on|off|auto"),
    "hardware.n_batch": ("arg", "--batch-size"),
    "hardware.n_ubatch": ("arg", "--ubatch-size"),
    "hardware.tensor_parallel": ("lost", "vLLM's tensor parallelism (llama.cpp splits layers with --split-mode on several GPUs)"),
    "hardware.pipeline_parallel": ("lost", "vLLM's pipeline parallelism"),
    "hardware.rpc_workers": ("arg", "--rpc RPC_HOST_1:50052,... --n-gpu-layers 999 (each rpc-server's own command: --to cluster)"),
    "hardware.rpc_endpoints": ("arg", "--rpc host:port,... --n-gpu-layers 999"),
    "model.weight_bits": ("arg", "--model: the GGUF file re-quantized by the gguf backend (other backends are refused by llama.cpp)"),
    "model.quant_backend": ("arg", "--model: the re-quantized GGUF file (gguf backend)"),
    "model.quant_method": ("arg", "--model: the re-quantized GGUF file's block type (q8_0 / q4_0)"),
    "model.quant_group_size": ("lost", "the GGUF file fixes the weights' quantization"),
    "model.quant_skip": ("arg", "--model: [lm_head] = the re-quantized file keeps the output head's stored type (gguf backend)"),
    "model.quant_sensitivity_max_kl": ("lost", "the GGUF file fixes the weights' quantization"),
    "model.kv_cache": ("arg", "--cache-type-k / --cache-type-v (quantized); dynamic and static are llama.cpp's one preallocated cache"),
    "model.kv_bits": ("arg", "--cache-type-k / --cache-type-v q8_0 / q4_0"),
    "model.kv_backend": ("arg", "native: llama.cpp's own cache types"),
    "model.context_cap": ("arg", "--ctx-size = cap x slots (each slot holds one request)"),
    "model.trust_remote_code": ("lost", "llama.cpp runs no model code of its own: the converter reads the weights, and only an architecture it knows converts"),
    "scheduling.batching": ("arg", "--parallel (slots; llama-server batches continuously)"),
    "scheduling.max_concurrency": ("arg", "--parallel"),
    "scheduling.streaming": ("request", "stream: true/false, chosen by each client"),
    "scheduling.prefix_cache": ("request", "cache_prompt per request (llama-server's default is on); --cache-ram 0 when off"),
    "scheduling.cb_max_batch_tokens": ("lost", "transformers' continuous batching size; llama.cpp sizes its batch itself (--batch-size)"),
    "scheduling.cb_num_blocks": ("lost", "transformers' paged cache; llama.cpp sizes its cache with --ctx-size"),
    "scheduling.cb_page_size": ("lost", "transformers' paged cache"),
    "scheduling.cb_max_memory_percent": ("lost", "transformers' paged cache"),
    "scheduling.cb_scheduler": ("lost", "transformers' continuous batching scheduler"),
    "application.max_new_tokens": ("arg", "--n-predict (and max_tokens per request)"),
    "application.stop": ("request", "stop per request (llama-server has no default-stop flag)"),
    "application.do_sample": ("arg", "--temp 0 --top-k 1 when greedy"),
    "application.temperature": ("arg", "--temp"),
    "application.top_p": ("arg", "--top-p"),
    "application.top_k": ("arg", "--top-k (0 = off)"),
    "application.min_p": ("arg", "--min-p (llama.cpp's default is 0.05, so it is always sent)"),
    "application.num_beams": ("lost", "llama-server has no beam search"),
    "application.repetition_penalty": ("arg", "--repeat-penalty"),
    "application.no_repeat_ngram_size": ("lost", "llama.cpp has no n-gram ban"),
    "application.prompt_lookup_tokens": ("lost", "llama.cpp's n-gram speculation is not wired in fractal_opt, so it was never measured"),
    "application.draft": ("lost", "llama-server's draft model (--model-draft) needs a GGUF draft; not measured by fractal_opt"),
    "application.draft_tokens": ("lost", "goes with the draft model"),
}


def build(plan: Plan, where: Where, out: Export) -> dict[str, str]:
    """Fill ``out`` with the command and request fields; return the reason for each changed
    field that does not carry as the plan has it."""
    from ..runtimes.llama_cpp.process import command
    from ..runtimes.llama_cpp.model_file import DTYPE_TYPES
    from ..runtimes.llama_cpp.settings import refusals, server_settings

    reasons: dict[str, str] = {}
    model = where.model
    if plan.model.quant_backend == "gguf" or plan.hardware.dtype in DTYPE_TYPES:
        model, why = _requantized_model(plan, model)
        if why:
            fields = ("model.weight_bits", "model.quant_backend", "model.quant_method") if plan.model.quant_backend == "gguf" else ("hardware.dtype",)
            reasons.update(dict.fromkeys(fields, why))
    threads, why, remark = thread_count(plan, where, flag="--threads / --threads-batch")
    settings = server_settings(plan, model, physical_cores=threads)
    a = plan.application
    # The flags the llama_cpp runtime measured with when it ran llama-server itself (one mapping).
    cmd = command("llama-server", settings, where.port, host=where.host, rpc=rpc_addresses(settings))
    if a.max_new_tokens:
        cmd += ["--n-predict", str(a.max_new_tokens)]
    if a.do_sample:
        cmd += ["--temp", str(a.temperature), "--top-p", str(a.top_p), "--top-k", str(a.top_k or 0), "--min-p", str(a.min_p or 0.0)]
    else:
        cmd += ["--temp", "0", "--top-k", "1", "--top-p", "1.0", "--min-p", "0.0"]
    cmd += ["--repeat-penalty", str(a.repetition_penalty)]
    out.command = cmd
    out.request = {**stream(plan), "cache_prompt": settings.prefix_cache, **({"stop": list(a.stop)} if a.stop else {})}
    if remark:
        out.remarks.append(remark)
    for reason in refusals(plan):
        name = reason.split("=", 1)[0]
        reasons[name] = reason.split(": ", 1)[-1]
    if "model.weight_bits" in reasons:  # a transformers backend: none of its fields reaches the file
        reasons.update({f"model.{f}": reasons["model.weight_bits"] for f in ("quant_backend", "quant_method", "quant_skip")
                        if getattr(plan.model, f)})
    if plan.model.kv_cache == "static":
        reasons["model.kv_cache"] = "llama.cpp preallocates its KV cache at load (--ctx-size) anyway; the static cache's measured effect does not transfer"
    if why:
        reasons["hardware.threads"] = why
    return reasons


def rpc_addresses(settings: object, *, port: int = 50052) -> list[str]:
    """Where the plan's rpc-servers listen, for a launch command: a placeholder per rpc-server this
    machine started (``RPC_HOST_N:port``: one machine each in a cluster), then the plan's endpoints."""
    started = [f"RPC_HOST_{i + 1}:{port}" for i in range(getattr(settings, "rpc_workers", 0))]
    return [*started, *getattr(settings, "rpc_endpoints", ())]


def _requantized_model(plan: Plan, model: str) -> tuple[str, str | None]:
    """(the GGUF llama-server loads, or ``model`` with why it could not be made here).

    The file is the one the llama_cpp runtime measured (cached; made now if it is not)."""
    from ..runtimes.llama_cpp.model_file import DTYPE_TYPES, model_file
    from ..weights.models import resolve

    try:
        source = resolve(model)
    except ModelSourceError as e:
        source, problem = None, str(e)
    else:
        problem = None if source.kind in ("gguf", "embedded") or source.folder is not None else f"{model!r} is not a GGUF file or a model folder"
    if source is None or problem:
        gguf = plan.model.quant_backend == "gguf"
        target = plan.model.quant_method if gguf else DTYPE_TYPES[plan.hardware.dtype].lower()
        if target in ("q8_0", "q4_0", "bf16", "f16"):
            how = f"python -m fractal_opt.weights.gguf_rewrite MODEL.gguf --type {target}" + ("" if not gguf or "lm_head" in plan.model.quant_skip else " --requantize-head")
        else:
            how = f"llama-quantize --allow-requantize MODEL.gguf MODEL-{target.upper()}.gguf {target.upper()}"
        return model, f"{problem}; convert the GGUF on the target: {how}"
    try:
        return str(model_file(dataclasses.replace(plan, source=model), progress=lambda _: None)), None
    except ModelSourceError as e:
        return model, str(e)
