"""Candidates generated from the runtime tables, the weight ladder, the machine and the load, ordered by the roofline."""

from __future__ import annotations

import pytest

from fractal_opt.runtimes import RUNTIMES
from fractal_opt.runtimes.vllm import process as vllm_process
from fractal_opt.search.candidates import generate, plan_weight_bits
from fractal_opt.testing import cpu_machine
from fractal_opt.tower.passes import Layer, SearchContext
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Workload

EMBEDDED = "smollm2-135m-instruct"  # its GGUF's header only: no model is loaded
BF16 = cpu_machine(cpu_flags=frozenset({"avx512f", "avx512_bf16"}), packages={**cpu_machine().packages, "xllamacpp": "0.2", "gguf": "0.17"})


def _context(plan, machine=BF16, workload=None):
    return SearchContext(plan=plan, machine=machine, workload=workload or Workload(), runtimes=RUNTIMES)


def _described(candidates):
    return [c.p.describe() for c in candidates]


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    """No vLLM environment, executable or server found, whatever this machine has set up."""
    monkeypatch.delenv(vllm_process.ENV_PATH, raising=False)
    monkeypatch.delenv(vllm_process.ENV_URL, raising=False)
    monkeypatch.setattr(vllm_process, "default_executable", lambda: tmp_path / "no-vllm" / "bin" / "vllm")


def test_the_runtimes_come_first_where_the_roofline_predicts_the_fewest_bytes(no_vllm):
    """From float32 transformers on the embedded Q4_1 GGUF: llama.cpp on the GGUF's own 5-bit
    weights is predicted 6.4x, the BF16 copies 2x; every candidate says why; vLLM, which is not
    found here, is not offered."""
    found = generate(Layer.HARDWARE, _context(Plan(source=EMBEDDED)))
    names = _described(found)
    # The same bytes a token, the build for this CPU first: its vector units, the wheel's AVX2 after it.
    assert names[:2] == ["runtime(backend=llama_cpp, path=native)", "runtime(backend=llama_cpp)"] and found[0].predicted == 6.4
    assert names.index("runtime(backend=llama_cpp, path=native, dtype=bfloat16)") < names.index("runtime(backend=llama_cpp, dtype=bfloat16)")
    assert {"runtime(backend=llama_cpp, dtype=bfloat16)", "dtype(dtype=bfloat16)"} <= set(names)
    assert all(c.predicted == 2.0 for c in found if "bfloat16" in c.p.describe())
    assert not any("vllm" in n for n in names)
    assert all(c.why and c.origin for c in found)
    assert [c.predicted for c in found] == sorted((c.predicted for c in found), reverse=True)


def test_a_vllm_found_here_is_offered_after_the_candidates_predicted_faster(no_vllm, monkeypatch, tmp_path):
    """With a vLLM executable found (a `make setup-vllm` environment), vLLM is a candidate: it runs
    the model's own weights (predicted 1.0x), so it comes after every candidate with fewer bytes."""
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    monkeypatch.setenv(vllm_process.ENV_PATH, str(exe))
    found = generate(Layer.HARDWARE, _context(Plan(source=EMBEDDED)))
    (vllm,) = [c for c in found if c.p.describe() == "runtime(backend=vllm)"]
    assert vllm.predicted == 1.0 and vllm.why.startswith("vllm: ")
    assert all(c.predicted > 1.0 for c in found if "llama_cpp" in c.p.describe()) and found.index(vllm) > 3


def test_on_llama_cpp_the_knobs_of_its_table_and_the_ladder_below_the_source():
    """On llama.cpp with BF16 weights: its table's knobs (flash attention, batch sizes) in the
    hardware layer, and in the model layer the weight ladder below Q4_1 (fewest bits first), never
    Q8_0, which would store Q4_1's information in more bytes."""
    plan = Plan(source=EMBEDDED).replace_section("hardware", runtime="llama_cpp", dtype="bfloat16")
    hardware = _described(generate(Layer.HARDWARE, _context(plan)))
    assert {"flash_attention(mode=on)", "llama_batch(n_batch=None, n_ubatch=128)"} <= set(hardware)
    model = generate(Layer.MODEL, _context(plan))
    ladder = [c.p.method for c in model if c.p.name == "quantize"]
    assert ladder == ["iq4_xs", "q4_0", "q4_k_m"] and "q8_0" not in ladder
    assert model[0].predicted == round(16 / 4.25, 3)
    assert plan_weight_bits(plan, 5.0, _context(plan)) == 16.0


def test_the_machine_decides_bfloat16_and_threads():
    """No bf16 units: no bfloat16 candidate; more logical than physical cores: a threads
    candidate for every logical core."""
    plain = _described(generate(Layer.HARDWARE, _context(Plan(source="tiny"), machine=cpu_machine())))
    assert "dtype(dtype=bfloat16)" not in plain
    smt = _described(generate(Layer.HARDWARE, _context(Plan(source="tiny"), machine=cpu_machine(logical_cores=4))))
    assert "threads(count=4)" in smt and "threads(count=auto)" in smt


def test_slots_come_from_the_load():
    """Under a closed load of 8 clients: continuous batching, then slots for the 8 clients and for
    twice as many; without a load, no scheduling candidate."""
    load = Workload(load={"mode": "closed", "concurrency": 8, "requests": 16})
    first = _described(generate(Layer.SCHEDULING, _context(Plan(source="tiny"), workload=load)))
    assert first == ["batching(mode=continuous)"]
    batched = Plan(source="tiny").replace_section("scheduling", batching="continuous")
    slots = [c.p.limit for c in generate(Layer.SCHEDULING, _context(batched, workload=load)) if c.p.name == "concurrency"]
    assert slots == [8, 16]
    assert generate(Layer.SCHEDULING, _context(Plan(source="tiny"))) == []
