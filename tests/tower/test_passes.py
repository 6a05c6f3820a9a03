"""Passes: the conformance contract, registration rules, and what check() refuses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fractal_opt.core.errors import FractalOptError
from fractal_opt.layers import registry
from fractal_opt.layers.application import MaxNewTokens
from fractal_opt.layers.hardware import Attention, Dtype, Threads
from fractal_opt.layers.model import KVCache, Quantize
from fractal_opt.layers.scheduling import Batching
from fractal_opt.pipeline.gate import skip_reason
from fractal_opt.testing import check_pass, cpu_machine
from fractal_opt.tower.passes import Layer, Pass, register
from fractal_opt.tower.plan import HardwarePlan, Plan

PLAN = Plan(source="tiny")
CUDA_PLAN = Plan(source="tiny", hardware=HardwarePlan(device="cuda", dtype="float16"))


@pytest.mark.parametrize("name", sorted(registry()))
def test_registered_pass_keeps_the_contract(name):
    """Every registered pass passes check_pass: defaults, frozen, YAML round trip, pure apply confined to its layer."""
    check_pass(registry()[name])


def test_registry_covers_all_four_layers():
    """The built-in passes cover every layer of the tower."""
    layers = {cls.layer for cls in registry().values()}
    assert layers == set(Layer)


def test_check_pass_catches_a_pass_that_leaks_into_another_layer():
    """check_pass fails a pass whose apply touches another layer's section (the helper can fail)."""

    @dataclass(frozen=True, kw_only=True)
    class Leaky(Pass):
        """Changes the hardware section from the application layer."""

        name = "leaky_test_pass"
        layer = Layer.APPLICATION

        def apply(self, plan):
            return plan.replace_section("hardware", dtype="float16")

    with pytest.raises(AssertionError, match="changed the hardware section"):
        check_pass(Leaky)


def test_register_rejects_a_duplicate_name():
    """@register refuses a second pass with an existing name, naming the name and the first owner."""
    before = registry()

    with pytest.raises(FractalOptError, match="'dtype' is already registered"):

        @register
        @dataclass(frozen=True, kw_only=True)
        class Impostor(Pass):
            """Another dtype pass."""

            name = "dtype"
            layer = Layer.HARDWARE

    assert registry()["dtype"] is Dtype
    assert registry() == before


def test_register_rejects_a_class_that_is_not_its_own_frozen_dataclass():
    """@register refuses a Pass subclass without its own @dataclass(frozen=True) and says how to declare it."""
    # A non-frozen @dataclass cannot even be declared under the frozen Pass base (Python refuses
    # it), so a forgotten decorator is how a pass ends up with plain, mutable class attributes.
    with pytest.raises(FractalOptError, match=r"dataclass\(frozen=True, kw_only=True\)"):

        @register
        class Mutable(Pass):
            """Forgot the dataclass decorator."""

            name = "mutable_test_pass"
            layer = Layer.APPLICATION
            limit: int = 3

    assert "mutable_test_pass" not in registry()


def test_register_rejects_a_non_pass():
    """@register refuses a class that does not derive from Pass."""
    with pytest.raises(FractalOptError, match="Pass subclass"):

        @register
        class NotAPass:
            name = "not_a_pass"


# --------------------------------------------------------------------------- check() refusals


def test_flash_attention_refused_on_cpu(machine):
    """flash_attention_2 is refused on a CPU plan and machine, with a reason naming CUDA."""
    reason = Attention(implementation="flash_attention_2").check(PLAN, machine)
    assert reason is not None and "CUDA" in reason


def test_quantize_refused_without_backend_package():
    """quantize on a machine without torchao is refused, naming the package and how to install it."""
    bare = cpu_machine(packages={"torch": "2.13.0", "transformers": "5.0"})
    reason = Quantize().check(PLAN, bare)
    assert reason is not None and "torchao" in reason and "pip install" in reason


def test_quantize_allowed_with_backend_package(machine):
    """quantize runs on a CPU plan when torchao is installed."""
    assert Quantize().check(PLAN, machine) is None


def test_quantize_refused_when_already_quantized(machine):
    """quantize refuses a plan whose weights are already quantized."""
    plan = Quantize().apply(PLAN)
    assert "already quantized" in Quantize().check(plan, machine)


def test_threads_above_logical_cores_refused(machine):
    """threads with a count above the machine's logical cores is refused, naming both numbers."""
    reason = Threads(count=machine.logical_cores + 1).check(PLAN, machine)
    assert reason is not None and str(machine.logical_cores + 1) in reason and str(machine.logical_cores) in reason
    assert Threads(count=machine.logical_cores).check(PLAN, machine) is None


def test_dtype_already_in_plan_refused(machine):
    """A dtype pass asking for the plan's current dtype is refused (there is nothing to measure)."""
    reason = Dtype(dtype="float32").check(PLAN, machine)
    assert reason is not None and "already" in reason and "float32" in reason
    assert Dtype(dtype="bfloat16").check(PLAN, machine) is None


def test_kv_cache_already_in_plan_refused(machine):
    """kv_cache asking for the plan's current cache is refused."""
    assert skip_reason(KVCache(implementation="dynamic"), PLAN, machine) is not None


def test_static_batching_refused_with_static_cache(machine):
    """Static batching is refused on a plan that uses a static KV cache (the engine cannot pad it)."""
    plan = KVCache(implementation="static").apply(PLAN)
    assert "static" in Batching(mode="static", batch_size=4).check(plan, machine)


def test_max_new_tokens_rejects_nonpositive_limit():
    """max_new_tokens with limit 0 fails at construction, naming the parameter."""
    with pytest.raises(FractalOptError, match="limit"):
        MaxNewTokens(limit=0)


def test_quantize_auto_backend_is_torchao_on_cpu():
    """quantize with backend auto resolves to torchao on a CPU plan."""
    assert Quantize(backend="auto").apply(PLAN).model.quant_backend == "torchao"


def test_quantize_auto_backend_is_bitsandbytes_on_cuda():
    """quantize with backend auto resolves to bitsandbytes on a CUDA plan."""
    assert Quantize(backend="auto").apply(CUDA_PLAN).model.quant_backend == "bitsandbytes"


def test_quantize_skip_list_reaches_the_plan():
    """quantize's skip list (mixed precision) is recorded in the plan; lm_head is skipped by default."""
    assert Quantize().apply(PLAN).model.quant_skip == ("lm_head",)
