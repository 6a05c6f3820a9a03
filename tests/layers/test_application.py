"""Application passes on the tiny model: caps and stops, decoding, prompt budget, speculation."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import quiet

from fractal_opt.core.errors import EngineError, RecipeError
from fractal_opt.language.recipe import load_recipe
from fractal_opt.layers.application import AssistedDecoding, Decoding, MaxNewTokens, PromptBudget, PromptLookup, ResponseCache
from fractal_opt.measure.clock import TokenClock
from fractal_opt.measure.metrics import Sample
from fractal_opt.measure.runner import measure
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.runtimes import Engine
from fractal_opt.runtimes.transformers.generate_kwargs import generate_kwargs
from fractal_opt.testing import check_pass, tiny_model
from fractal_opt.tower.plan import ApplicationPlan, Plan, SchedulingPlan
from fractal_opt.workloads.workload import Workload

NEW = 12
PASSES = (MaxNewTokens, Decoding, PromptBudget, ResponseCache, PromptLookup, AssistedDecoding)



@pytest.fixture(scope="module")
def requests():
    """One short and one long (~1000-token) prompt from the default suite."""
    reqs = Workload().requests()
    return [reqs[0], reqs[3]]


@pytest.fixture(scope="module")
def greedy(lively_dir, requests):
    """Greedy outputs of the plain plan on the lively tiny model."""
    return Engine.build(Plan(source=str(lively_dir)), progress=quiet).serve(requests, max_new_tokens=NEW)


def build(model_dir, **app) -> Engine:
    return Engine.build(Plan(source=str(model_dir), application=ApplicationPlan(**app)), progress=quiet)


# --------------------------------------------------------------------------- the passes as plan arithmetic


@pytest.mark.parametrize("cls", PASSES, ids=lambda c: c.name)
def test_pass_contract(cls):
    """Every application pass keeps the pass contract (defaults, frozen, YAML round-trip, own section only)."""
    check_pass(cls)


def test_invalid_parameters_name_the_field():
    """Bad values fail at construction with the parameter and the value."""
    with pytest.raises(RecipeError, match="num_beams"):
        Decoding(strategy="beam", num_beams=1)
    with pytest.raises(RecipeError, match="min_p"):
        Decoding(strategy="sample", min_p=1.5)
    with pytest.raises(RecipeError, match="stop"):
        MaxNewTokens(stop=("",))
    with pytest.raises(RecipeError, match="strategy"):
        PromptBudget.from_params({"strategy": "head_tails"})
    with pytest.raises(RecipeError, match="ttl_s"):
        ResponseCache(ttl_s=0)


def test_decoding_apply_sets_one_strategy():
    """Greedy clears sampling parameters; beam sets num_beams; sample keeps its parameters."""
    plan = Plan(source="x")
    sampled = Decoding(strategy="sample", temperature=0.7, top_k=20, min_p=0.05).apply(plan)
    assert sampled.application.do_sample and sampled.application.min_p == 0.05 and sampled.application.num_beams == 1
    back = Decoding(strategy="greedy", repetition_penalty=1.2).apply(sampled)
    assert not back.application.do_sample and back.application.top_k is None and back.application.min_p is None
    assert back.application.repetition_penalty == 1.2
    assert Decoding(strategy="beam", num_beams=3).apply(plan).application.num_beams == 3


def test_generate_kwargs_carry_the_application_plan():
    """The plan's fields reach generate(): stops with the tokenizer, beams, n-gram blocking, prompt lookup, min_p."""

    class Tok:
        pad_token_id = 0

    tok = Tok()
    app = ApplicationPlan(stop=("\n\n",), num_beams=3, no_repeat_ngram_size=3, prompt_lookup_tokens=7)
    kw = generate_kwargs(Plan(source="x", application=app), tok, budget=5)
    assert kw["stop_strings"] == ["\n\n"] and kw["tokenizer"] is tok
    assert kw["num_beams"] == 3 and kw["no_repeat_ngram_size"] == 3 and kw["prompt_lookup_num_tokens"] == 7
    sampled = generate_kwargs(Plan(source="x", application=ApplicationPlan(do_sample=True, min_p=0.1)), tok, budget=5)
    assert sampled["min_p"] == 0.1
    plain = generate_kwargs(Plan(source="x"), tok, budget=5)
    assert not {"stop_strings", "num_beams", "prompt_lookup_num_tokens", "assistant_model"} & set(plain)


def test_speculation_checks_refuse_batches_beams_and_each_other(machine, tiny_dir):
    """Prompt lookup and assisted decoding refuse batched or beam plans, and each other."""
    batched = Plan(source="x", scheduling=SchedulingPlan(batching="static", batch_size=4))
    assert "batch size 1" in PromptLookup().check(batched, machine)
    beams = Plan(source="x", application=ApplicationPlan(num_beams=4))
    assert "beam" in PromptLookup().check(beams, machine)
    assert PromptLookup().check(Plan(source="x"), machine) is None
    with_lookup = PromptLookup().apply(Plan(source="x"))
    assert "prompt lookup" in AssistedDecoding(draft=str(tiny_dir)).check(with_lookup, machine)
    assert "speculative" in Decoding(strategy="beam").check(with_lookup, machine)


def test_assisted_decoding_check_needs_a_local_draft(machine, tiny_dir, tmp_path):
    """No draft, a missing path, a hub id, or the main model itself: each refused with the reason."""
    plan = Plan(source="main")
    assert "no draft model" in AssistedDecoding().check(plan, machine)
    assert "does not exist" in AssistedDecoding(draft=str(tmp_path / "nope")).check(plan, machine)
    assert "never downloads" in AssistedDecoding(draft="HuggingFaceTB/SmolLM2-135M").check(plan, machine)
    assert "main model itself" in AssistedDecoding(draft=str(tiny_dir)).check(Plan(source=str(tiny_dir)), machine)
    assert AssistedDecoding(draft=str(tiny_dir)).check(plan, machine) is None


# --------------------------------------------------------------------------- served on the tiny model


def test_reference_outputs_vary(greedy):
    """The lively model's greedy outputs are real sequences (so equality tests below mean something)."""
    assert all(len(set(g.token_ids)) > 3 for g in greedy)


def test_stop_sequence_ends_generation_early(lively_dir, greedy, requests):
    """A stop sequence taken from the greedy answer ends generation there; the text stops before it."""
    text = greedy[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    gen = build(lively_dir, stop=(stop,)).serve(requests[:1], max_new_tokens=NEW)[0]
    assert gen.new_tokens < NEW and not gen.hit_cap
    assert stop not in gen.text and text.startswith(gen.text)


def test_cap_is_reported_as_hit_cap(lively_dir, requests):
    """Requests stopped by the cap are counted in hit_cap."""
    engine = build(lively_dir, max_new_tokens=3)
    m = measure(engine, Workload(suite="default", limit=2, max_new_tokens=NEW, repeats=1, warmup=0))
    assert m.summary()["hit_cap"] == 1.0 and m.summary()["new_tokens"] == 3


def test_beam_search_is_timed_end_to_end(lively_dir, requests):
    """Beam search cannot stream: the measurement keeps e2e latency and reports no TTFT or decode rate."""
    engine = build(lively_dir, num_beams=3)
    m = measure(engine, Workload(suite="default", limit=2, max_new_tokens=6, repeats=1, warmup=0))
    summary = m.summary()
    assert summary["e2e_ms"] > 0 and summary["ttft_ms"] is None and summary["decode_tokens_per_s"] is None
    assert all(s.new_tokens > 0 for s in m.samples)


def test_sampling_is_reproducible_with_the_seed(lively_dir, requests):
    """Sampled decoding gives the same output for the same seed, and (here) another for another seed."""
    engine = build(lively_dir, do_sample=True, temperature=1.5, top_k=50, min_p=0.01)
    a = engine.serve(requests[:1], max_new_tokens=NEW, seed=1)[0].token_ids
    b = engine.serve(requests[:1], max_new_tokens=NEW, seed=1)[0].token_ids
    c = engine.serve(requests[:1], max_new_tokens=NEW, seed=2)[0].token_ids
    assert a == b and a != c


def test_no_repeat_ngram_blocks_repeats(tiny_dir, requests):
    """no_repeat_ngram_size=1 forbids any repeated token (the plain tiny model repeats one token forever)."""
    plain = build(tiny_dir).serve(requests[:1], max_new_tokens=8)[0].token_ids
    blocked = build(tiny_dir, no_repeat_ngram_size=1).serve(requests[:1], max_new_tokens=8)[0].token_ids
    assert len(set(plain)) < len(plain) and len(set(blocked)) == len(blocked)


def test_prompt_lookup_keeps_greedy_output_and_counts_every_token(lively_dir, greedy, requests):
    """Prompt-lookup speculation changes no greedy token, and every token gets a clock reading."""
    gens = build(lively_dir, prompt_lookup_tokens=5).serve(requests, max_new_tokens=NEW)
    assert [g.token_ids for g in gens] == [g.token_ids for g in greedy]
    assert all(len(g.token_times) == g.new_tokens for g in gens)


def test_token_clock_counts_speculative_bursts():
    """A [1, k] put (k accepted tokens at once) counts k tokens; a plain [batch] step counts one."""
    clock = TokenClock()
    clock.put(torch.zeros(1, 9, dtype=torch.long))  # the prompt
    clock.put(torch.zeros(1, dtype=torch.long))
    clock.put(torch.zeros(1, 4, dtype=torch.long))
    clock.put(torch.zeros(3, dtype=torch.long))  # one step of a batch of 3
    assert len(clock.token_times) == 1 + 4 + 1


def test_assisted_decoding_with_a_small_draft(lively_dir, greedy, requests, tmp_path_factory):
    """A 1-layer draft with the same tokenizer leaves greedy output unchanged; another vocabulary is refused."""
    draft = tiny_model(tmp_path_factory.mktemp("draft") / "m", hidden_size=64, layers=1)
    gens = build(lively_dir, draft=str(draft), draft_tokens=3).serve(requests, max_new_tokens=NEW)
    assert [g.token_ids for g in gens] == [g.token_ids for g in greedy]
    other = tiny_model(tmp_path_factory.mktemp("other") / "m", hidden_size=64, layers=1, vocab_size=300)
    with pytest.raises(EngineError, match="vocabulary"):
        build(lively_dir, draft=str(other))


def test_prompt_budget_trims_and_reports_saved_tokens(tiny_dir, requests):
    """A head_tail budget shortens the long prompt to the budget and reports what it saved."""
    plain = build(tiny_dir).serve(requests, max_new_tokens=2)
    trimmed = build(tiny_dir, prompt_budget=200, prompt_strategy="head_tail").serve(requests, max_new_tokens=2)
    short, long = trimmed
    assert short.prompt_tokens == plain[0].prompt_tokens and short.prompt_tokens_saved == 0
    assert long.prompt_tokens <= 200 and long.prompt_tokens_saved == plain[1].prompt_tokens - long.prompt_tokens > 0
    assert Sample.from_generation(long).prompt_tokens_saved == long.prompt_tokens_saved


def test_drop_chunks_on_the_rag_suite(tiny_dir):
    """drop_chunks removes retrieved passages from rag prompts and keeps the question."""
    engine = build(tiny_dir, prompt_budget=400, prompt_strategy="drop_chunks")
    request = Workload(suite="rag").requests()[0]
    fitted = engine.app.fit(request)
    content = fitted.messages[-1][1]
    assert engine.app.saved[request.id] > 0 and "[1]" in content and "[4]" not in content
    assert "Question: When did the Millbrook River Bridge open?" in content


# --------------------------------------------------------------------------- judged by the pipeline


def test_cap_that_cuts_needed_answers_is_rolled_back(lively_dir, requests, small_recipe, tmp_path):
    """A token cap that truncates the answers an eval set needs trips the accuracy guard and is rolled back."""
    engine = build(lively_dir)
    prompts = [r.messages[-1][1] for r in Workload(suite="default", limit=3).requests()]
    answers = [engine.generate(p, max_new_tokens=12) for p in prompts]
    # Each answer's second half is what a 12-token answer says and a 3-token one cannot.
    items = [{"prompt": p, "answer": a[len(a) // 2 :], "match": "contains"} for p, a in zip(prompts, answers)]
    eval_path = tmp_path / "needs-12-tokens.yaml"
    eval_path.write_text(yaml.safe_dump({"name": "needs-12-tokens", "items": items}), encoding="utf-8")
    # 3 rounds and up: the cap must beat its threshold before its quality is scored (speed first)
    recipe = small_recipe(lively_dir, max_new_tokens=12, repeats=3, max_repeats=6, policy={"guards": {"ttft_ms": None}}, passes={"application": [{"max_new_tokens": {"limit": 3}}]})
    recipe["quality"].update(eval=str(eval_path), eval_max_new_tokens=12)
    result = Pipeline(recipe, progress=False).run()
    (step,) = result.trace.steps
    assert result.trace.baseline.value("accuracy") == 1.0
    assert step.status == "rolled_back" and "accuracy" in step.reason, step.reason
    assert step.value("accuracy") < 1.0 and step.metrics["hit_cap"] == 1.0
    assert "hit cap" in result.to_markdown()


@pytest.mark.parametrize("name", ["rag", "chatbot"])
def test_application_recipes_validate(name):
    """recipes/rag.yaml and recipes/chatbot.yaml load, and both try prompt lookup on their own suite."""
    from pathlib import Path

    recipe = load_recipe(Path(__file__).parent.parent.parent / "recipes" / f"{name}.yaml", check_model=False)
    assert "prompt_lookup" in [p.name for p in recipe.passes]
    assert recipe.workload.suite == {"rag": "rag", "chatbot": "chat"}[name]
    assert recipe.workload.requests()
