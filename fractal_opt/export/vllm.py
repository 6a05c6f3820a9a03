"""``--to vllm``: the ``vllm serve`` command, its environment and the per-request fields, from the
same mapping the vllm runtime measures with (:mod:`fractal_opt.runtimes.vllm.engine_args`).

The model is what the vllm runtime loads: a GGUF source's dequantized safetensors folder, with
``--tokenizer`` naming the tokenizer saved beside it (vLLM reads a GGUF only experimentally, and
then needs the original model's tokenizer; the runtime never measured that path).
"""

from __future__ import annotations

from ..tower.plan import Plan
from .common import OWN_SERVER, SHARED, Export, Where, served_folder, stream, thread_count

__all__ = ["RUNTIME", "build", "table"]

RUNTIME = "vllm"  # the fractal_opt runtime that measures the same server


def table() -> dict[str, tuple[str, str]]:
    """From the vllm runtime's own table (engine_args.FIELDS), so the export and the measurement agree."""
    from ..runtimes.vllm.engine_args import FIELDS

    kinds = {"arg": "arg", "env": "env", "request": "request", "select": "select", "refuse": "lost", "client": "lost"}
    out: dict[str, tuple[str, str]] = {"source": ("select", "the model vllm serve loads")}
    for name, kind in FIELDS.items():
        why = {"refuse": "vLLM cannot honour it (see the reason)", "client": OWN_SERVER}.get(kind, "see the command")
        out[name] = (kinds[kind], why)
    out["scheduling.streaming"] = ("request", "stream: true/false, chosen by each client")
    out["application.chat_template"] = SHARED["application.chat_template"]
    return out


def build(plan: Plan, where: Where, out: Export) -> dict[str, str]:
    """Fill ``out`` with the command, environment and request fields; return the reason for each
    changed field that does not carry as the plan has it."""
    from ..runtimes.vllm.engine_args import engine_args, refusals, sampling, server_env

    reasons = {}
    for reason in refusals(plan):  # each names its field first: "section.field=value: why"
        name = reason.split("=", 1)[0].split(" ")[0]
        reasons[name] = reason.split(": ", 1)[-1]
    args = engine_args(plan)
    # A flag whose field vLLM cannot honour here (fp8 weights on the CPU build) is left out.
    for name, flag in (("model.weight_bits", "--quantization"), ("model.kv_bits", "--kv-cache-dtype"), ("application.draft", "--speculative-config"),
                       ("application.prompt_lookup_tokens", "--speculative-config")):
        if name in reasons and flag in args:
            i = args.index(flag)
            del args[i : i + 2]
    model, converted = served_folder(where.model)
    tokenizer = ["--tokenizer", model] if converted else []
    if converted:
        out.remarks.append(f"{model}: the GGUF dequantized to safetensors with its tokenizer, the folder the vllm runtime loads")
    out.command = ["vllm", "serve", model, *tokenizer, "--host", where.host, "--port", str(where.port), *args]
    # Without a plan value vLLM's CPU worker picks its own count, which the run did not record.
    threads, why, remark = thread_count(plan, where, flag="OMP_NUM_THREADS") if plan.hardware.threads is not None else (None, None, None)
    out.env = server_env(plan, physical_cores=threads)
    if why:
        reasons["hardware.threads"] = why
    if remark:
        out.remarks.append(remark)
    body = sampling(plan, plan.application.max_new_tokens or 0)
    body.pop("seed", None)
    if not plan.application.max_new_tokens:
        body.pop("max_tokens", None)
    out.request = {"model": model, **stream(plan), **body}  # vllm serve names the model by its path unless --served-model-name
    m = plan.model
    if "model.weight_bits" in reasons:  # the whole weight quantization stays behind
        for name in ("quant_backend", "quant_method"):
            if getattr(m, name) is not None:
                reasons[f"model.{name}"] = "goes with model.weight_bits, which does not carry over"
    for name in ("application.draft", "application.prompt_lookup_tokens"):
        if name in reasons and plan.application.draft_tokens != 5:
            reasons["application.draft_tokens"] = f"goes with {name}, which does not carry over"
    if m.kv_cache == "static":
        reasons["model.kv_cache"] = "vLLM's paged KV cache is always preallocated; no flag to set, and the static cache's measured effect does not transfer"
    return reasons
