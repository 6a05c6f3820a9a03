"""Quality probes: agreement math, KL against the baseline, and the guard that catches a broken model."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
from conftest import quiet

from fractal_opt.language.policy import DEFAULT_GUARDS, Policy
from fractal_opt.quality.probes import QualityConfig, agreement, build_reference, model_probes
from fractal_opt.runtimes import Engine
from fractal_opt.tower.passes import Layer
from fractal_opt.tower.plan import Plan

BROKEN_WEIGHT = "model.layers.0.mlp.down_proj.weight"



def _ref(outputs: dict[str, list[int]]):
    """agreement() only reads the baseline outputs of a Reference."""
    return SimpleNamespace(outputs=outputs)


def test_agreement_identical_outputs():
    """Identical outputs agree fully (1.0) with no first divergence."""
    result = agreement(_ref({"a": [1, 2, 3], "b": [4, 5]}), {"a": [1, 2, 3], "b": [4, 5]})
    assert result["agreement"] == 1.0 and result["first_divergence"] is None


def test_agreement_is_matching_prefix_share_averaged_over_requests():
    """Agreement is the matching prefix length / baseline length, averaged: (2/4 + 1) / 2 = 0.75."""
    result = agreement(_ref({"a": [1, 2, 3, 4], "b": [7, 8]}), {"a": [1, 2, 9, 4], "b": [7, 8]})
    assert result["agreement"] == pytest.approx(0.75)
    assert result["first_divergence"] == 2


def test_agreement_is_strict_about_early_flips():
    """One flip at the first token scores 0 for that request even if everything after matches."""
    result = agreement(_ref({"a": [1, 2, 3, 4]}), {"a": [9, 2, 3, 4]})
    assert result["agreement"] == 0.0 and result["first_divergence"] == 0


def test_agreement_counts_shorter_and_missing_outputs():
    """A candidate that stops early or has no output for a request does not agree fully."""
    result = agreement(_ref({"a": [1, 2, 3, 4], "b": [5, 6]}), {"a": [1, 2]})
    assert result["agreement"] == pytest.approx((0.5 + 0.0) / 2)
    assert result["first_divergence"] == 0


def test_agreement_longer_candidate_is_not_identical():
    """A candidate that continues past the baseline's end is not counted as identical."""
    result = agreement(_ref({"a": [1, 2]}), {"a": [1, 2, 3]})
    assert result["first_divergence"] == 2


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The tiny model's baseline distributions on 128 tokens of the reference text."""
    engine = Engine.build(Plan(source=str(tiny_dir)), progress=quiet)
    return build_reference(engine, {}, QualityConfig(reference_tokens=128))


def test_reference_scores_requested_tokens(reference):
    """The reference scores the first reference_tokens tokens of the reference text (the recipe's quality setting)."""
    assert reference.token_ids.shape[0] == 128


def test_same_engine_matches_its_reference(tiny_dir, reference):
    """The baseline engine scored against its own reference has KL ~0, no flips and perplexity ratio ~1."""
    engine = Engine.build(Plan(source=str(tiny_dir)), progress=quiet)
    probes = model_probes(reference, engine)
    assert probes["kl_mean"] == pytest.approx(0.0, abs=1e-5)
    assert probes["kl_max"] == pytest.approx(0.0, abs=1e-4)
    assert probes["top1_flip"] == 0.0
    assert probes["ppl_ratio"] == pytest.approx(1.0, abs=1e-3)


def test_bfloat16_stays_under_the_default_guard(tiny_dir, reference):
    """A bfloat16 build moves the distributions a little: KL above 0 but below the default 0.05 guard."""
    engine = Engine.build(Plan(source=str(tiny_dir)).replace_section("hardware", dtype="bfloat16"), progress=quiet)
    kl = model_probes(reference, engine)["kl_mean"]
    assert 0.0 < kl < DEFAULT_GUARDS["kl_mean"]["max"]


@pytest.fixture(scope="module")
def broken_dir(tiny_dir, tmp_path_factory):
    """A copy of the tiny model whose layer-0 MLP output projection holds large random values."""
    import torch
    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("broken") / "model"
    shutil.copytree(tiny_dir, target)
    weights = load_file(target / "model.safetensors")
    shape = weights[BROKEN_WEIGHT].shape
    # std 1.0 is 50x the model's 0.02 init: the layer now swamps the residual stream.
    weights[BROKEN_WEIGHT] = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_randomized_layer_trips_kl_guard(broken_dir, reference):
    """A model with one randomized layer exceeds the default kl_mean guard, and the policy rolls it back naming kl_mean."""
    engine = Engine.build(Plan(source=str(broken_dir)), progress=quiet)
    probes = model_probes(reference, engine)
    limit = DEFAULT_GUARDS["kl_mean"]["max"]
    assert probes["kl_mean"] > limit
    assert probes["top1_flip"] > 0.5
    before = {"decode_tokens_per_s": 100.0, "kl_mean": 0.0}
    after = {"decode_tokens_per_s": 200.0, **probes}
    bands = {"decode_tokens_per_s": 0.05}
    verdict = Policy().judge(Layer.MODEL, before, after, {"decode_tokens_per_s": 1.0}, bands)
    assert not verdict.kept
    assert "kl_mean" in verdict.reason and "tripped" in verdict.reason
