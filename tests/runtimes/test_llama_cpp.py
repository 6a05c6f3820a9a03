"""The llama.cpp runtime on the embedded GGUF: serving, the request server, and what it refuses."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from fractal_opt.core.errors import ModelSourceError, RequestRejected
from fractal_opt.runtimes.llama_cpp import LlamaCppEngine
from fractal_opt.serving.server import Ticket
from fractal_opt.tower.plan import ApplicationPlan, HardwarePlan, ModelPlan, Plan, SchedulingPlan
from fractal_opt.workloads.workload import Request, Workload

MODEL = "smollm2-135m-instruct"


def _model_or_skip() -> None:
    try:
        from fractal_opt.weights.models import resolve

        resolve(MODEL)
    except ModelSourceError as e:
        pytest.skip(f"embedded model not installed: {e}")


def _plan(**sections: object) -> Plan:
    # One thread: the test machine is shared, and ggml's spinning workers slow down when another
    # process holds the second core.
    hardware = sections.pop("hardware", HardwarePlan(runtime="llama_cpp", threads=1))
    return Plan(source=MODEL, hardware=hardware, **sections)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> LlamaCppEngine:
    pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (pip install xllamacpp)")
    _model_or_skip()
    return LlamaCppEngine.build(_plan(), progress=lambda _: None, max_new_tokens=12)


@pytest.fixture(scope="module")
def continuous() -> LlamaCppEngine:
    pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (pip install xllamacpp)")
    _model_or_skip()
    plan = _plan(scheduling=SchedulingPlan(batching="continuous", max_concurrency=4), model=ModelPlan(context_cap=512))
    return LlamaCppEngine.build(plan, progress=lambda _: None, max_new_tokens=12)


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_generate_and_stream_give_the_same_greedy_text(engine: LlamaCppEngine) -> None:
    """Greedy generate() and stream() answer one prompt with the same non-empty text."""
    text = engine.generate("What is the capital of France?")
    pieces = list(engine.stream("What is the capital of France?"))
    assert text.strip() and len(pieces) > 1
    assert "".join(pieces) == text


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_serve_times_every_token_in_order(engine: LlamaCppEngine) -> None:
    """serve() gives each request its prompt size, one id and one monotone clock reading per token."""
    requests = Workload(suite="default", max_new_tokens=12).requests()[:2]
    for g in engine.serve(requests, max_new_tokens=12):
        assert g.prompt_tokens > 10 and 0 < len(g.token_ids) <= 12
        assert len(g.token_times) == len(g.token_ids)
        assert g.t_submit <= g.t_prefill_start <= g.token_times[0]
        assert all(a <= b for a, b in zip(g.token_times, g.token_times[1:]))
        assert g.token_times[-1] <= g.t_done
        assert g.hit_cap == (len(g.token_ids) == 12)


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_server_ends_each_of_eight_concurrent_tickets_once(continuous: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight requests submitted from eight threads each end exactly once, done, with their tokens."""
    ends: Counter[str] = Counter()
    finish = Ticket._finish

    def counted(self: Ticket, status: str, error: BaseException | None = None) -> bool:
        ended = finish(self, status, error)
        ends[self.key] += ended
        return ended

    monkeypatch.setattr(Ticket, "_finish", counted)
    tickets: list[Ticket] = []
    with continuous.server() as server:
        def client(i: int) -> None:
            tickets.append(server.submit(Request(id=f"r{i}", messages=(("user", f"Name a colour, number {i}."),)), max_new_tokens=8))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [t.result(timeout=60) for t in tickets]
        assert server.live() == 0
    assert sorted(ends.values()) == [1] * 8
    assert all(t.status == "done" for t in tickets)
    assert all(r.text and r.prompt_tokens > 0 and len(r.token_times) == len(r.token_ids) for r in results)


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_cancel_stops_a_running_request_and_frees_its_slot(continuous: LlamaCppEngine) -> None:
    """A cancelled ticket stops before its budget, and the server has nothing live afterwards."""
    with continuous.server(ignore_eos=True) as server:
        ticket = server.submit("Write a long story about a dragon.", max_new_tokens=200)
        first = next(iter(ticket))  # a token arrived: the request is running in a slot
        assert isinstance(first, int)
        assert ticket.cancel()
        after = server.submit("Say hi.", max_new_tokens=4).result(timeout=60)
        assert ticket.status == "cancelled" and len(ticket.token_ids) < 200
        assert after.text and server.live() == 0


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_timeout_ends_a_ticket(continuous: LlamaCppEngine) -> None:
    """A ticket past its deadline ends with status timeout, not done."""
    with continuous.server(ignore_eos=True) as server:
        ticket = server.submit("Write a long story about a dragon.", max_new_tokens=200, timeout_s=0.3)
        with pytest.raises(TimeoutError):
            ticket.result(timeout=0.0)  # still running: result() waits no longer than asked
        ticket.result(timeout=60)
        assert ticket.status == "timeout" and len(ticket.token_ids) < 200


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_prompt_over_the_context_cap_is_rejected(continuous: LlamaCppEngine) -> None:
    """A prompt longer than the plan's context cap is rejected with the cap in the message."""
    with continuous.server() as server:
        ticket = server.submit("word " * 700, max_new_tokens=4)
        with pytest.raises(RequestRejected, match="512"):
            ticket.result(timeout=60)
        assert ticket.status == "rejected"


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_decoding_fields_reuse_the_loaded_model_and_stop_cuts_the_text(engine: LlamaCppEngine) -> None:
    """A plan that changes only stops reuses the loaded llama.cpp server, and the stop string ends the text."""
    plan = _plan(application=ApplicationPlan(stop=(" ",)))
    engine.activate()  # its server resident again (another test's plan may have been loaded since)
    stopped = LlamaCppEngine.build(plan, progress=lambda _: None, max_new_tokens=12)
    assert stopped.settings == engine.settings and stopped.load_s == 0.0
    g = stopped.serve([Request(id="s", messages=(("user", "Tell me about bridges."),))])[0]
    assert g.text and " " not in g.text and not g.hit_cap


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_quantized_kv_cache_maps_to_q8_0() -> None:
    """kv_bits 8 loads llama.cpp with a q8_0 cache: about half the f16 bytes, and it still answers."""
    pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (pip install xllamacpp)")
    _model_or_skip()
    plan = _plan(model=ModelPlan(kv_cache="quantized", kv_bits=8, context_cap=256))
    engine = LlamaCppEngine.build(plan, progress=lambda _: None, max_new_tokens=4)
    census = engine.census()
    assert census["kv_cache"] == "q8_0"
    assert 0.5 < census["kv_bytes_per_1k_tokens"] / census["kv_bytes_per_1k_tokens_plain"] < 0.55  # 34 bytes per 32 values vs 64
    assert engine.generate("Say hi.")


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_census_counts_the_gguf_tensors(engine: LlamaCppEngine) -> None:
    """census() reports the GGUF's tensor bytes (most of the file) and its quantized layers."""
    from fractal_opt.weights.models import resolve

    census = engine.census()
    size = resolve(MODEL).path.stat().st_size
    assert 0.9 * size < census["weight_bytes"] <= size
    assert census["quantized_linear_layers"] > 0 and "Q4_1" in census["weight_types"]


@pytest.mark.integration  # serves the embedded SmolLM2 GGUF
def test_no_full_distributions_but_teacher_forced_top_k_and_exact_tokens(engine: LlamaCppEngine) -> None:
    """next_token_logprobs refuses naming token_logprobs; top_logprobs gives k per position; token_logprobs
    gives the asked tokens' exact log-probabilities, matching top_logprobs where both know a token."""
    with pytest.raises(NotImplementedError, match="token_logprobs"):
        engine.next_token_logprobs([1, 2, 3])
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    rows = engine.top_logprobs(ids, k=3)
    assert len(rows) == 5 and all(len(r) == 3 for r in rows)
    assert all(all(v <= 0 for v in r.values()) for r in rows)
    asked = [sorted(r) + [42] for r in rows]  # each position's top 3 and a token far down the list
    exact = engine.token_logprobs(ids, asked)
    assert len(exact) == 5 and all(set(a) <= set(e) for a, e in zip(asked, exact, strict=True))
    assert all(abs(exact[j][t] - rows[j][t]) < 1e-3 for j in range(5) for t in rows[j])
    assert all(exact[j][42] < min(rows[j].values()) for j in range(5))


@pytest.mark.parametrize(
    ("plan", "field"),
    [
        (_plan(hardware=HardwarePlan(runtime="llama_cpp", compile="default")), "hardware.compile"),
        (_plan(hardware=HardwarePlan(runtime="llama_cpp", dtype="bfloat16"), model=ModelPlan(weight_bits=8, quant_backend="gguf", quant_method="q8_0")),
         "model.quant_method"),  # the embedded GGUF is Q4_1: Q8_0 would be quantizing up
        (_plan(hardware=HardwarePlan(runtime="llama_cpp", runtime_url="http://127.0.0.1:1")), "hardware.runtime_url"),
        (_plan(model=ModelPlan(weight_bits=8, quant_backend="torchao", quant_method="weight_only")), "model.weight_bits"),
        (_plan(model=ModelPlan(kv_cache="quantized", kv_bits=4, kv_backend="quanto")), "model.kv_backend"),
        (_plan(scheduling=SchedulingPlan(batching="static", batch_size=4)), "scheduling.batching"),
        (_plan(application=ApplicationPlan(num_beams=2)), "application.num_beams"),
    ],
)
def test_refuse_names_a_field_llama_cpp_cannot_honour(plan: Plan, field: str) -> None:
    """refuse() gives a reason naming each transformers-only field."""
    _model_or_skip()
    reason = LlamaCppEngine.refuse(plan)
    assert reason is not None and field in reason


def test_refuse_accepts_the_fields_it_maps() -> None:
    """Threads, context cap, q8_0/q4_0 KV, continuous batching, sampling and stops are accepted."""
    _model_or_skip()
    plan = _plan(
        hardware=HardwarePlan(runtime="llama_cpp", threads="auto"),
        model=ModelPlan(context_cap=1024, kv_cache="quantized", kv_bits=8),
        scheduling=SchedulingPlan(batching="continuous", max_concurrency=8, timeout_s=5.0),
        application=ApplicationPlan(max_new_tokens=64, stop=("\n\n",), do_sample=True, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1),
    )
    assert LlamaCppEngine.refuse(plan) is None


def test_a_transformers_folder_is_converted_unless_its_architecture_is_unknown(tmp_path, monkeypatch) -> None:
    """A model folder reaches llama.cpp through llama.cpp's converter: an architecture the converter
    knows is accepted before anything converts; one it does not know, or no converter at all, is
    refused naming the architecture (or the command that installs the converter)."""
    from fractal_opt.weights import convert

    script = tmp_path / "convert_hf_to_gguf.py"
    script.write_text("")
    monkeypatch.setattr(convert, "converter_script", lambda: script)
    monkeypatch.setattr(convert, "supported_architectures", lambda: frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"}))
    folder = tmp_path / "model"
    folder.mkdir()
    plan = Plan(source=str(folder), hardware=HardwarePlan(runtime="llama_cpp"))
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"}')
    assert LlamaCppEngine.refuse(plan) is None
    (folder / "config.json").write_text('{"architectures": ["Qwen2ForCausalLMX"]}')
    reason = LlamaCppEngine.refuse(plan) or ""
    assert "'Qwen2ForCausalLMX'" in reason and "Did you mean 'Qwen2ForCausalLM'" in reason
    monkeypatch.setattr(convert, "supported_architectures", lambda: None)
    assert "make setup" in (LlamaCppEngine.refuse(plan) or "")
