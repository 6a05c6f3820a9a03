"""suggest: the bottleneck labels pick the passes, what cannot run here is left out, the recipe loads."""

from __future__ import annotations

import pytest

from fractal_opt.advice.suggest import parse_target_arg, suggest
from fractal_opt.core.errors import RecipeError
from fractal_opt.language.recipe import load_recipe
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.testing import LLAMA_SHAPE, FakeEngine, cpu_machine, fake_model_folder

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
LLAMA = LLAMA_SHAPE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return fake_model_folder(tmp_path_factory.mktemp("suggest") / "model", LLAMA)


def _suggest(model_dir, *, machine=None, **fake):
    from fractal_opt.workloads.workload import Workload

    return suggest(str(model_dir), workload=Workload(suite="default", limit=3, max_new_tokens=8), machine=machine or cpu_machine(),
                   build=FakeEngine.factory(**fake), refuse=FakeEngine.refuse, limits=LIMITS, sample_load=False)


def test_overhead_bound_decode(model_dir):
    """64 MB read per token at 50 tokens/s is 3.2 GB/s of a 10 GB/s ceiling: overhead-bound."""
    advice = _suggest(model_dir, per_token_ms=20)
    assert advice.labels["decode"] == "overhead", advice.roofline
    names = [s.p.name for s in advice.suggestions]
    assert "threads" in names
    assert "quantize" not in names and "dtype" not in names  # fewer bytes do not help where the bytes do not decide
    assert any("compile" in n for n in advice.notes)  # on a CPU compile is named, with its start-up cost, not suggested
    assert names.index("batching") < names.index("concurrency")  # tower order; the ramp is checked after batching
    assert not advice.left_out, advice.left_out
    assert all(s.why for s in advice.suggestions)


def test_bandwidth_bound_decode_with_bf16_units(model_dir):
    """At 100 tokens/s the fake reads 6.7 GB/s of a 10 GB/s ceiling: bandwidth-bound; with bf16 units, bfloat16 is suggested."""
    advice = _suggest(model_dir, machine=cpu_machine(cpu_flags=frozenset({"amx_bf16"})), per_token_ms=10)
    assert advice.labels["decode"] == "bandwidth"
    assert [s.p.name for s in advice.suggestions][:2] == ["dtype", "quantize"]
    assert "bytes" in advice.suggestions[0].why


def test_long_answers_get_a_cap(model_dir):
    """Every fake answer runs to the cap: a tighter max_new_tokens is suggested, with the share in its why."""
    advice = _suggest(model_dir, per_token_ms=20)
    cap = next(s for s in advice.suggestions if s.p.name == "max_new_tokens")
    assert cap.p.params()["limit"] == 6 and "100% of answers" in cap.why


def test_a_pass_this_machine_cannot_run_is_left_out_with_the_reason(model_dir, tmp_path):
    """Without a quantization backend, quantize is not suggested: it is listed as left out, with the reason, in the YAML too."""
    bare = cpu_machine(packages={"torch": "2.13.0", "transformers": "5.0"})  # no quantization backend installed
    advice = _suggest(model_dir, machine=bare, per_token_ms=10)  # bandwidth-bound: int8 weights would be suggested
    assert "quantize" not in [s.p.name for s in advice.suggestions]
    ((_, why),) = [x for x in advice.left_out if x[0].startswith("model/quantize")]
    assert why
    text = advice.to_yaml()
    assert "# Left out: this machine cannot run them" in text and "model/quantize" in text


def test_the_written_recipe_loads(model_dir, tmp_path):
    """The suggested recipe file loads back with the suggested passes, the targets and a comment per pass."""
    advice = _suggest(model_dir, per_token_ms=20)
    advice.targets = parse_target_arg("decode_tokens_per_s=30,ttft_ms_p90=800")
    path = advice.write(tmp_path / "suggested.yaml")
    recipe = load_recipe(path, check_model=False)
    assert [p.name for p in recipe.passes] == [s.p.name for s in advice.suggestions]
    assert recipe.targets.to_dict() == {"decode_tokens_per_s": 30.0, "ttft_ms_p90": 800.0}
    text = path.read_text(encoding="utf-8")
    assert "# Decode: overhead" in text and text.count("    # ") >= len(advice.suggestions)


def test_bad_target_argument():
    """A misspelt --target metric names the closest; a target without '=number' says the expected form."""
    with pytest.raises(RecipeError, match="Did you mean 'ttft_ms_p90'"):
        parse_target_arg("ttft_p90=800")
    with pytest.raises(RecipeError, match="not metric=number"):
        parse_target_arg("decode_tokens_per_s")


def test_a_gguf_model_on_an_avx512_cpu_gets_the_native_llama_cpp_build_too():
    """The xllamacpp wheel's kernels are AVX2 only: on a CPU with AVX-512 the llama.cpp runtime is
    suggested as the GGUF's kernels, then on BF16 weights, then as the build for this CPU, with the make target in its why."""
    from fractal_opt.advice.suggest import _candidates

    labels = {"decode": "overhead", "prefill": "compute"}
    avx512 = cpu_machine(cpu_flags=frozenset({"avx512f", "avx512_bf16"}))
    from fractal_opt.weights.models import ModelSource

    gguf = ModelSource("m.gguf", "gguf", None)
    found = [(s.p.name, s.written) for s in _candidates({}, {}, labels, avx512, "cpu", gguf)]
    assert found[:3] == [("runtime", {"backend": "llama_cpp"}), ("runtime", {"backend": "llama_cpp", "dtype": "bfloat16"}),
                         ("runtime", {"backend": "llama_cpp", "path": "native"})]
    why = _candidates({}, {}, labels, avx512, "cpu", gguf)[2].why
    assert "make setup-llama-native" in why and "AVX512_BF16" in why
    avx2 = [(s.p.name, s.written) for s in _candidates({}, {}, labels, cpu_machine(cpu_flags=frozenset({"avx2"})), "cpu", gguf)]
    assert ("runtime", {"backend": "llama_cpp", "path": "native"}) not in avx2


def test_a_model_folder_gets_llama_cpp_and_its_weight_ladder(tiny_dir, monkeypatch):
    """A folder the converter knows is suggested llama.cpp (its own weights, then BF16) and the
    ladder's two widest types below its float32, 8 bits first; one it does not know gets neither."""
    from fractal_opt.advice.suggest import _candidates
    from fractal_opt.weights import convert
    from fractal_opt.weights.models import resolve

    labels = {"decode": "bandwidth", "prefill": "compute"}
    monkeypatch.setattr(convert, "conversion_problem", lambda folder: None)
    found = [(s.p.name, s.written) for s in _candidates({}, {}, labels, cpu_machine(), "cpu", resolve(str(tiny_dir)))]
    assert found[:2] == [("runtime", {"backend": "llama_cpp"}), ("runtime", {"backend": "llama_cpp", "dtype": "bfloat16"})]
    ladder = [w for name, w in found if name == "quantize"]
    assert ladder == [{"backend": "gguf", "bits": 8, "method": "q8_0"}, {"backend": "gguf", "bits": 6, "method": "q6_k"}]
    monkeypatch.setattr(convert, "conversion_problem", lambda folder: "architecture 'X' is not one llama.cpp's converter knows")
    found = [(s.p.name, s.written) for s in _candidates({}, {}, labels, cpu_machine(), "cpu", resolve(str(tiny_dir)))]
    assert not any(name == "runtime" for name, _ in found) and ("quantize", {"bits": 8, "skip": ["lm_head"]}) in found
