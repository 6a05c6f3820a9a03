"""The pre-flight sizes the KV cache the plan will really allocate: static caches at context_cap,
paged caches at num_blocks x page_size, quantized and offloaded caches at what they keep."""

from __future__ import annotations

from fractal_opt.measure.preflight import kv_allocation, preflight
from fractal_opt.measure.roofline import ModelShape
from fractal_opt.tower.plan import Plan

# Llama-2-7B: 32 layers x 32 KV heads x 128 x 2 (K, V) x 2 bytes = 524,288 bytes of fp16 KV per token.
LLAMA2_7B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, intermediate=11008, vocab=32000)
KV_PER_TOKEN = 524_288
GPU_80GB = 80 * 10**9
BASE = Plan(source="x").replace_section("hardware", dtype="float16")


def _batched(plan: Plan, size: int) -> Plan:
    return plan.replace_section("scheduling", batching="static", batch_size=size)


def test_a_400_gb_static_cache_is_refused_with_its_numbers():
    """A static cache is allocated at context_cap for every sequence of the batch, whatever the
    requests use: 100,000 tokens x batch 8 = 419 GB of KV is refused, although the requests'
    own 1,024 tokens would fit (the old estimate)."""
    plan = _batched(BASE, 8).replace_section("model", kv_cache="static", context_cap=100_000)
    reason, numbers = preflight(plan, LLAMA2_7B, context=1024, n_requests=8, capacity_bytes=GPU_80GB)
    assert numbers["kv_tokens"] == 800_000 and numbers["kv_bytes"] == 800_000 * KV_PER_TOKEN
    assert reason == ("pre-flight: weights 13.477 GB + KV cache 419.430 GB (static cache: context_cap 100,000 tokens x batch 8) "
                      "= 432.907 GB exceed the device's 80.000 GB")
    dynamic = _batched(BASE, 8).replace_section("model", context_cap=100_000)  # grows only to the requests' tokens
    assert preflight(dynamic, LLAMA2_7B, context=1024, n_requests=8, capacity_bytes=GPU_80GB)[0] is None


def test_a_compiled_decode_step_allocates_a_static_cache():
    """torch.compile runs decode on a static cache: sized like one even when the plan's cache is dynamic."""
    plan = _batched(BASE, 4).replace_section("hardware", compile="reduce-overhead").replace_section("model", context_cap=8192)
    tokens, sizing = kv_allocation(plan, context=512, batch=4)
    assert tokens == 8192 * 4 and "compiled decode step" in sizing


def test_a_paged_cache_holds_num_blocks_x_page_size():
    """Continuous batching with num_blocks allocates every block up front, however few the requests."""
    plan = BASE.replace_section("scheduling", batching="continuous", cb_num_blocks=4096, cb_page_size=256)
    reason, numbers = preflight(plan, LLAMA2_7B, context=600, n_requests=2, capacity_bytes=GPU_80GB)
    assert numbers["kv_tokens"] == 4096 * 256 and numbers["kv_bytes"] == 4096 * 256 * KV_PER_TOKEN
    assert reason is not None and "paged cache: 4,096 blocks x 256 tokens" in reason and "549.756 GB" in reason
    unsized = BASE.replace_section("scheduling", batching="continuous", max_concurrency=2)
    assert preflight(unsized, LLAMA2_7B, context=600, n_requests=2, capacity_bytes=GPU_80GB)[1]["kv_tokens"] == 1200


def test_quantized_and_offloaded_caches_count_what_they_keep_on_the_device():
    """A 4-bit cache holds a quarter of fp16 plus its scales; an offloaded one two layers of 32; off holds none."""
    plain = preflight(BASE, LLAMA2_7B, context=4096, n_requests=1, capacity_bytes=GPU_80GB)[1]["kv_bytes"]
    quant = preflight(BASE.replace_section("model", kv_cache="quantized", kv_bits=4), LLAMA2_7B, context=4096, n_requests=1, capacity_bytes=GPU_80GB)[1]
    assert quant["kv_bytes"] == round(4096 * 2 * 32 * 32 * 128 * (0.5 + 2 * 2 / 64))  # payload + a 16-bit scale and zero point per 64 values
    assert quant["kv_bytes"] < plain / 3
    off = preflight(BASE.replace_section("model", kv_cache="offloaded"), LLAMA2_7B, context=4096, n_requests=1, capacity_bytes=GPU_80GB)[1]
    assert off["kv_bytes"] == plain * 2 // 32
    assert preflight(BASE.replace_section("model", kv_cache="off"), LLAMA2_7B, context=4096, n_requests=1, capacity_bytes=GPU_80GB)[1]["kv_bytes"] == 0
