"""``--to transformers-serve``: the ``transformers serve`` command (flags of transformers 5.x) plus
the generation_config.json its model folder should hold (it starts every request from it).

The model is the folder the transformers runtime measured: a GGUF source is its dequantized
safetensors copy with the tokenizer (:func:`.common.served_folder`). transformers 5.24 refuses
a ``.gguf`` path ("Repo id must be in the form ...") and its ``repo:file.gguf`` form needs a hub
repository, so the folder is also the only form that starts from a local file.

The token cap travels in each request (``max_tokens``), not in generation_config.json: transformers
serve 5.x raises a folder's ``max_new_tokens`` under 1024 to 1024 for a request that sends none
(``_build_generation_config`` in transformers/cli/serving/utils.py), so a plan's cap of 24 written
there would let a client that sends no ``max_tokens`` generate 1,024 tokens.
"""

from __future__ import annotations

from ..tower.plan import Plan
from .common import SHARED, TORCH_ONLY, Export, Where, openai_request, served_folder, thread_count
from .gen_config import GEN_CONFIG
from .gen_config import build as write_generation_config

__all__ = ["RUNTIME", "TABLE", "build"]

RUNTIME = "transformers"  # the fractal_opt runtime that measures the same kind of server

TABLE: dict[str, tuple[str, str]] = {
    **SHARED,
    **GEN_CONFIG,
    "application.max_new_tokens": ("request", "max_tokens in each request: transformers serve raises a generation_config.json max_new_tokens under 1024 to 1024"),
    "hardware.device": ("arg", "--device"),
    "hardware.device_map": ("lost", "transformers serve loads on one --device; it takes no device_map"),
    "hardware.max_memory": ("lost", "transformers serve takes no per-device memory caps"),
    "hardware.offload_folder": ("lost", "transformers serve has no disk offload flag"),
    "hardware.dtype": ("arg", "--dtype"),
    "hardware.threads": ("env", "OMP_NUM_THREADS (torch's intra-op threads)"),
    "hardware.attention": ("arg", "--attn-implementation"),
    "hardware.matmul_precision": ("lost", TORCH_ONLY + " (torch.set_float32_matmul_precision)"),
    "hardware.compile": ("arg", "--compile (its own mode: the plan's compile mode does not carry)"),
    "hardware.prepack": ("lost", TORCH_ONLY + " (oneDNN prepacking of Linear weights)"),
    "hardware.flash_attention": ("lost", "llama.cpp's flash-attention switch; transformers picks its kernel with --attn-implementation"),
    "hardware.n_batch": ("lost", "llama.cpp's tokens per decode call; transformers serve's tokens per step is --cb-max-batch-tokens (scheduling.cb_max_batch_tokens)"),
    "hardware.n_ubatch": ("lost", "llama.cpp's tokens per forward pass; transformers serve has no such flag"),
    "hardware.tensor_parallel": ("lost", "vLLM's tensor parallelism; transformers serve has none"),
    "hardware.pipeline_parallel": ("lost", "vLLM's pipeline parallelism; transformers serve has none"),
    "model.weight_bits": ("arg", "--quantization bnb-8bit / bnb-4bit (bitsandbytes only; bnb-4bit is nf4 with double quantization, which fractal_opt did not measure)"),
    "model.quant_backend": ("arg", "--quantization: only bitsandbytes carries (torchao / quanto have no flag)"),
    "model.quant_method": ("arg", "--quantization: bitsandbytes' default method (nf4 for 4-bit)"),
    "model.quant_group_size": ("lost", "transformers serve's --quantization has a fixed layout"),
    "model.quant_skip": ("lost", "transformers serve's --quantization quantizes every Linear layer"),
    "model.quant_sensitivity_max_kl": ("lost", "needs per-module skips, which --quantization does not take"),
    "scheduling.batching": ("arg", "--continuous-batching (sequential / static: one request per generate call)"),
    "scheduling.max_concurrency": ("lost", "transformers serve admits every request it receives; cap concurrency in the reverse proxy"),
    "scheduling.streaming": ("request", "stream: true/false, chosen by each client"),
    "scheduling.prefix_cache": ("lost", "transformers serve has no flag for its paged cache's block sharing, which is on by default (prefix_cache: false is not honoured there)"),
    "scheduling.cb_max_batch_tokens": ("arg", "--cb-max-batch-tokens"),
    "scheduling.cb_num_blocks": ("arg", "--cb-num-blocks"),
    "scheduling.cb_page_size": ("arg", "--cb-block-size"),
    "scheduling.cb_max_memory_percent": ("arg", "--cb-max-memory-percent"),
    "scheduling.cb_scheduler": ("lost", "transformers serve has no scheduler flag (it uses fifo)"),
}


def build(plan: Plan, where: Where, out: Export) -> dict[str, str]:
    """Fill ``out`` with the command, environment, request fields and generation_config.json;
    return the reason for each changed field that does not carry as the plan has it."""
    hw, m, s = plan.hardware, plan.model, plan.scheduling
    reasons = write_generation_config(plan, where, out)
    model, converted = served_folder(where.model)
    if converted:
        out.remarks.append(f"{model}: the GGUF dequantized to safetensors with its tokenizer, the folder the transformers runtime measured; "
                           "put generation_config.json there (or pass --write)")
    cmd = ["transformers", "serve", model, "--host", where.host, "--port", str(where.port), "--device", hw.device, "--dtype", hw.dtype]
    if hw.attention != "sdpa":
        cmd += ["--attn-implementation", hw.attention]
    if hw.compile is not None:
        cmd.append("--compile")
    if m.weight_bits is not None:
        if m.quant_backend == "bitsandbytes" and m.weight_bits in (4, 8) and m.quant_method in (None, "nf4", "int8"):
            cmd += ["--quantization", f"bnb-{m.weight_bits}bit"]
        else:
            why = f"transformers serve quantizes with bitsandbytes only (--quantization bnb-4bit / bnb-8bit), not {m.quant_backend} {m.quant_method or ''}".rstrip()
            reasons.update({"model.weight_bits": why, "model.quant_backend": why, "model.quant_method": why})
    if hw.compile not in (None, "default"):
        reasons["hardware.compile"] = f"transformers serve --compile uses its own mode; the plan's {hw.compile!r} does not carry"
    if s.batching == "continuous":
        cmd.append("--continuous-batching")
        for name, flag in (("cb_max_batch_tokens", "--cb-max-batch-tokens"), ("cb_num_blocks", "--cb-num-blocks"), ("cb_max_memory_percent", "--cb-max-memory-percent")):
            if getattr(s, name) is not None:
                cmd += [flag, str(getattr(s, name))]
        cmd += ["--cb-block-size", str(s.cb_page_size)]
    elif s.batching == "static":
        reasons["scheduling.batching"] = "transformers serve has no padded static batches: without --continuous-batching it runs one request per generate call"
    threads, why, remark = thread_count(plan, where, flag="OMP_NUM_THREADS")
    if threads is not None:
        out.env["OMP_NUM_THREADS"] = str(threads)
    if why:
        reasons["hardware.threads"] = why
    if remark:
        out.remarks.append(remark)
    out.command = cmd
    out.request = {"model": model, **openai_request(plan)}  # a server given its model answers requests for that id only
    if plan.application.max_new_tokens:
        out.remarks.append(f"max_tokens {plan.application.max_new_tokens} goes in every request: transformers serve raises a "
                           "generation_config.json max_new_tokens under 1024 to 1024 for a request that sends none")
    return reasons
