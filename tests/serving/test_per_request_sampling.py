"""Per-request temperature / top_p / seed: through Server.submit on the transformers runtime
(sequential, static, continuous), and into the request bodies llama.cpp and vLLM receive."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from fractal_opt.core.errors import BadRequest, RequestRejected
from fractal_opt.runtimes import Engine
from fractal_opt.tower.plan import Plan, SchedulingPlan

PROMPT = "Tell me a story about a small boat."
BUDGET = 12


def _engine(model_dir: Path, **scheduling: Any) -> Engine:
    return Engine.build(Plan(source=str(model_dir), scheduling=SchedulingPlan(**scheduling)), progress=lambda m: None)


def _ids(server: Any, **sampling: Any) -> list[int]:
    ticket = server.submit(PROMPT, max_new_tokens=BUDGET, **sampling)
    ticket.result(timeout=120)
    assert ticket.status == "done", (ticket.status, ticket.error)
    return list(ticket.token_ids)


@pytest.fixture(scope="module")
def sequential(lively_dir):
    """A greedy sequential plan on the lively tiny model (its next token depends on the context)."""
    server = _engine(lively_dir).server()
    yield server
    server.close()


def test_a_seeded_request_reproduces_and_temperature_zero_is_greedy(sequential):
    greedy = _ids(sequential)
    assert _ids(sequential, temperature=0) == greedy
    first = _ids(sequential, temperature=1.5, seed=11)
    assert _ids(sequential, temperature=1.5, seed=11) == first  # same seed + same prompt -> same tokens
    assert _ids(sequential) == greedy  # a sampled request leaves the next greedy one greedy


def test_a_greedy_plan_samples_a_request_that_asks_and_seeds_differ(sequential):
    greedy = _ids(sequential)
    sampled = {tuple(_ids(sequential, temperature=1.5, seed=s)) for s in range(4)}
    assert len(sampled) > 1  # different seeds give different answers
    assert any(list(ids) != greedy for ids in sampled)  # the greedy plan did sample


def test_top_p_is_applied(sequential):
    # top_p that keeps only the most likely token is greedy whatever the temperature or seed.
    assert _ids(sequential, temperature=1.5, top_p=1e-6, seed=3) == _ids(sequential)
    assert _ids(sequential, temperature=1.0, top_p=0.5, seed=3) == _ids(sequential, temperature=1.0, top_p=0.5, seed=3)


@pytest.mark.parametrize("field,value", [("temperature", -1), ("temperature", 2.5), ("top_p", 2), ("top_p", 0), ("seed", 1.5), ("seed", True),
                                         ("seed", 2**64), ("seed", -(2**63) - 1)])
def test_bad_values_are_refused_naming_the_field(sequential, field, value):
    """Server.submit refuses an out-of-range sampling value with the one request error, BadRequest, naming the field."""
    with pytest.raises(BadRequest) as e:
        sequential.submit(PROMPT, **{field: value})
    assert e.value.param == field and field in str(e.value)


def test_a_static_batch_serves_tickets_with_different_sampling_apart(lively_dir):
    """One static batch of three: two greedy, one seeded sample. Each decodes as it asked: the
    greedy rows as a greedy sequential server answers them, the sampled row as it does alone."""
    with _engine(lively_dir).server() as seq:
        want_greedy, want_sampled = _ids(seq), _ids(seq, temperature=1.5, seed=5)
    with _engine(lively_dir, batching="static", batch_size=4, max_wait_ms=2000).server() as server:
        tickets = [server.submit(PROMPT, max_new_tokens=BUDGET, **s) for s in ({}, {"temperature": 1.5, "seed": 5}, {})]
        got = [list(t.result(timeout=120).token_ids) for t in tickets]
    assert [t.status for t in tickets] == ["done"] * 3
    assert got == [want_greedy, want_sampled, want_greedy]
    assert want_sampled != want_greedy  # the test can fail: sampling changed the answer


def test_a_sampled_request_bypasses_the_response_cache(tiny_dir):
    plan = Plan(source=str(tiny_dir)).replace_section("application", response_cache="exact")
    with Engine.build(plan, progress=lambda m: None).server() as server:
        server.submit(PROMPT, max_new_tokens=4).result(timeout=60)
        assert server.submit(PROMPT, max_new_tokens=4).cache_hit == "exact"
        assert server.submit(PROMPT, max_new_tokens=4, temperature=0).cache_hit == "exact"  # greedy: the plan's decoding
        sampled = server.submit(PROMPT, max_new_tokens=4, temperature=1.0, seed=1)
        sampled.result(timeout=60)
        assert sampled.cache_hit is None and sampled.status == "done"


def test_continuous_batching_refuses_sampling_it_cannot_honour_per_request(tiny_dir):
    with _engine(tiny_dir, batching="continuous").server() as server:
        with pytest.raises(BadRequest) as e:
            server.submit(PROMPT, temperature=0.7)
        assert e.value.param == "temperature" and "continuous" in str(e.value)
        ticket = server.submit(PROMPT, max_new_tokens=3, temperature=0, seed=9)  # the plan's own (greedy) decoding
        ticket.result(timeout=120)
        assert ticket.status == "done"


# ---------------------------------------------------------------------------- llama.cpp and vLLM bodies
class _LlamaHandle:
    """Stands in for xllamacpp.Server: records each body and answers one token."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def handle_completions(self, body: dict[str, Any], callback: Any) -> dict[str, Any]:
        self.bodies.append(body)
        callback({"choices": [{"text": " x", "logprobs": {"content": [{"id": 7}]}, "finish_reason": "length"}]})
        return {}


def test_llama_cpp_receives_each_requests_own_sampling(monkeypatch):
    from fractal_opt.runtimes.llama_cpp import engine as llama_engine
    from fractal_opt.runtimes.llama_cpp.settings import ServerSettings
    from fractal_opt.tower.plan import HardwarePlan

    monkeypatch.setattr(llama_engine, "eos_token_id", lambda path: None)
    handle = _LlamaHandle()
    settings = ServerSettings(model_path="m.gguf", threads=1, slots=2, kv_tokens=1024, unified=True, cache_type="f16")
    engine = llama_engine.LlamaCppEngine(Plan(source="m.gguf", hardware=HardwarePlan(runtime="llama_cpp")), handle, settings)
    monkeypatch.setattr(engine, "prompt_ids", lambda request: [1, 2, 3])  # no tokenizer behind m.gguf: the ids are not what this checks
    with engine.server(seed=4) as server:
        for sampling in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}, {"temperature": 0.8}):
            assert server.submit("hi", max_new_tokens=1, **sampling).result(timeout=10).text == " x"
    plain, own, unseeded = handle.bodies
    assert (plain["temperature"], plain["top_k"]) == (0.0, 1)  # the greedy plan
    assert (own["temperature"], own["top_p"], own["top_k"], own["seed"]) == (0.8, 0.9, 0, 5)
    assert (unseeded["temperature"], unseeded["top_p"], unseeded["seed"]) == (0.8, 1.0, 4)  # the server's seed


def test_llama_cpp_takes_every_64_bit_seed_and_never_more_than_its_context(monkeypatch):
    """A seed of any signed 64-bit value reaches llama.cpp as one of its own 32-bit seeds (never
    0xFFFFFFFF, its "random"), small seeds unchanged; a budget past the context is sent as what the
    context leaves after the prompt, and a prompt that fills it is rejected, naming both numbers."""
    from fractal_opt.runtimes.llama_cpp import engine as llama_engine
    from fractal_opt.runtimes.llama_cpp.settings import ServerSettings, llama_seed
    from fractal_opt.tower.plan import HardwarePlan

    assert [llama_seed(s) for s in (0, 5, 2**32 - 2, 2**32 - 1, -1)] == [0, 5, 2**32 - 2, 0, 2**32 - 2]
    assert all(0 <= llama_seed(s) < 2**32 - 1 for s in (2**63 - 1, -(2**63), 2**40 + 3))
    monkeypatch.setattr(llama_engine, "eos_token_id", lambda path: None)
    handle = _LlamaHandle()
    settings = ServerSettings(model_path="m.gguf", threads=1, slots=2, kv_tokens=1024, unified=False, cache_type="f16")
    engine = llama_engine.LlamaCppEngine(Plan(source="m.gguf", hardware=HardwarePlan(runtime="llama_cpp")), handle, settings)
    monkeypatch.setattr(engine, "prompt_ids", lambda request: [1] * len(request.messages[-1][1]))  # one token a character (no tokenizer behind m.gguf)
    with engine.server(seed=2**63 - 1) as server:
        assert server.submit("hi", max_new_tokens=10**12, over_cap=True, temperature=0.5, seed=-(2**63)).result(timeout=10).text == " x"
        assert server.submit("hi", max_new_tokens=3, temperature=0.5).result(timeout=10).text == " x"
        full = server.submit("x" * 512, max_new_tokens=3)
        with pytest.raises(RequestRejected, match="512 tokens, which leaves no room .* 512 tokens"):
            full.result(timeout=10)
    huge, plain = handle.bodies
    assert settings.context_per_request == 512 and huge["max_tokens"] == 512 - 2 and huge["seed"] == llama_seed(-(2**63))
    assert plain["max_tokens"] == 3 and plain["seed"] == llama_seed(2**63 - 1)


def test_vllm_receives_each_requests_own_sampling(monkeypatch):
    from fractal_opt.runtimes.vllm import VllmEngine, clear_cache
    from fractal_opt.runtimes.vllm.process import ENV_URL

    spec = importlib.util.spec_from_file_location("fake_openai_server", Path(__file__).parents[1] / "runtimes" / "fake_openai_server.py")
    fake_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake_module)
    clear_cache()
    try:
        with fake_module.FakeOpenAIServer(token_delay_s=0.0) as fake:
            monkeypatch.setenv(ENV_URL, fake.url)
            plan = Plan(source="smollm2-135m-instruct").replace_section("hardware", runtime="vllm")
            engine = VllmEngine.build(plan, progress=lambda m: None)
            with engine.server(seed=4) as server:
                for sampling in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}, {"temperature": 0}):
                    assert server.submit("hi", max_new_tokens=2, **sampling).result(timeout=10).token_ids
            plain, own, greedy = fake.requests[-3:]
    finally:
        clear_cache()
    assert plain["temperature"] == 0.0 and greedy["temperature"] == 0.0
    assert (own["temperature"], own["top_p"], own["seed"]) == (0.8, 0.9, 5)
