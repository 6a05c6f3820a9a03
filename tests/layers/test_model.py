"""Model layer: quantization families, mixed precision, sensitivity, KV caches, context cap, calibration."""

from __future__ import annotations

import pytest
from conftest import PadTokenizer, quiet

from fractal_opt.core.errors import EngineError, RecipeError, RequestRejected
from fractal_opt.layers.model import ContextCap, KVCache, Quantize
from fractal_opt.pipeline.gate import skip_reason
from fractal_opt.runtimes import Engine
from fractal_opt.runtimes.transformers.generate_kwargs import generate_kwargs
from fractal_opt.testing import cpu_machine
from fractal_opt.tower.plan import Plan
from fractal_opt.tower.quant_select import check_skip, expand, skipped

PLAN = Plan(source="tiny")
WITH_QUANTO = cpu_machine(packages={**cpu_machine().packages, "optimum-quanto": "0.2.7", "hqq": "0.2.8"})
LINEARS = [f"model.layers.{i}.{part}" for i in range(4) for part in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj")] + ["lm_head"]




# --------------------------------------------------------------------------- skip syntax


@pytest.mark.parametrize(
    ("spec", "count"),
    [
        ("lm_head", 1),
        ("*.self_attn.*", 8),
        ("attention", 8),
        ("mlp", 4),
        ("first:1", 3),
        ("last:2", 6),
        ("block:3", 3),
        ("model.layers.1", 3),
        ("q_proj", 4),
    ],
)
def test_skip_specs_select_modules(spec, count):
    """Each skip form selects the documented modules: names, dotted parts, globs, aliases, first/last/block."""
    assert len(expand(LINEARS, (spec,), n_blocks=4)) == count


def test_skip_name_does_not_match_a_longer_name():
    """'model.layers.1' keeps block 1, not block 11."""
    assert not skipped("model.layers.11.mlp.up_proj", ("model.layers.1",), n_blocks=30)


@pytest.mark.parametrize("spec", ["first:0", "last:x", "block:-1", ""])
def test_malformed_skip_specs_fail_before_loading(spec):
    """Malformed block specs fail at construction, naming the spec and an example."""
    with pytest.raises(RecipeError, match="skip"):
        Quantize(skip=(spec,))
    with pytest.raises(RecipeError):
        check_skip([spec])


# --------------------------------------------------------------------------- quantize: options and checks


def test_method_not_offered_names_the_alternatives():
    """nf4 at 8 bits is refused at construction, listing bitsandbytes' 8-bit methods and where nf4 exists."""
    with pytest.raises(RecipeError, match="nf4") as info:
        Quantize(bits=8, method="nf4")
    assert "int8" in str(info.value) and "4-bit" in str(info.value)
    with pytest.raises(RecipeError, match="dynamic"):
        Quantize(bits=4, backend="torchao", method="dynamic")


def test_auto_backend_follows_the_method():
    """backend auto picks bitsandbytes for nf4/fp4/int8, torchao for dynamic and for weight_only."""
    assert Quantize(bits=4, method="nf4").apply(PLAN).model.quant_backend == "bitsandbytes"
    assert Quantize(method="dynamic").apply(PLAN).model.quant_backend == "torchao"
    cuda = PLAN.replace_section("hardware", device="cuda")
    assert Quantize(method="weight_only").apply(cuda).model.quant_backend == "torchao"


def test_quanto_needs_its_package(machine):
    """backend quanto is refused without optimum-quanto (naming the pip package) and allowed with it."""
    reason = Quantize(backend="quanto").check(PLAN, machine)
    assert reason is not None and "optimum-quanto" in reason and "pip install" in reason
    assert Quantize(backend="quanto").check(PLAN, WITH_QUANTO) is None


def test_group_size_only_where_the_backend_has_one(machine):
    """group_size is refused for backends with a fixed layout and recorded for torchao 4-bit."""
    assert "group_size" in Quantize(bits=8, group_size=64).check(PLAN, machine)
    assert "group_size" in Quantize(bits=4, method="nf4", group_size=64).check(PLAN, machine)
    assert Quantize(bits=4, group_size=64).apply(PLAN).model.quant_group_size == 64
    assert Quantize(bits=4).apply(PLAN).model.quant_group_size == 32


def test_sensitivity_needs_a_post_load_backend(machine):
    """sensitivity is refused with bitsandbytes (it quantizes while loading) and recorded as the KL target otherwise."""
    assert "sensitivity" in Quantize(backend="bitsandbytes", sensitivity=True).check(PLAN, machine)
    plan = Quantize(sensitivity=True, max_kl=0.02).apply(PLAN)
    assert plan.model.quant_sensitivity_max_kl == 0.02
    assert plan.weights_key() != Quantize().apply(PLAN).weights_key()


def test_quantize_refused_with_disk_offload(machine):
    """quantize is refused on a plan that offloads layers to disk (they hold no weights to quantize)."""
    plan = PLAN.replace_section("hardware", device_map="auto", offload_folder="/tmp/offload")
    assert "offload" in Quantize().check(plan, machine)


# --------------------------------------------------------------------------- quantize: builds


FAMILIES = [
    ({"bits": 8}, "torchao", "weight_only"),
    ({"bits": 8, "method": "dynamic"}, "torchao", "dynamic"),
    ({"bits": 4, "group_size": 32}, "torchao", "weight_only"),
    ({"bits": 8, "backend": "bitsandbytes"}, "bitsandbytes", "int8"),
    ({"bits": 4, "method": "nf4"}, "bitsandbytes", "nf4"),
    ({"bits": 4, "method": "fp4"}, "bitsandbytes", "fp4"),
    ({"bits": 8, "backend": "quanto"}, "quanto", "weight_only"),
    ({"bits": 4, "backend": "quanto"}, "quanto", "weight_only"),
]


@pytest.mark.parametrize(("params", "backend", "method"), FAMILIES, ids=[f"{b}-{m}-{p['bits']}" for p, b, m in FAMILIES])
def test_every_family_quantizes_and_the_census_says_so(tiny_dir, params, backend, method):
    """Each backend/method/bits quantizes every linear layer but the skipped lm_head, shrinks the weights, generates, and the census names what it did."""
    package = {"torchao": "torchao", "bitsandbytes": "bitsandbytes", "quanto": "optimum.quanto"}[backend]
    pytest.importorskip(package)
    plan = Quantize(**params).apply(Plan(source=str(tiny_dir)))
    assert (plan.model.quant_backend, plan.model.quant_method) == (backend, method)
    engine = Engine.build(plan, progress=quiet)
    census = engine.census()
    assert census["quantized_linear_layers"] == census["linear_layers"] - 1
    assert census["quantization"]["skipped_modules"] == ["lm_head"]
    assert (census["quantization"]["backend"], census["quantization"]["method"]) == (backend, method)
    plain = Engine.build(Plan(source=str(tiny_dir)), progress=quiet).census()
    assert census["weight_bytes"] < plain["weight_bytes"]
    assert isinstance(engine.generate("Hi", max_new_tokens=2), str)


@pytest.mark.parametrize("backend", ["torchao", "bitsandbytes", "quanto"])
def test_quantization_that_applies_to_nothing_fails_the_build(tiny_dir, backend):
    """Skipping every module leaves nothing quantized: the build raises EngineError saying it did not apply, for every backend."""
    pytest.importorskip({"torchao": "torchao", "bitsandbytes": "bitsandbytes", "quanto": "optimum.quanto"}[backend])
    plan = Quantize(backend=backend, skip=("*",)).apply(Plan(source=str(tiny_dir)))
    with pytest.raises(EngineError, match="did not apply"):
        Engine.build(plan, progress=quiet)


@pytest.mark.parametrize("backend", ["torchao", "bitsandbytes"])
def test_mixed_precision_keeps_attention_and_first_block(tiny_dir, backend):
    """skip ['lm_head', '*.self_attn.*', 'first:1'] keeps those modules in float32 and quantizes the rest (load-time and post-load backends alike)."""
    import torch

    plan = Quantize(backend=backend, skip=("lm_head", "*.self_attn.*", "first:1")).apply(Plan(source=str(tiny_dir)))
    engine = Engine.build(plan, progress=quiet)
    layers = engine.model.model.layers
    assert type(layers[0].mlp.up_proj.weight.data) is torch.Tensor and layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert layers[2].self_attn.q_proj.weight.dtype == torch.float32
    assert engine.census()["quantized_linear_layers"] == 3 * 3, "MLP projections of blocks 1-3 only"


def test_sensitivity_keeps_the_most_sensitive_blocks(tiny_dir):
    """With a tight KL target, sensitivity measures every block, keeps the highest-KL ones in float, and records it in the census."""
    import torch

    plan = Quantize(bits=4, sensitivity=True, max_kl=1e-3).apply(Plan(source=str(tiny_dir)))
    engine = Engine.build(plan, progress=quiet)
    report = engine.census()["quantization"]["sensitivity"]
    assert sorted(report["block_kl"]) == [0, 1, 2, 3]
    kept = report["kept_blocks"]
    assert 0 < len(kept) < 4 and report["kl"] <= 1e-3
    worst = sorted(report["block_kl"], key=lambda i: -report["block_kl"][i])[: len(kept)]
    assert sorted(worst) == kept, "kept blocks are not the most sensitive ones"
    for i in kept:
        assert type(engine.model.model.layers[i].mlp.up_proj.weight.data) is torch.Tensor
    loose = Engine.build(Quantize(bits=4, sensitivity=True, max_kl=10.0).apply(Plan(source=str(tiny_dir))), progress=quiet)
    assert loose.census()["quantization"]["sensitivity"]["kept_blocks"] == []


def test_sensitivity_that_can_keep_nothing_quantized_fails_clearly(tiny_dir):
    """A KL target no single block meets fails the build, naming the least sensitive block's KL."""
    plan = Quantize(bits=4, sensitivity=True, max_kl=1e-12).apply(Plan(source=str(tiny_dir)))
    with pytest.raises(EngineError, match="least sensitive"):
        Engine.build(plan, progress=quiet)


# --------------------------------------------------------------------------- KV cache


def test_quanto_kv_cache_has_no_8_bits():
    """kv_cache quantized with quanto at 8 bits fails at construction, pointing to hqq."""
    with pytest.raises(RecipeError, match="hqq"):
        KVCache(implementation="quantized", backend="quanto", bits=8)


def test_quantized_kv_cache_needs_its_package(machine):
    """A quantized KV cache is refused without its backend package and allowed with it."""
    assert "optimum-quanto" in skip_reason(KVCache(implementation="quantized"), PLAN, machine)
    assert skip_reason(KVCache(implementation="quantized", backend="hqq", bits=8), PLAN, WITH_QUANTO) is None


def test_offloaded_kv_cache_is_gpu_only(machine):
    """The offloaded KV cache is refused on a CPU plan (it moves GPU memory to CPU RAM)."""
    assert "GPU-only" in KVCache(implementation="offloaded").check(PLAN, machine)


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        (KVCache(implementation="quantized", bits=2, backend="quanto"), {"cache_implementation": "quantized", "cache_config": {"backend": "quanto", "nbits": 2}}),
        (KVCache(implementation="offloaded"), {"cache_implementation": "offloaded"}),
        (KVCache(implementation="off"), {"use_cache": False}),
    ],
)
def test_kv_cache_generate_arguments(kv, expected):
    """Each KV cache maps to transformers' generate arguments."""
    kwargs = generate_kwargs(kv.apply(PLAN), PadTokenizer(), budget=4)
    assert {k: kwargs[k] for k in expected} == expected


def test_kv_census_arithmetic(tiny_dir):
    """The census reports KV bytes per 1k tokens from the config (2 x 4 layers x 2 kv heads x 64 dims x 4 bytes) and what a 4-bit cache saves."""
    plain = Engine.build(Plan(source=str(tiny_dir)), progress=quiet).census()
    assert plain["kv_bytes_per_1k_tokens"] == 2 * 4 * 2 * 64 * 4 * 1000 and plain["kv_bytes_saved_per_1k_tokens"] == 0
    plan = KVCache(implementation="quantized", bits=4).apply(Plan(source=str(tiny_dir)))
    q = Engine.build(plan, progress=quiet).census()
    # 4 bits = 0.5 byte per value, plus a float32 scale and zero-point per 64 values (0.125 byte)
    assert q["kv_bytes_per_1k_tokens"] == 2 * 4 * 2 * 64 * 1000 * 5 // 8
    assert q["kv_bytes_saved_per_1k_tokens"] == plain["kv_bytes_per_1k_tokens"] - q["kv_bytes_per_1k_tokens"]


@pytest.mark.parametrize(("backend", "bits"), [("quanto", 4), ("hqq", 8)])
def test_quantized_kv_cache_generates(lively_dir, backend, bits):
    """A quantized KV cache (quanto 4-bit, hqq 8-bit) serves requests end to end and returns the full budget."""
    pytest.importorskip({"quanto": "optimum.quanto", "hqq": "hqq"}[backend])
    plan = KVCache(implementation="quantized", backend=backend, bits=bits).apply(Plan(source=str(lively_dir)))
    engine = Engine.build(plan, progress=quiet)
    from fractal_opt.workloads.workload import Workload

    (gen,) = engine.serve(Workload().requests()[:1], max_new_tokens=5)
    assert gen.new_tokens == 5


# --------------------------------------------------------------------------- context cap


def test_context_cap_rejects_requests_over_it(lively_dir):
    """A request whose prompt plus budget exceeds the cap raises RequestRejected naming both numbers; one under it is served."""
    engine = Engine.build(ContextCap(tokens=40).apply(Plan(source=str(lively_dir))), progress=quiet)
    prompt = "Tell me about bridges and rivers and the towns that grew around them, in detail."
    with pytest.raises(RequestRejected, match="context cap of 40") as info:
        engine.generate(prompt, max_new_tokens=16)
    assert "prompt_budget" in str(info.value)
    with pytest.raises(RequestRejected):
        list(engine.stream(prompt, max_new_tokens=16))
    assert isinstance(engine.generate("Hi", max_new_tokens=4), str)


def test_context_cap_sizes_the_static_cache(tiny_dir):
    """With a static cache, the cap becomes the cache length, and the census reports the bytes reserved at the cap."""
    plan = ContextCap(tokens=256).apply(KVCache(implementation="static").apply(Plan(source=str(tiny_dir))))
    assert generate_kwargs(plan, PadTokenizer(), budget=8)["max_cache_len"] == 256
    census = Engine.build(plan, progress=quiet).census()
    assert census["kv_bytes_at_cap"] == census["kv_bytes_per_1k_tokens"] * 256 // 1000


def test_context_cap_too_small_fails_before_loading():
    """context_cap below 16 tokens fails at construction, naming the parameter."""
    with pytest.raises(RecipeError, match="tokens"):
        ContextCap(tokens=8)


# --------------------------------------------------------------------------- calibration


def test_calibration_takes_workload_prompts_then_the_reference_tail(tiny_dir):
    """Calibration ids are the workload prompts followed by the end of the shipped reference text, cut to the requested length."""
    from transformers import AutoTokenizer

    from fractal_opt.quality.calibration import calibration_ids
    from fractal_opt.quality.reference import reference_text

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ref = tok(reference_text(), add_special_tokens=False)["input_ids"]
    assert calibration_ids(tok, tokens=64).tolist() == ref[-64:]
    prompt = tok("Hello there", add_special_tokens=False)["input_ids"]
    ids = calibration_ids(tok, tokens=64, prompts=["Hello there"]).tolist()
    assert ids[: len(prompt)] == prompt and ids[len(prompt) :] == ref[-(64 - len(prompt)) :]
