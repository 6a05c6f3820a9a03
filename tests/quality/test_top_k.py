"""Quality probes on a runtime that gives only top-k log-probabilities (llama.cpp, vLLM), or none."""

from __future__ import annotations

import math

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.engine.protocol import Engine
from fractal_opt.language.policy import DEFAULT_GUARDS, Policy
from fractal_opt.quality.probes import QualityConfig, build_reference, model_probes
from fractal_opt.quality.topk import flipped, kl_lower_bound
from fractal_opt.testing import FakeEngine
from fractal_opt.tower.passes import Layer
from fractal_opt.tower.plan import Plan

# 512 tokens: more than the baseline's top 256, so both sides know only part of the distribution.
VOCAB = 512
DRIFTED = Plan(source="fake").replace_section("hardware", dtype="bfloat16")


def _engine(logprobs: str = "full", *, drift: float = 0.5, plan: Plan = DRIFTED) -> FakeEngine:
    build = FakeEngine.factory(vocab_size=VOCAB, drift={"hardware.dtype": {"bfloat16": drift}}, logprobs=logprobs)
    return build(plan, progress=lambda _: None)


def _reference(*, k: int, positions: int = 10_000):
    """The undrifted fake's reference on 128 tokens; a top-k candidate scores ``positions`` of its 127."""
    return build_reference(_engine(plan=Plan(source="fake")), {}, QualityConfig(reference_tokens=128, top_k=k, top_k_positions=positions))


def test_bound_never_exceeds_the_true_kl_on_random_distributions():
    """kl_lower_bound <= the exact KL for random pairs, whatever the baseline's K and the candidate's k; exact when all is known."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        p = torch.log_softmax(torch.randn(64, generator=gen) * 2, -1).double()
        q = torch.log_softmax(torch.randn(64, generator=gen) * 2, -1).double()
        true_kl = (p.exp() * (p - q)).sum().item()
        big_k, small_k = 1 + trial % 64, 1 + (trial * 7) % 64
        base = dict(zip(p.topk(big_k).indices.tolist(), p.topk(big_k).values.tolist()))
        cand = dict(zip(q.topk(small_k).indices.tolist(), q.topk(small_k).values.tolist()))
        assert 0.0 <= kl_lower_bound(base, cand) <= true_kl + 1e-9
    assert kl_lower_bound(dict(enumerate(p.tolist())), dict(enumerate(q.tolist()))) == pytest.approx(true_kl, rel=1e-9)


def test_bound_tightens_as_k_grows():
    """More of the candidate's tokens (a finer partition) never lowers the bound (data-processing inequality)."""
    import torch

    p = torch.log_softmax(torch.randn(64, generator=torch.Generator().manual_seed(1)), -1).double()
    q = torch.log_softmax(torch.randn(64, generator=torch.Generator().manual_seed(2)), -1).double()
    base = dict(enumerate(p.tolist()))
    order = q.argsort(descending=True).tolist()
    bounds = [kl_lower_bound(base, {t: q[t].item() for t in order[:k]}) for k in (1, 5, 20, 64)]
    assert bounds == sorted(bounds) and bounds[0] < bounds[-1]


def test_top_k_bound_is_below_the_full_kl_and_flips_match():
    """On the same distributions the top-k probe's KL numbers are <= the full ones (and clearly below at k=8); the flip rate is identical."""
    reference = _reference(k=8)
    full = model_probes(reference, _engine("full"))
    top = model_probes(reference, _engine("top-k"))
    for key in ("kl_mean", "kl_p99", "kl_max"):
        assert 0.0 < top[key] <= full[key] + 1e-6, key
    assert top["kl_mean"] < 0.9 * full["kl_mean"]  # k=8 of 512 tokens leaves a real gap: the bound is a bound
    assert top["top1_flip"] == full["top1_flip"] > 0.0


def test_whole_vocabulary_as_top_k_gives_the_full_numbers():
    """With k = the vocabulary, the bound is the full KL and the perplexity ratio is the full one."""
    reference = _reference(k=VOCAB)
    full = model_probes(reference, _engine("full"))
    top = model_probes(reference, _engine("top-k"))
    for key in ("kl_mean", "kl_max", "top1_flip", "ppl_ratio", "ppl_ratio_low", "ppl_ratio_high"):
        assert top[key] == pytest.approx(full[key], rel=1e-3, abs=1e-5), key


def test_quality_says_which_method():
    """The quality dict names the method: full, the top-k bound with its k and positions, and why perplexity is missing."""
    reference = _reference(k=8, positions=64)
    assert model_probes(reference, _engine("full"))["kl_method"] == "full"
    top = model_probes(reference, _engine("top-k"))
    assert top["kl_method"] == "top-k lower bound (k=8, first 64 positions)"
    assert top["ppl_ratio"] is None and top["ppl_method"].startswith("unavailable: the actual next token is outside the candidate's top-8 at ")


def test_no_log_probabilities_leaves_the_numbers_unmeasured():
    """A runtime that gives neither full nor top-k log-probabilities gets None numbers and an 'unavailable: <why>' method."""
    probes = model_probes(_reference(k=8), _engine("none"))
    assert probes["kl_mean"] is None and probes["top1_flip"] is None and probes["ppl_ratio"] is None
    assert probes["kl_method"] == "unavailable: FakeEngine(logprobs='none') gives no log-probabilities"


def test_kl_guard_trips_on_the_bound():
    """A top-k bound is unknown to the default kl_mean guard; accepted, a bound already above the limit still trips it."""
    probes = model_probes(_reference(k=20), _engine("top-k", drift=3.0))
    assert probes["kl_mean"] > DEFAULT_GUARDS["kl_mean"]["max"]
    verdict = Policy().judge(Layer.HARDWARE, {"decode_tokens_per_s": 100.0}, {"decode_tokens_per_s": 200.0, **probes},
                             {"decode_tokens_per_s": 1.0}, {"decode_tokens_per_s": 0.05})
    assert not verdict.kept and "guard kl_mean unknown: only a lower bound" in verdict.reason
    accepted = Policy(guards={"kl_mean": {"accept_unknown": True}}).judge(
        Layer.HARDWARE, {"decode_tokens_per_s": 100.0}, {"decode_tokens_per_s": 200.0, **probes}, {"decode_tokens_per_s": 1.0}, {"decode_tokens_per_s": 0.05})
    assert not accepted.kept and "guard kl_mean max 0.05 tripped: its lower bound" in accepted.reason


def test_protocol_default_top_logprobs_is_the_top_of_the_full_distributions():
    """Engine.top_logprobs (the protocol default) gives, per position, the k largest of next_token_logprobs, in order."""
    engine, ids = _engine("full"), [3, 70, 200, 5]
    rows = Engine.top_logprobs(engine, ids, k=4)
    full = next(engine.next_token_logprobs(ids))
    assert len(rows) == len(ids)
    for row, lp in zip(rows, full):
        assert list(row) == lp.topk(4).indices.tolist()
        assert all(math.isclose(v, lp[t].item(), rel_tol=1e-6) for t, v in row.items())


def test_a_tie_for_first_is_no_flip():
    """The baseline's token tied for first in the candidate's row is no flip; below the top, or missing from the row, it is one."""
    assert not flipped({7: -0.69, 3: -0.69, 5: -3.0}, 3)
    assert flipped({7: -0.5, 3: -1.0}, 3) and flipped({7: -0.5, 5: -1.0}, 3)


@pytest.mark.parametrize("key", ["top_k", "top_k_positions"])
def test_top_k_settings_are_checked(key):
    """quality.top_k and quality.top_k_positions below 1 fail naming the key and the value."""
    with pytest.raises(RecipeError, match=f"'{key}': got 0"):
        QualityConfig(**{key: 0})
