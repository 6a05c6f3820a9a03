"""llama.cpp's batch sizes (hardware.n_batch / n_ubatch, the llama_batch pass): mapped onto
CommonParams, bad pairs refused before any load, refused by the runtimes that cannot honour them."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import ModelSourceError, RecipeError
from fractal_opt.export import export
from fractal_opt.language.recipe import load_recipe
from fractal_opt.layers.hardware import LlamaBatch
from fractal_opt.runtimes import refuse
from fractal_opt.runtimes.llama_cpp.settings import N_BATCH_DEFAULT, N_UBATCH_DEFAULT, common_params, describe, refusals, server_settings
from fractal_opt.runtimes.vllm import engine_args
from fractal_opt.tower.plan import HardwarePlan, ModelPlan, Plan

MODEL = "smollm2-135m-instruct"


def _llama(n_batch: int | None = None, n_ubatch: int | None = None, **model: object) -> Plan:
    # One thread: the test machine is shared (as in test_llama_cpp.py).
    return Plan(source=MODEL, hardware=HardwarePlan(runtime="llama_cpp", threads=1, n_batch=n_batch, n_ubatch=n_ubatch), model=ModelPlan(**model))  # type: ignore[arg-type]


def test_the_pass_sets_both_fields_and_null_keeps_llama_cpps_default():
    """llama_batch writes n_batch / n_ubatch into the hardware section; a null parameter leaves llama.cpp's default."""
    plan = LlamaBatch.from_params({"n_batch": 512, "n_ubatch": 256}).apply(Plan(source=MODEL))
    assert (plan.hardware.n_batch, plan.hardware.n_ubatch) == (512, 256)
    assert LlamaBatch.from_params({"n_batch": 512}).apply(plan).hardware.n_ubatch is None


def test_plan_maps_onto_common_params():
    """n_batch=256 / n_ubatch=128 reach xllamacpp's CommonParams; an unset plan keeps CommonParams' own defaults."""
    xlc = pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (pip install xllamacpp)")
    p = common_params(server_settings(_llama(256, 128), "m.gguf"))
    assert (p.n_batch, p.n_ubatch) == (256, 128)
    p = common_params(server_settings(_llama(), "m.gguf"))
    fresh = xlc.CommonParams()
    assert (p.n_batch, p.n_ubatch) == (fresh.n_batch, fresh.n_ubatch) == (N_BATCH_DEFAULT, N_UBATCH_DEFAULT)


def test_batch_sizes_are_part_of_the_load_key():
    """Two plans differing only in n_ubatch load two servers (ServerSettings differ), and the trace shows the sizes."""
    a, b = server_settings(_llama(256, 128), "m.gguf"), server_settings(_llama(256, 64), "m.gguf")
    assert a != b and (a.n_batch, a.n_ubatch) == (256, 128)
    assert describe(a)["n_ubatch"] == 128


@pytest.mark.parametrize(
    ("params", "needles"),
    [
        ({"n_batch": 256, "n_ubatch": 512}, ["'n_ubatch'", "512", "n_batch=256", "n_ubatch <= n_batch"]),
        ({"n_ubatch": 4096}, ["'n_ubatch'", "4096", f"default n_batch of {N_BATCH_DEFAULT}"]),
        ({"n_batch": 0}, ["'n_batch'", "got 0"]),
    ],
)
def test_a_recipe_with_a_bad_pair_is_refused_naming_the_field(params, needles):
    """A recipe whose llama_batch asks n_ubatch > n_batch (given or llama.cpp's default), or a zero, fails to load, naming the field and values."""
    with pytest.raises(RecipeError) as info:
        load_recipe({"model": "tiny", "passes": {"hardware": [{"llama_batch": params}]}}, check_model=False)
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_a_good_pair_loads_from_yaml():
    """passes: hardware: - llama_batch: {n_batch: 512, n_ubatch: 256} loads as the pass with those values."""
    recipe = load_recipe({"model": "tiny", "passes": {"hardware": [{"llama_batch": {"n_batch": 512, "n_ubatch": 256}}]}}, check_model=False)
    assert [p.params() for p in recipe.passes] == [{"n_batch": 512, "n_ubatch": 256}]


def test_llama_cpp_refuses_a_plan_it_would_silently_change():
    """A plan built by hand with n_ubatch > n_batch, or a batch larger than the KV cache (llama.cpp lowers both), is refused by field."""
    assert refusals(_llama(512, 256)) == []
    (reason,) = refusals(_llama(128, 256))
    assert reason.startswith("hardware.n_ubatch=256") and "n_batch=128" in reason
    (reason,) = refusals(_llama(1024, context_cap=256))  # one slot: n_ctx = 256 tokens
    assert reason.startswith("hardware.n_batch=1024") and "256 tokens" in reason


@pytest.mark.parametrize("field", ["n_batch", "n_ubatch"])
def test_transformers_and_vllm_refuse_a_non_default_value(field):
    """transformers and vLLM cannot honour llama.cpp's batch sizes: each refuses a set value, naming the field."""
    hardware = {field: 256}
    reason = refuse(Plan(source=MODEL).replace_section("hardware", **hardware))
    assert reason is not None and f"hardware.{field}=256" in reason
    reasons = engine_args.refusals(Plan(source=MODEL).replace_section("hardware", runtime="vllm", **hardware))
    assert any(r.startswith(f"hardware.{field}=256") for r in reasons), reasons
    if field == "n_batch":  # the closest vLLM knob is named, not silently mapped
        assert any("cb_max_batch_tokens" in r for r in reasons)
    assert refuse(Plan(source=MODEL)) is None and engine_args.refusals(Plan(source=MODEL).replace_section("hardware", runtime="vllm")) == []


def test_llama_server_export_passes_the_sizes():
    """fractal-opt export --to llama-server carries them as --batch-size / --ubatch-size, and leaves them out when unset."""
    command = export(_llama(512, 256), "llama-server").command
    assert command[command.index("--batch-size") + 1] == "512" and command[command.index("--ubatch-size") + 1] == "256"
    assert "--batch-size" not in export(_llama(), "llama-server").command


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_a_load_with_small_batches_serves_a_prompt_longer_than_n_batch():
    """The embedded GGUF loads with n_batch=256 / n_ubatch=128 and answers a ~300-token prompt (several decode calls)."""
    pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (pip install xllamacpp)")
    from fractal_opt.runtimes.llama_cpp import LlamaCppEngine
    from fractal_opt.weights.models import resolve

    try:
        resolve(MODEL)
    except ModelSourceError as e:
        pytest.skip(f"embedded model not installed: {e}")
    engine = LlamaCppEngine.build(_llama(256, 128), progress=lambda _: None, max_new_tokens=4)
    assert (engine.settings.n_batch, engine.settings.n_ubatch) == (256, 128)
    prompt = "Tell me about the river. " + "The river runs through the old town past the mill and the bridge. " * 20
    assert len(engine.encode(prompt)) > 256
    assert engine.generate(prompt, max_new_tokens=4)
