"""Hardware layer: device / device_map, matmul precision and compile — checks, plans and builds on the tiny model."""

from __future__ import annotations

import os

import pytest
from conftest import PadTokenizer, quiet

from fractal_opt.core.errors import RecipeError
from fractal_opt.core.machine import resolve_device
from fractal_opt.layers.hardware import Compile, Device, MatmulPrecision, Prepack
from fractal_opt.layers.model import ContextCap, KVCache
from fractal_opt.runtimes import Engine
from fractal_opt.runtimes.transformers.generate_kwargs import generate_kwargs
from fractal_opt.runtimes.transformers.torch_knobs import runtime
from fractal_opt.testing import cpu_machine
from fractal_opt.tower.plan import HardwarePlan, ModelPlan, Plan

PLAN = Plan(source="tiny")
CUDA = cpu_machine(cuda_devices=("NVIDIA H100",), cuda_memory_bytes=(80 * 2**30,), cuda_bf16=True)
SLOW = pytest.mark.skipif(not os.environ.get("FRACTAL_OPT_SLOW"), reason="torch.compile warm-up takes ~75 s on 2 shared cores; set FRACTAL_OPT_SLOW=1")




# --------------------------------------------------------------------------- device


def test_device_cuda_refused_without_gpu(machine):
    """device: cuda is refused on a machine without a GPU, with a reason naming CUDA."""
    reason = Device(device="cuda").check(PLAN, machine)
    assert reason is not None and "CUDA" in reason and "GPU-only" in reason
    assert Device(device="cuda").unavailable(machine) is not None


def test_device_cuda_index_beyond_the_gpus_refused():
    """device: cuda:2 on a one-GPU machine is refused, naming how many devices exist."""
    reason = Device(device="cuda:2").check(PLAN, CUDA)
    assert reason is not None and "1 CUDA device" in reason
    assert Device(device="cuda:0").check(PLAN, CUDA) is None


def test_device_auto_resolves_per_machine(machine):
    """auto means cuda where there is a GPU and cpu otherwise; the plan keeps 'auto' so a recipe travels."""
    assert resolve_device("auto", machine) == "cpu"
    assert resolve_device("auto", CUDA) == "cuda"
    assert Device(device="auto").apply(PLAN).hardware.device == "auto"


def test_device_already_in_plan_refused(machine):
    """device asking for the plan's current placement is refused, also when 'auto' resolves to it."""
    assert "already" in Device(device="cpu").check(PLAN, machine)
    assert "already" in Device(device="auto").check(PLAN, machine)
    assert Device(device="auto").check(PLAN, CUDA) is None


def test_device_map_needs_accelerate():
    """device_map on a machine without accelerate is refused, naming the package."""
    bare = cpu_machine(cuda_devices=("gpu",), cuda_memory_bytes=(2**34,), packages={"torch": "2.13"})
    reason = Device(device="cuda", device_map="auto").check(PLAN, bare)
    assert reason is not None and "accelerate" in reason


def test_device_map_on_cpu_only_needs_an_offload_target(machine):
    """device_map on a CPU-only machine without offload_folder is refused (it would change nothing)."""
    reason = Device(device="cpu", device_map="auto").check(PLAN, machine)
    assert reason is not None and "offload_folder" in reason
    assert Device(device="cpu", device_map="auto", offload_folder="/tmp/x").check(PLAN, machine) is None


def test_device_map_plan_fields_and_yaml():
    """device_map, max_memory (as sorted device=size strings) and offload_folder reach the plan; YAML keys may be GPU indices."""
    p = Device.from_params({"device": "cuda", "device_map": "balanced", "max_memory": {1: "20GiB", 0: "10GiB", "cpu": "64GiB"}})
    hw = p.apply(PLAN).hardware
    assert (hw.device, hw.device_map, hw.max_memory) == ("cuda", "balanced", ("0=10GiB", "1=20GiB", "cpu=64GiB"))
    assert p.apply(PLAN).weights_key() != PLAN.weights_key(), "placement changes the loaded weights"
    assert hash(p) == hash(Device.from_params(p.params())), "a pass must stay hashable (recipes detect duplicates with a set)"


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"device": "gpu"}, "'cuda:N'"),
        ({"device_map": "auto", "max_memory": {"cpu": "lots"}}, "'20GiB'"),
        ({"max_memory": {"cpu": "1GiB"}}, "device_map"),
        ({"device_map": "auto", "max_memory": {"tpu": "1GiB"}}, "GPU index"),
    ],
)
def test_device_bad_values_fail_before_loading(params, needle):
    """Malformed device, sizes, keys or max_memory without device_map fail at construction with the allowed forms."""
    with pytest.raises(RecipeError, match="device") as info:
        Device.from_params(params)
    assert needle in str(info.value)


def test_disk_offload_builds_and_matches_plain(lively_dir):
    """device_map auto with a tiny max_memory spills layers to disk; greedy output equals the plain build's, and the census shows the spill."""
    base = Plan(source=str(lively_dir))
    expected = Engine.build(base, progress=quiet).generate("Tell me about bridges.", max_new_tokens=6)
    plan = Device(device="cpu", device_map="auto", max_memory={"cpu": "3MB"}, offload_folder=str(lively_dir.parent / "offload")).apply(base)
    engine = Engine.build(plan, progress=quiet)
    assert "disk" in engine.census()["device_map"]
    assert engine.generate("Tell me about bridges.", max_new_tokens=6) == expected


# --------------------------------------------------------------------------- matmul precision


def test_matmul_precision_refused_on_cpu_without_bf16_units(machine):
    """high/medium precision is refused on a CPU without bf16 matrix units (nothing to gain), naming TF32 as a CUDA feature."""
    reason = MatmulPrecision(precision="high").check(PLAN, machine)
    assert reason is not None and "AVX512-BF16" in reason and "CUDA" in reason
    amx = cpu_machine(cpu_flags=frozenset({"amx_bf16"}))
    assert MatmulPrecision(precision="medium").check(PLAN, amx) is None


def test_matmul_precision_on_cuda_needs_ampere():
    """TF32 is allowed on an Ampere-class GPU and refused on an older one."""
    plan = PLAN.replace_section("hardware", device="cuda")
    assert MatmulPrecision().check(plan, CUDA) is None
    old = cpu_machine(cuda_devices=("Tesla T4",), cuda_memory_bytes=(2**34,), cuda_bf16=False)
    assert "compute capability" in MatmulPrecision().check(plan, old)


def test_matmul_precision_only_for_float32(machine):
    """matmul_precision is refused on a bfloat16 plan (only float32 matmuls are affected)."""
    plan = PLAN.replace_section("hardware", dtype="bfloat16", device="cuda")
    assert "float32" in MatmulPrecision().check(plan, CUDA)


def test_runtime_sets_and_restores_matmul_precision():
    """The engine's runtime applies the plan's matmul precision and restores the previous one afterwards."""
    import torch

    before = torch.get_float32_matmul_precision()
    plan = PLAN.replace_section("hardware", matmul_precision="medium")
    with runtime(plan, cpu_machine()):
        assert torch.get_float32_matmul_precision() == "medium"
    assert torch.get_float32_matmul_precision() == before
    assert plan.numerics_key() != PLAN.numerics_key()


# --------------------------------------------------------------------------- compile


def test_compile_reduce_overhead_is_cuda_only(machine):
    """compile mode reduce-overhead (CUDA graphs) is refused on CPU and allowed on a CUDA plan."""
    assert "CUDA" in Compile(mode="reduce-overhead").check(PLAN, machine)
    assert Compile(mode="reduce-overhead").check(PLAN.replace_section("hardware", device="cuda"), CUDA) is None
    assert Compile(mode="default").check(PLAN, machine) is None


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        (ModelPlan(kv_cache="quantized", kv_bits=4, kv_backend="quanto"), "static KV cache"),
        (ModelPlan(weight_bits=8, quant_backend="bitsandbytes", quant_method="int8"), "bitsandbytes"),
    ],
)
def test_compile_refused_where_transformers_cannot_compile(machine, model, needle):
    """compile is refused on plans whose cache or quantizer transformers cannot compile, saying which."""
    assert needle in Compile().check(Plan(source="tiny", model=model), machine)


def test_compile_kwargs_use_a_static_cache_sized_by_the_cap():
    """A compiled plan generates with a static cache (even if the plan says dynamic), sized by the context cap, and a CPU-enabled CompileConfig."""
    plan = ContextCap(tokens=512).apply(Compile().apply(PLAN))
    kwargs = generate_kwargs(plan, PadTokenizer(), budget=8)
    assert kwargs["cache_implementation"] == "static" and kwargs["max_cache_len"] == 512
    assert kwargs["compile_config"].mode == "default" and kwargs["compile_config"]._compile_all_devices
    assert "compile_config" not in generate_kwargs(PLAN, PadTokenizer(), budget=8)


def test_kv_cache_refuses_uncompilable_cache_after_compile():
    """A quantized KV cache is refused on a plan that compiles the decode step (even with its package installed)."""
    plan = Compile().apply(PLAN)
    with_quanto = cpu_machine(packages={**cpu_machine().packages, "optimum-quanto": "0.2.7"})
    assert "compile" in KVCache(implementation="quantized").check(plan, with_quanto)


@pytest.mark.slow
@SLOW
def test_compiled_decode_matches_eager_and_records_compile_time(lively_dir, small_recipe):
    """A compile pass on the tiny model really compiles (the model holds a compiled call), keeps greedy outputs, and the step records compile_s.

    Whether compiling pays on the tiny model depends on the machine; judged on new tokens (which a
    compile cannot change), the step is measured and rolled back as "no change", a verdict known in advance."""
    from fractal_opt.pipeline.runner import Pipeline

    recipe = small_recipe(lively_dir, passes={"hardware": [{"compile": {"mode": "default"}}], "model": [{"context_cap": {"tokens": 2048}}]}, limit=1, repeats=1,
                          policy={"objective": "new_tokens"})
    result = Pipeline(recipe, progress=False, machine=cpu_machine()).run()
    step = result.trace.steps[0]
    assert step.status == "rolled_back" and "new_tokens paired estimate +0.0%" in step.reason, step.reason
    assert step.timings["compile_s"] > 0 and "compiling took" in step.reason
    assert step.value("agreement") == 1.0, "compiled greedy decoding changed the tokens"
    engine = Engine.build(Compile().apply(Plan(source=str(lively_dir))), progress=quiet)
    engine.generate("Hi", max_new_tokens=3)
    assert hasattr(engine.model, "_compiled_call"), "transformers did not compile the decode step"


def test_hardware_plan_defaults_are_plain_transformers():
    """A default plan runs where plain transformers would: one device, no map, highest precision, no compile."""
    hw = HardwarePlan()
    assert (hw.device_map, hw.max_memory, hw.offload_folder, hw.matmul_precision, hw.compile, hw.prepack) == (None, (), None, "highest", None, ())


# --------------------------------------------------------------------------- the dtype trade


@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        ({"objective": "ttft_ms"}, False),
        ({"objective": "decode_tokens_per_s"}, False),
        ({"objective": "decode_tokens_per_s", "guards": {"ttft_ms": None}}, True),
    ],
)
def test_bfloat16_trade_is_decided_by_the_recipe(policy, kept):
    """bfloat16's CPU trade (decode 19.4 -> 31.5 tok/s, 512-token TTFT 0.98 -> 5.71 s; cpu-passes.md): a TTFT objective drops it,
    a decode objective keeps it only when the recipe lifts the TTFT regression guard, and the reason names both numbers."""
    from fractal_opt.language.recipe import load_recipe
    from fractal_opt.tower.passes import Layer

    before = {"decode_tokens_per_s": 19.4, "ttft_ms": 980.0, "throughput_tokens_per_s": 18.0, "peak_memory_mb": 1010.0, "kl_mean": 0.0}
    after = {"decode_tokens_per_s": 31.5, "ttft_ms": 5710.0, "throughput_tokens_per_s": 18.5, "peak_memory_mb": 723.0, "kl_mean": 0.0011}
    changes = {m: after[m] / before[m] - 1 for m in before if m != "kl_mean"}
    bands = {m: 0.05 for m in changes}
    rec = load_recipe({"model": "tiny", "policy": policy}, check_model=False)
    verdict = rec.policy.judge(Layer.HARDWARE, before, after, changes, bands)
    assert verdict.kept is kept, verdict.reason
    # The reason names both numbers of the trade, whichever the objective is.
    assert "ttft_ms" in verdict.reason and "decode_tokens_per_s" in verdict.reason, verdict.reason


def test_threads_that_change_nothing_are_skipped_by_check():
    """A threads pass resolving to torch's current count is refused: measuring a no-op lets noise decide."""
    from fractal_opt.layers.hardware import Threads
    from fractal_opt.testing import cpu_machine
    from fractal_opt.tower.plan import Plan

    machine = cpu_machine(torch_threads=2, physical_cores=2)
    assert "already runs 2 intra-op threads" in Threads(count="auto").check(Plan(source="x"), machine)
    assert Threads(count=1).check(Plan(source="x"), machine) is None


def test_threads_on_another_runtime_are_measured_against_its_own_default():
    """On llama.cpp the plan's default thread count is llama.cpp's, not torch's: threads auto is tried, not skipped."""
    from fractal_opt.layers.hardware import Threads
    from fractal_opt.testing import cpu_machine
    from fractal_opt.tower.plan import Plan

    machine = cpu_machine(torch_threads=2, physical_cores=2)
    on_llama = Plan(source="x").replace_section("hardware", runtime="llama_cpp")
    assert Threads(count="auto").check(on_llama, machine) is None
    assert "already runs 2" in Threads(count=2).check(on_llama.replace_section("hardware", threads=2), machine)



def test_threads_on_llama_cpp_set_its_decode_and_batch_threads():
    """On llama.cpp the threads pass's count reaches n_threads and prefill's batch threads; without a count the machine's physical cores are passed, stated."""
    pytest.importorskip("xllamacpp")
    from fractal_opt.layers.hardware import Threads
    from fractal_opt.runtimes.llama_cpp.settings import common_params, server_settings
    from fractal_opt.tower.plan import Plan

    on_llama = Plan(source="x").replace_section("hardware", runtime="llama_cpp")
    p = common_params(server_settings(Threads(count=1).apply(on_llama), "m.gguf", physical_cores=2))
    assert (p.cpuparams.n_threads, p.cpuparams_batch.n_threads) == (1, 1)
    assert server_settings(on_llama, "m.gguf", physical_cores=3).threads == 3
    assert server_settings(Threads(count="auto").apply(on_llama), "m.gguf", physical_cores=3).threads == 3

# --------------------------------------------------------------------------- prepack


@pytest.mark.parametrize(
    "plan,needle",
    [
        (PLAN.replace_section("hardware", device="cuda"), "CPU inference"),
        (PLAN.replace_section("hardware", dtype="bfloat16"), "float32"),
        (PLAN.replace_section("hardware", compile="default"), "compiles the decode step"),
        (PLAN.replace_section("model", weight_bits=8, quant_backend="torchao", quant_method="weight_only"), "quantizes ['lm_head']"),
        (PLAN.replace_section("hardware", prepack=("lm_head",)), "already prepacks"),
    ],
)
def test_prepack_refused_where_it_cannot_apply(machine, plan, needle):
    """prepack: CPU float32 only, not under compile, not on a module the plan quantizes, not twice."""
    reason = Prepack().check(plan, machine)
    assert reason is not None and needle in reason


def test_prepack_plans_the_modules_and_compile_refuses_a_prepacked_plan(machine):
    """apply adds the modules to the hardware section (a new weights key); compile then refuses."""
    plan = Prepack().apply(PLAN)
    assert Prepack().check(PLAN, machine) is None and plan.hardware.prepack == ("lm_head",)
    assert plan.weights_key() != PLAN.weights_key()
    assert "prepacks ['lm_head']" in Compile().check(plan, machine)
    with pytest.raises(RecipeError, match="module names"):
        Prepack(modules=())


def test_prepacked_head_builds_and_keeps_greedy_tokens(lively_dir):
    """The built model's lm_head is oneDNN's MkldnnLinear, the census counts the packed copy, and greedy tokens do not change."""
    from torch.utils.mkldnn import MkldnnLinear

    from fractal_opt.workloads.workload import Workload

    base = Plan(source=str(lively_dir))
    plain, packed = Engine.build(base, progress=quiet), Engine.build(Prepack().apply(base), progress=quiet)
    assert isinstance(packed.model.lm_head, MkldnnLinear) and not isinstance(plain.model.lm_head, MkldnnLinear)
    assert packed.census()["bytes_by_type"]["mkldnn(float32)"] == plain.model.lm_head.weight.numel() * 4
    requests = Workload().requests()[:3]
    assert [g.token_ids for g in packed.serve(requests, max_new_tokens=8)] == [g.token_ids for g in plain.serve(requests, max_new_tokens=8)]


@pytest.mark.parametrize(
    "model,needle",
    [
        ({}, "no module 'lm_haed'"),
        ({"weight_bits": 8, "quant_backend": "torchao", "quant_method": "weight_only"}, "quantized modules cannot be prepacked"),
    ],
)
def test_prepack_build_fails_clearly_on_a_module_it_cannot_pack(tiny_dir, model, needle):
    """A missing module (with the closest name) or one quantized by then fails the build, saying which."""
    from fractal_opt.core.errors import EngineError

    prepack = ("lm_haed",) if not model else ("lm_head",)
    plan = Plan(source=str(tiny_dir)).replace_section("hardware", prepack=prepack).replace_section("model", **model)
    with pytest.raises(EngineError, match=needle):
        Engine.build(plan, progress=quiet)


def test_runtime_pass_sets_the_runtime_and_its_vllm_fields():
    """The runtime pass names the runtime; vLLM's location and parallel sizes apply to vllm only."""
    from fractal_opt.core.errors import RecipeError
    from fractal_opt.layers.hardware import Runtime

    plan = Runtime(backend="vllm", url="http://127.0.0.1:8000", tensor_parallel=2).apply(PLAN)
    assert (plan.hardware.runtime, plan.hardware.runtime_url, plan.hardware.tensor_parallel) == ("vllm", "http://127.0.0.1:8000", 2)
    with pytest.raises(RecipeError, match=r"applies to backends \['vllm'\] only"):
        Runtime(backend="llama_cpp", tensor_parallel=2)
    with pytest.raises(RecipeError, match="tensor_parallel must be >= 1"):
        Runtime(backend="vllm", tensor_parallel=0)


def test_transformers_refuses_the_fields_only_other_runtimes_read():
    """A plan asking transformers for llama.cpp's flash attention or a prefix cache is refused with the field named."""
    from fractal_opt.runtimes import refuse

    assert refuse(PLAN) is None
    reason = refuse(PLAN.replace_section("hardware", flash_attention="on").replace_section("scheduling", prefix_cache=True))
    assert "hardware.flash_attention='on'" in reason and "scheduling.prefix_cache=True" in reason
