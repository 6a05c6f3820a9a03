"""Export a tuned plan as the launch settings of the servers people run (pure: no torch, no model).

``fractal-opt export RUN_DIR --to TARGET`` prints, for the kept plan:

- ``transformers-serve``: the ``transformers serve`` command (flags of transformers 5.x) plus the
  generation_config.json its model folder should hold (it starts every request from it);
- ``vllm``: the ``vllm serve`` command, its environment and the per-request fields, from the same
  mapping the vllm runtime measures with (:mod:`fractal_opt.runtimes.vllm.engine_args`);
- ``llama-server``: llama.cpp's ``llama-server`` command, from the mapping the llama_cpp runtime
  measures with (:mod:`fractal_opt.runtimes.llama_cpp.settings`), decoding defaults as flags;
- ``generation-config``: generation_config.json alone (any transformers-based server reads it).

Each comes with the plan fields that do not carry over to that target (and why), the kept passes
they belong to, and the line that the numbers were measured on the runtime the plan names: a plan
carried to another server is a starting point to re-measure there, not a measured result.

:func:`table` says, for every plan field and every target, where the field goes; the table test
(tests/serving/test_export.py) iterates the Plan dataclass, so a new plan field fails until mapped.

Example:
    >>> from fractal_opt.plan import Plan
    >>> plan = Plan(source="my-model").replace_section("scheduling", batching="continuous", max_concurrency=8)
    >>> export(plan, "vllm").command[:3]
    ['vllm', 'serve', 'my-model']
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ModelSourceError, RecipeError, closest
from .plan import SECTIONS, Plan

__all__ = ["KINDS", "TARGETS", "Export", "export", "generation_config", "plan_fields", "table"]

TARGETS = ("transformers-serve", "vllm", "llama-server", "generation-config")

# Where a plan field goes on a target:
#   arg      a launch flag of the target server
#   env      the server's environment
#   request  a per-request field the client sends (or the server's default for it)
#   config   a generation_config.json key
#   select   names the model / runtime: the target itself is that choice
#   lost     does not carry over; listed, with the reason, when the plan changed it
KINDS = ("arg", "env", "request", "config", "select", "lost")

# fractal_opt's own request server (fractal-opt serve keeps them; the other servers do not).
_OWN_SERVER = "fractal_opt's own request server: `fractal-opt serve` keeps it, this server has no such setting"
_OWN_APP = "fractal_opt's application layer (prompt trimming / response cache): `fractal-opt serve` keeps it, this server has none"
_TORCH_ONLY = "a setting of the transformers runtime in fractal_opt's own process (torch); this server has no such flag"

# The entries every external target shares; each target's table below adds or overrides the rest.
_SHARED: dict[str, tuple[str, str]] = {
    "source": ("select", "the model the server loads"),
    "hardware.runtime": ("select", "the runtime the numbers were measured on (see the note)"),
    "hardware.runtime_path": ("select", "where fractal_opt found vLLM; the server is launched by you"),
    "hardware.runtime_url": ("select", "a running vLLM fractal_opt measured against; the server is launched by you"),
    "scheduling.max_queue": ("lost", _OWN_SERVER + " (bounded queue, HTTP 429 when full)"),
    "scheduling.timeout_s": ("lost", _OWN_SERVER + " (per-request deadline); put a timeout in the reverse proxy or client"),
    "scheduling.max_wait_ms": ("lost", "static batching's fill wait exists only in fractal_opt's transformers server"),
    "scheduling.batch_size": ("lost", "padded static batches exist only in fractal_opt's transformers server"),
    "application.prompt_budget": ("lost", _OWN_APP),
    "application.prompt_strategy": ("lost", _OWN_APP),
    "application.head_share": ("lost", _OWN_APP),
    "application.response_cache": ("lost", _OWN_APP),
    "application.cache_max_entries": ("lost", _OWN_APP),
    "application.cache_ttl_s": ("lost", _OWN_APP),
    "application.cache_threshold": ("lost", _OWN_APP),
}

_GEN_CONFIG: dict[str, tuple[str, str]] = {
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
}

_LOAD_LOST = {  # how the weights are loaded: no generation_config.json key (a launch flag at most)
    "hardware.device": "where the weights load", "hardware.device_map": "accelerate placement", "hardware.max_memory": "accelerate placement caps",
    "hardware.offload_folder": "disk offload", "hardware.dtype": "the weights' dtype", "hardware.threads": "torch's thread count",
    "hardware.attention": "the attention kernel", "hardware.matmul_precision": "torch's float32 matmul precision", "hardware.compile": "torch.compile",
    "hardware.prepack": "oneDNN weight prepacking", "hardware.flash_attention": "llama.cpp's flash attention",
    "hardware.n_batch": "llama.cpp's tokens per decode call", "hardware.n_ubatch": "llama.cpp's tokens per forward pass",
    "hardware.tensor_parallel": "vLLM's tensor parallelism", "hardware.pipeline_parallel": "vLLM's pipeline parallelism",
    "model.weight_bits": "weight quantization", "model.quant_backend": "weight quantization", "model.quant_method": "weight quantization",
    "model.quant_group_size": "weight quantization", "model.quant_skip": "weight quantization", "model.quant_sensitivity_max_kl": "weight quantization",
}
_SCHED_LOST = ("batching", "max_concurrency", "streaming", "prefix_cache", "cb_max_batch_tokens", "cb_num_blocks", "cb_page_size", "cb_max_memory_percent", "cb_scheduler")

_GENERATION_CONFIG_TABLE: dict[str, tuple[str, str]] = {
    **_SHARED,
    **{k: ("lost", f"{why}: how the model is loaded, not a decoding default (generation_config.json holds decoding only)") for k, why in _LOAD_LOST.items()},
    **{f"scheduling.{k}": ("lost", "scheduling belongs to the server that loads the model, not to generation_config.json") for k in _SCHED_LOST},
    **_GEN_CONFIG,
}

_TRANSFORMERS_SERVE_TABLE: dict[str, tuple[str, str]] = {
    **_SHARED,
    **_GEN_CONFIG,
    "hardware.device": ("arg", "--device"),
    "hardware.device_map": ("lost", "transformers serve loads on one --device; it takes no device_map"),
    "hardware.max_memory": ("lost", "transformers serve takes no per-device memory caps"),
    "hardware.offload_folder": ("lost", "transformers serve has no disk offload flag"),
    "hardware.dtype": ("arg", "--dtype"),
    "hardware.threads": ("env", "OMP_NUM_THREADS (torch's intra-op threads)"),
    "hardware.attention": ("arg", "--attn-implementation"),
    "hardware.matmul_precision": ("lost", _TORCH_ONLY + " (torch.set_float32_matmul_precision)"),
    "hardware.compile": ("arg", "--compile (its own mode: the plan's compile mode does not carry)"),
    "hardware.prepack": ("lost", _TORCH_ONLY + " (oneDNN prepacking of Linear weights)"),
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


def _vllm_table() -> dict[str, tuple[str, str]]:
    """From the vllm runtime's own table (engine_args.FIELDS), so the export and the measurement agree."""
    from .runtimes.vllm.engine_args import FIELDS

    kinds = {"arg": "arg", "env": "env", "request": "request", "select": "select", "refuse": "lost", "client": "lost"}
    out: dict[str, tuple[str, str]] = {"source": ("select", "the model vllm serve loads")}
    for name, kind in FIELDS.items():
        why = {"refuse": "vLLM cannot honour it (see the reason)", "client": _OWN_SERVER}.get(kind, "see the command")
        out[name] = (kinds[kind], why)
    out["scheduling.streaming"] = ("request", "stream: true/false, chosen by each client")
    return out


_LLAMA_SERVER_TABLE: dict[str, tuple[str, str]] = {
    **_SHARED,
    "hardware.device": ("lost", "llama-server's device is its build (-ngl offloads layers to a GPU build); fractal_opt measured the CPU build"),
    "hardware.device_map": ("lost", "accelerate placement is a transformers feature"),
    "hardware.max_memory": ("lost", "accelerate placement is a transformers feature"),
    "hardware.offload_folder": ("lost", "accelerate placement is a transformers feature"),
    "hardware.dtype": ("arg", "--model: llama.cpp computes in the GGUF's own weight types; bfloat16 / float16 name the copy widened to that type"),
    "hardware.runtime_path": ("select", "the llama-server fractal_opt ran (native: built for the measuring CPU by make setup-llama-native); build one for the target's CPU"),
    "hardware.threads": ("arg", "--threads / --threads-batch"),
    "hardware.attention": ("lost", "llama.cpp uses its own attention kernel"),
    "hardware.matmul_precision": ("lost", _TORCH_ONLY),
    "hardware.compile": ("lost", "llama.cpp's kernels are compiled ahead of time"),
    "hardware.prepack": ("lost", "llama.cpp repacks weights for the CPU by itself"),
    "hardware.flash_attention": ("arg", "--flash-attn on|off|auto"),
    "hardware.n_batch": ("arg", "--batch-size"),
    "hardware.n_ubatch": ("arg", "--ubatch-size"),
    "hardware.tensor_parallel": ("lost", "vLLM's tensor parallelism (llama.cpp splits layers with --split-mode on several GPUs)"),
    "hardware.pipeline_parallel": ("lost", "vLLM's pipeline parallelism"),
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

# Target -> runtime that measures the same server (the note says so when the plan's differs).
RUNTIME_OF = {"transformers-serve": "transformers", "vllm": "vllm", "llama-server": "llama_cpp", "generation-config": "transformers"}


def _tables() -> dict[str, dict[str, tuple[str, str]]]:
    return {
        "transformers-serve": _TRANSFORMERS_SERVE_TABLE,
        "vllm": _vllm_table(),
        "llama-server": _LLAMA_SERVER_TABLE,
        "generation-config": _GENERATION_CONFIG_TABLE,
    }


@functools.cache
def table(target: str) -> dict[str, tuple[str, str]]:
    """For ``target``, every plan field -> ``(kind, where or why)``; kinds are :data:`KINDS`.

    Built on first use: the vllm table reads the vllm runtime's own (engine_args.FIELDS).
    """
    return _tables()[target]


def plan_fields() -> list[str]:
    """Every plan field as ``"section.field"`` (plus ``"source"``), in dataclass order."""
    out = [f.name for f in dataclasses.fields(Plan) if f.name not in SECTIONS and f.name != "applied"]
    for section, cls in SECTIONS.items():
        out.extend(f"{section}.{f.name}" for f in dataclasses.fields(cls))
    return out


def _value(plan: Plan, name: str) -> Any:
    if "." not in name:
        return getattr(plan, name)
    section, key = name.split(".")
    return getattr(getattr(plan, section), key)


def _changed(before: Plan, after: Plan) -> list[str]:
    return [n for n in plan_fields() if n != "source" and _value(before, n) != _value(after, n)]


@dataclass
class Export:
    """What a target needs to run the plan, and what does not carry over."""

    target: str
    command: list[str] | None = None  # the launch command (None for generation-config)
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # file name -> text (generation_config.json)
    request: dict[str, Any] = field(default_factory=dict)  # per-request fields a client sends
    lost: list[tuple[str, Any, str]] = field(default_factory=list)  # (field, value, why) for changed fields that do not carry
    lost_passes: list[tuple[str, list[str]]] = field(default_factory=list)  # (kept pass, its fields that do not carry)
    note: str = ""

    def to_text(self) -> str:
        lines = [f"# fractal-opt export --to {self.target}", ""]
        if self.command:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
            lines += ["Launch:", "  " + (env + " " if env else "") + shlex.join(self.command), ""]
        if self.request:
            lines += ["Per-request fields (send them, or the server's defaults apply):", "  " + json.dumps(self.request, sort_keys=True), ""]
        for name, text in self.files.items():
            lines += [f"{name}:", *("  " + line for line in text.splitlines()), ""]
        if self.lost:
            lines.append("Does not carry over to this target:")
            lines += [f"  - {name}={value!r}: {why}" for name, value, why in self.lost]
            if self.lost_passes:
                lines.append("  kept passes affected: " + "; ".join(f"{p} ({', '.join(f)})" for p, f in self.lost_passes))
            lines.append("")
        else:
            lines += ["Every field the kept passes changed carries over to this target.", ""]
        lines.append(self.note)
        return "\n".join(lines)


def export(plan: Plan, target: str, *, passes: Sequence[Any] = (), model_path: str | None = None, measured: str | None = None,
           host: str = "127.0.0.1", port: int = 8000) -> Export:
    """The launch settings of ``target`` for ``plan``.

    Args:
        plan: the kept plan (a tuned recipe's ``plan()``).
        target: one of :data:`TARGETS`.
        passes: the kept passes (a tuned recipe's ``passes``), to name the ones that do not carry.
        model_path: the model's local path (default: the plan's source as written).
        measured: where the numbers were measured ("llama_cpp on 2-core Xeon ..."), for the note.

    Raises:
        RecipeError: an unknown target (with the valid ones and the closest match).
    """
    if target not in TARGETS:
        raise RecipeError(f"export --to: unknown target {target!r}. Valid targets are: {list(TARGETS)}.{closest(target, TARGETS)}")
    fields_of = table(target)
    base = Plan(source=plan.source)
    model = model_path or plan.source
    out = Export(target=target)
    reasons: dict[str, str] = {}  # field -> why it does not carry, for this plan's value
    if target == "vllm":
        reasons = _vllm(plan, model, out, host, port)
    elif target == "llama-server":
        reasons = _llama_server(plan, model, out, host, port)
    else:
        out.files["generation_config.json"] = json.dumps(generation_config(plan), indent=2, sort_keys=True) + "\n"
        if target == "transformers-serve":
            reasons = _transformers_serve(plan, model, out, host, port)
    for name in _changed(base, plan):
        kind, why = fields_of[name]
        if kind == "lost" or name in reasons:
            out.lost.append((name, _value(plan, name), reasons.get(name, why)))
    lost_names = {name for name, _, _ in out.lost}
    previous = base
    for p in passes:
        after = p.apply(previous)
        fields = [n for n in _changed(previous, after) if n in lost_names]
        if fields:
            out.lost_passes.append((f"{p.layer.section}/{p.name}", fields))
        previous = after
    runtime = plan.hardware.runtime
    where = f" ({measured})" if measured else ""
    server = "the server that loads this file" if target == "generation-config" else target
    out.note = (f"The numbers in this run were measured on the {runtime} runtime{where}, with fractal_opt's own request server; "
                f"{server} is another server" + (" on another runtime" if RUNTIME_OF[target] != runtime else "") +
                ": re-measure there before relying on them.")
    return out


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


def _transformers_serve(plan: Plan, model: str, out: Export, host: str, port: int) -> dict[str, str]:
    hw, m, s = plan.hardware, plan.model, plan.scheduling
    cmd = ["transformers", "serve", model, "--host", host, "--port", str(port), "--device", hw.device, "--dtype", hw.dtype]
    if hw.attention != "sdpa":
        cmd += ["--attn-implementation", hw.attention]
    if hw.compile is not None:
        cmd.append("--compile")
    reasons: dict[str, str] = {}
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
    if isinstance(hw.threads, int):
        out.env["OMP_NUM_THREADS"] = str(hw.threads)
    elif hw.threads == "auto":
        reasons["hardware.threads"] = "'auto' (physical cores) was resolved on the measured machine; set OMP_NUM_THREADS to the target's physical cores"
    out.command = cmd
    out.request = _openai_request(plan)
    return reasons


def _vllm(plan: Plan, model: str, out: Export, host: str, port: int) -> dict[str, str]:
    from .runtimes.vllm.engine_args import engine_args, refusals, sampling, server_env

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
    out.command = ["vllm", "serve", model, "--host", host, "--port", str(port), *args]
    out.env = server_env(plan)
    body = sampling(plan, plan.application.max_new_tokens or 0)
    body.pop("seed", None)
    if not plan.application.max_new_tokens:
        body.pop("max_tokens", None)
    out.request = {**_stream(plan), **body}
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
    if plan.hardware.threads == "auto":
        reasons["hardware.threads"] = "'auto' (physical cores) is resolved on the target: set OMP_NUM_THREADS to its physical cores"
    return reasons


def _llama_server(plan: Plan, model: str, out: Export, host: str, port: int) -> dict[str, str]:
    from .runtimes.llama_cpp.settings import refusals, server_settings

    from .runtimes.llama_cpp.process import command
    from .runtimes.llama_cpp.requantize import DTYPE_TARGETS

    reasons: dict[str, str] = {}
    if plan.model.quant_backend == "gguf" or plan.hardware.dtype in DTYPE_TARGETS:
        model, why = _requantized_model(plan, model)
        if why:
            fields = ("model.weight_bits", "model.quant_backend", "model.quant_method") if plan.model.quant_backend == "gguf" else ("hardware.dtype",)
            reasons.update(dict.fromkeys(fields, why))
    settings = server_settings(plan, model)
    a = plan.application
    # The flags the llama_cpp runtime measured with when it ran llama-server itself (one mapping).
    cmd = command("llama-server", settings, port, host=host)
    if a.max_new_tokens:
        cmd += ["--n-predict", str(a.max_new_tokens)]
    if a.do_sample:
        cmd += ["--temp", str(a.temperature), "--top-p", str(a.top_p), "--top-k", str(a.top_k or 0), "--min-p", str(a.min_p or 0.0)]
    else:
        cmd += ["--temp", "0", "--top-k", "1", "--top-p", "1.0", "--min-p", "0.0"]
    cmd += ["--repeat-penalty", str(a.repetition_penalty)]
    out.command = cmd
    out.request = {**_stream(plan), "cache_prompt": settings.prefix_cache, **({"stop": list(a.stop)} if a.stop else {})}
    for reason in refusals(plan):
        name = reason.split("=", 1)[0]
        reasons[name] = reason.split(": ", 1)[-1]
    if "model.weight_bits" in reasons:  # a transformers backend: none of its fields reaches the file
        reasons.update({f"model.{f}": reasons["model.weight_bits"] for f in ("quant_backend", "quant_method", "quant_skip")
                        if getattr(plan.model, f)})
    if plan.model.kv_cache == "static":
        reasons["model.kv_cache"] = "llama.cpp preallocates its KV cache at load (--ctx-size) anyway; the static cache's measured effect does not transfer"
    if plan.hardware.threads == "auto":
        reasons["hardware.threads"] = "'auto' (physical cores) is resolved on the target: pass --threads with its physical cores"
    return reasons


def _requantized_model(plan: Plan, model: str) -> tuple[str, str | None]:
    """(the re-quantized GGUF llama-server loads, or ``model`` with why it could not be made here).

    The file is the one the llama_cpp runtime measured (cached; made now if it is not)."""
    from .models import resolve
    from .runtimes.llama_cpp.requantize import DTYPE_TARGETS, model_file

    try:
        source = resolve(model)
    except ModelSourceError as e:
        source, problem = None, str(e)
    else:
        problem = None if source.kind in ("gguf", "embedded") else f"{model!r} is not a GGUF file"
    if source is None or problem:
        gguf = plan.model.quant_backend == "gguf"
        target = plan.model.quant_method if gguf else DTYPE_TARGETS[plan.hardware.dtype]
        return model, (f"{problem}; convert the GGUF on the target: python -m fractal_opt.runtimes.llama_cpp.requantize MODEL.gguf "
                       f"--type {target}" + ("" if not gguf or "lm_head" in plan.model.quant_skip else " --requantize-head"))
    return str(model_file(plan, source.path, progress=lambda _: None)), None


def _stream(plan: Plan) -> dict[str, Any]:
    """``stream: false`` when the plan measured unstreamed answers (clients stream by choice)."""
    return {} if plan.scheduling.streaming else {"stream": False}


def _openai_request(plan: Plan) -> dict[str, Any]:
    """The OpenAI request fields that give the plan's decoding on a server that reads them."""
    a = plan.application
    body: dict[str, Any] = _stream(plan)
    if a.max_new_tokens:
        body["max_tokens"] = a.max_new_tokens
    body["temperature"] = a.temperature if a.do_sample else 0.0
    if a.do_sample:
        body["top_p"] = a.top_p
    if a.stop:
        body["stop"] = list(a.stop)
    return body
