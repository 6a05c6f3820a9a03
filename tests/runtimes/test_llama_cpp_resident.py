"""One llama.cpp server resident at a time: engines reload theirs on demand, the measurement
activates each engine before its rounds, so an idle server never shares the cores' OpenMP
accounting with the one being timed."""

from __future__ import annotations

import gc
import weakref

import pytest

from fractal_opt.core.errors import ModelSourceError
from fractal_opt.measure.runner import measure_pair
from fractal_opt.runtimes.llama_cpp import engine as llama_engine
from fractal_opt.runtimes.llama_cpp.settings import server_settings
from fractal_opt.testing import FakeEngine
from fractal_opt.tower.plan import HardwarePlan, Plan
from fractal_opt.workloads.workload import Workload


class _FakeServer:
    """Stands in for xllamacpp.Server: remembers what it was loaded with, answers nothing."""

    def __init__(self, params: object):
        self.params = params
        self.requests: list[dict] = []

    def handle_completions(self, body: dict) -> dict:
        self.requests.append(body)
        return {}


@pytest.fixture(autouse=True)
def _empty_cache():
    llama_engine.clear_cache()
    yield
    llama_engine.clear_cache()


def _resident(threads: int) -> llama_engine._Resident:
    plan = Plan(source="m.gguf", hardware=HardwarePlan(runtime="llama_cpp", threads=threads))
    settings = server_settings(plan, "m.gguf")
    return llama_engine._Resident(settings, plan.weights_key(), _FakeServer)


def test_loading_a_second_server_drops_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Acquiring B's server frees A's (no reference is left), and A reloads when asked again."""
    monkeypatch.setattr(llama_engine, "common_params", lambda settings: settings)
    a, b = _resident(1), _resident(2)
    first_a = weakref.ref(a.server())
    assert first_a().requests and first_a().requests[0]["max_tokens"] == 1  # served once before it counts as loaded
    assert a.load() == 0.0  # already resident: nothing to do
    b.server()
    gc.collect()
    assert first_a() is None, "A's server stays alive while B's is resident"
    assert list(llama_engine._SERVERS) == [b.settings]
    a.server()
    assert (a.loads, b.loads) == (2, 1)
    assert list(llama_engine._SERVERS) == [a.settings]


def test_evict_except_and_clear_cache_drop_the_resident_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """evict_except keeps the named plan's resident server and drops it when no plan is kept."""
    monkeypatch.setattr(llama_engine, "common_params", lambda settings: settings)
    a = _resident(1)
    a.server()
    llama_engine.evict_except({a.weights_key})
    assert a.settings in llama_engine._SERVERS
    llama_engine.evict_except(set())
    assert not llama_engine._SERVERS


def test_measure_pair_activates_each_engine_before_its_warm_up_and_every_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed round (and each warm-up) starts with engine.activate(); its seconds are kept apart."""
    build = FakeEngine.factory()
    engines = [build(Plan(source="fake")), build(Plan(source="fake"))]
    calls: list[int] = []
    for n, engine in enumerate(engines):
        monkeypatch.setattr(engine, "activate", lambda n=n: calls.append(n) or 0.25)
    wl = Workload(suite="default", max_new_tokens=2, repeats=2, warmup=1)
    before, after = measure_pair(engines[0], engines[1], wl, requests=wl.requests()[:1])
    # warm-ups (0, 1), then round 1 in order A B and round 2 in order B A
    assert calls == [0, 1, 0, 1, 1, 0]
    assert before.extra["activate_s"] == pytest.approx(0.75) and after.extra["activate_s"] == pytest.approx(0.75)


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF twice
def test_a_real_engine_serves_again_after_another_plans_server_was_resident() -> None:
    """Two llama.cpp plans used in turn: each reloads its server and answers the same greedy text."""
    pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (pip install xllamacpp)")
    try:
        from fractal_opt.weights.models import resolve

        resolve("smollm2-135m-instruct")
    except ModelSourceError as e:
        pytest.skip(f"embedded model not installed: {e}")
    one = llama_engine.LlamaCppEngine.build(Plan(source="smollm2-135m-instruct", hardware=HardwarePlan(runtime="llama_cpp", threads=1)),
                                            progress=lambda _: None, max_new_tokens=8)
    first = one.generate("What is the capital of France?")
    two = llama_engine.LlamaCppEngine.build(Plan(source="smollm2-135m-instruct", hardware=HardwarePlan(runtime="llama_cpp", threads=2)),
                                            progress=lambda _: None, max_new_tokens=8)
    assert list(llama_engine._SERVERS) == [two.settings]
    assert one.activate() > 0.0  # reloaded: the other plan's server was resident
    assert list(llama_engine._SERVERS) == [one.settings]
    assert one.activate() == 0.0
    assert one.generate("What is the capital of France?") == first
    assert two.generate("What is the capital of France?").strip()  # reloads on demand too
