"""doctor: each check's verdict on hand-made situations, and a deliberately busy machine flagged."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fractal_opt.advice.doctor import FAIL, NA, OK, WARN, busy_check, census_checks, doctor, render
from fractal_opt.core.machine import Machine
from fractal_opt.language.recipe import load_recipe
from fractal_opt.testing import LLAMA_SHAPE, FakeEngine, cpu_machine, fake_model_folder
from fractal_opt.tower.plan import ModelPlan, Plan

LLAMA = {**LLAMA_SHAPE, "max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return fake_model_folder(tmp_path_factory.mktemp("doctor") / "model", LLAMA)


def _recipe(model_dir, **extra):
    data = {"model": str(model_dir), "workload": {"suite": "default", "limit": 2, "max_new_tokens": 8}}
    data.update(extra)
    return load_recipe(data, check_model=False)  # the folder holds a config only: doctor reads no weights


def _by_name(checks):
    return {c.name: c for c in checks}


@pytest.mark.integration  # starts CPU-burner processes
def test_busy_machine_is_flagged():
    """A CPU burner on every core: the load check warns and names the burners."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # let them reach full speed
        check = busy_check(Machine.probe(), sample_s=1.0)
    finally:
        for p in burners:
            p.kill()
        for p in burners:
            p.wait()
    assert check.verdict == WARN, check
    assert "quiet machine" in check.action
    assert "busiest: " in check.found, check.found
    # Flagged by the sampled CPU use of other processes (the burners), not only by the slow load average.
    share = int(check.found.split("other processes use ")[1].split("%")[0])
    assert share > 50, check.found


def test_context_cap_over_the_positions_fails(model_dir):
    """A context cap beyond the model's position table fails, quoting both numbers."""
    recipe = _recipe(model_dir, passes={"model": [{"context_cap": {"tokens": 4096}}]})
    checks = _by_name(doctor(recipe, machine=cpu_machine(), sample_s=0.1))
    assert checks["context vs positions"].verdict == FAIL
    assert "4096" in checks["context vs positions"].found and "1024 positions" in checks["context vs positions"].found


def test_memory_that_does_not_fit_fails(model_dir):
    """Weights that do not fit the machine's memory fail the headroom check, and the action suggests int8."""
    small = cpu_machine(memory_bytes=2 * 2**20)  # 2 MiB: the 4-layer model's weights alone are ~11 MB
    checks = _by_name(doctor(_recipe(model_dir), machine=small, sample_s=0.1))
    assert checks["memory headroom"].verdict == FAIL
    assert "int8" in checks["memory headroom"].action
    assert checks["context vs positions"].verdict == OK


def test_cuda_recipe_without_a_gpu_fails(model_dir):
    """A CUDA recipe on a CPU machine fails the device check; GPU-only checks say n/a; the pass is named."""
    recipe = _recipe(model_dir, passes={"hardware": [{"device": {"device": "cuda"}}]})
    checks = _by_name(doctor(recipe, machine=cpu_machine(), sample_s=0.1))
    assert checks["device and driver"].verdict == FAIL
    assert checks["other processes on the GPU"].verdict == NA and checks["bf16 support"].verdict == NA
    # The recipe's own pass that this machine cannot run is named, with the pass's reason.
    assert checks["recipe passes"].verdict == WARN and "hardware/device" in checks["recipe passes"].found


def test_quantization_that_did_not_apply_fails(model_dir):
    """--build: a plan asking for int8 weights whose census shows no quantized layer is a failure."""
    recipe = _recipe(model_dir, passes={"model": [{"quantize": {"bits": 8}}]})
    checks = doctor(recipe, machine=cpu_machine(), build=FakeEngine.factory(), sample_s=0.1)
    dtypes = _by_name(checks)["parameter dtypes"]
    assert dtypes.verdict == FAIL and "no linear layer is quantized" in dtypes.found
    assert "Failures above" in render(checks)


def test_census_checks_on_a_quantized_small_model():
    """A census with 9 of 10 linear layers quantized passes the dtype check and warns of the dequantizing fallback."""
    plan = Plan(source="tiny", model=ModelPlan(weight_bits=8, quant_backend="torchao"))
    census = {"bytes_by_type": {"float32": 100, "AffineQuantizedTensor(int8)": 300}, "linear_layers": 10, "quantized_linear_layers": 9}
    from fractal_opt.measure.budget import shape_from_config

    checks = _by_name(census_checks(plan, census, shape_from_config(LLAMA), cpu_machine()))
    assert checks["parameter dtypes"].verdict == OK and "9 of 10" in checks["parameter dtypes"].found
    assert checks["slow fallbacks"].verdict == WARN and "dequantiz" in checks["slow fallbacks"].found


def test_too_many_threads_warns(model_dir):
    """A plan asking for more threads than the machine's cores warns, quoting the count."""
    recipe = _recipe(model_dir, passes={"hardware": [{"threads": {"count": 8}}]})
    checks = _by_name(doctor(recipe, machine=cpu_machine(), sample_s=0.1))
    assert checks["CPU threads"].verdict == WARN and "the plan asks for 8" in checks["CPU threads"].found
