"""The placement passes: split (hardware) and replicas (scheduling), their parameters and their checks."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.layers.placement import Replicas, Split, endpoint_problem
from fractal_opt.testing import cpu_machine
from fractal_opt.tower.plan import Plan

LLAMA = Plan(source="m").replace_section("hardware", runtime="llama_cpp", runtime_path="native")
VLLM = Plan(source="m").replace_section("hardware", runtime="vllm")


def test_split_defaults_to_two_rpc_servers_on_loopback():
    """A bare split is llama.cpp's two rpc-servers listening on loopback only."""
    plan = Split().apply(LLAMA)
    assert (plan.hardware.rpc_workers, plan.hardware.rpc_bind, plan.hardware.tensor_parallel) == (2, "127.0.0.1", 1)


def test_split_with_a_tensor_degree_starts_no_rpc_server():
    """split: {tensor: 2} is vLLM's tensor parallel; no rpc-server is implied."""
    plan = Split(tensor=2).apply(VLLM)
    assert (plan.hardware.tensor_parallel, plan.hardware.rpc_workers) == (2, 0)


@pytest.mark.parametrize(("params", "words"), [
    ({"rpc_workers": 2, "tensor": 2}, "different runtimes"),
    ({"rpc_workers": 0}, "nothing to split"),
    ({"rpc_endpoints": ["host-without-port"]}, "host:port"),
    ({"rpc_endpoints": ["10.0.0.2:70000"]}, "1-65535"),
    ({"rpc_bind": "everywhere"}, "IP address"),
])
def test_split_refuses_bad_parameters_by_name(params, words):
    """A split that mixes runtimes, splits nothing, or names a bad endpoint or address is refused before any run, naming the parameter."""
    with pytest.raises(RecipeError, match=words):
        Split.from_params(params)


def test_endpoint_problem_accepts_host_and_port():
    assert endpoint_problem("192.168.1.20:50052") is None and endpoint_problem("[::1]:50052") is None
    assert endpoint_problem(":50052") is not None


def test_a_runtime_without_the_placement_is_refused_with_the_ones_it_offers():
    """Each runtime's capability table says which placements it offers; a split it does not offer names them."""
    why = Split(tensor=2).check(LLAMA, cpu_machine())
    assert "llama_cpp runtime does not offer tensor_parallel" in why and "rpc" in why
    assert "does not offer rpc" in Split().check(VLLM, cpu_machine())
    assert "transformers runtime does not offer replicas" in Replicas().check(Plan(source="m"), cpu_machine())


def test_more_rpc_servers_or_ranks_than_cores_is_refused():
    assert "more rpc-servers than the 2 physical cores" in Split(rpc_workers=3).check(LLAMA, cpu_machine())
    assert "more than the 2 physical cores" in Split(tensor=2, pipeline=2).check(VLLM.replace_section("hardware", device="cpu"), cpu_machine())
    assert Split(tensor=2).check(VLLM.replace_section("hardware", device="cpu"), cpu_machine()) is None


def test_more_replicas_than_cores_is_refused_before_any_round():
    """More replicas than cores, or replicas x cores over the machine, is refused by the pass's check (the runner's gate, before any round)."""
    assert "more replicas than the 2 physical cores" in Replicas(count=3).check(LLAMA, cpu_machine())
    assert "2 x cores=2 = 4 cores" in Replicas(count=2, cores=2).check(LLAMA, cpu_machine())
    assert Replicas(count=2).check(LLAMA, cpu_machine()) is None
    assert Replicas(count=4).check(LLAMA, cpu_machine(physical_cores=8, logical_cores=8)) is None


def test_replicas_share_the_cores_out_and_touch_only_scheduling():
    plan = Replicas(count=2).apply(LLAMA)
    assert (plan.scheduling.replicas, plan.scheduling.replica_cores, plan.scheduling.router) == (2, None, "auto")
    assert plan.hardware == LLAMA.hardware
    assert Replicas(count=2).cores_each(cpu_machine(physical_cores=8, logical_cores=8)) == 4
