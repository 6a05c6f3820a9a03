"""Targets: validated in the recipe, the gap shown per step, --stop-at-target, the binding limit named."""

from __future__ import annotations

import json

import pytest
from conftest import small_recipe_dict

from fractal_opt.language.recipe import load_recipe
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.pipeline.targets import binding_limit, gaps, parse_targets
from fractal_opt.testing import LLAMA_SHAPE, FakeEngine, cpu_machine, fake_model_folder

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=12e9, copy_bandwidth_bytes_per_s=12e9, peak_flops={"float32": 1e11})
LLAMA = LLAMA_SHAPE


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory):
    return fake_model_folder(tmp_path_factory.mktemp("fake-targets") / "model", LLAMA)


def _run(recipe, out=None, *, stop_at_target=False, **fake):
    recipe = load_recipe(recipe, check_model=False)  # the fake model folder holds a config only
    return Pipeline(recipe, out_dir=out, progress=False, machine=cpu_machine(), build=FakeEngine.factory(**fake), refuse=FakeEngine.refuse,
                    limits=LIMITS, stop_at_target=stop_at_target).run()


def test_direction_per_metric():
    """Higher is better for tokens/s, lower for latency and memory: the gap reads both ways."""
    t = parse_targets({"decode_tokens_per_s": 30, "ttft_ms_p90": 800, "peak_memory_mb": 8000})
    g = gaps(t, {"decode_tokens_per_s": 7.9, "ttft_ms_p90": 1600.0, "peak_memory_mb": 4000.0})
    assert g["decode_tokens_per_s"]["text"] == "7.9 vs 30: 3.8x short" and not g["decode_tokens_per_s"]["met"]
    assert g["ttft_ms_p90"]["text"] == "1600 vs 800: 2.0x over" and not g["ttft_ms_p90"]["met"]
    assert g["peak_memory_mb"]["met"] and g["peak_memory_mb"]["ratio"] == 2.0


def test_unmeasured_metric_is_not_met():
    """A target whose metric the run did not measure is not met, and the gap says 'not measured'."""
    g = gaps(parse_targets({"ttft_ms_p90": 800}), {"decode_tokens_per_s": 10})
    assert not g["ttft_ms_p90"]["met"] and "not measured" in g["ttft_ms_p90"]["text"]


# ---------------------------------------------------------------------------- the binding limit

def test_bandwidth_binds_with_numbers():
    """30 tokens/s of a plan that reads 0.53 GB per step needs 16 GB/s; a 12 GB/s machine cannot give it."""
    metrics = {"decode_tokens_per_s": 20.0, "roofline": {"bytes_per_decode_step": 0.533e9, "bytes_per_token": 0.533e9, "bandwidth_fraction": 0.9, "batch": 1}}
    text = binding_limit("decode_tokens_per_s", 30, metrics, LIMITS.to_dict(), dtype="float32")
    assert "30 tokens/s needs 16.0 GB/s" in text and "this machine gives 12.0 GB/s" in text
    assert "fewer bytes per token" in text and "int8" in text


def test_overhead_binds_when_the_bytes_allow_it():
    """When the bytes per step would allow the target at the measured bandwidth, the binding limit is overhead, with the share used."""
    metrics = {"decode_tokens_per_s": 20.0, "roofline": {"bytes_per_decode_step": 0.1e9, "bandwidth_fraction": 0.17}}
    text = binding_limit("decode_tokens_per_s", 30, metrics, LIMITS.to_dict())
    assert "needs 3.0 GB/s" in text and "overhead binds" in text and "17% of it used" in text


def test_compute_binds_a_ttft_target():
    """A TTFT target under the prefill FLOPs' floor at the machine's peak is bound by compute: the floor is named."""
    metrics = {"ttft_ms_p90": 900.0, "roofline": {"prefill_flops": 50e9, "mean_context_tokens": 200}}
    text = binding_limit("ttft_ms_p90", 300, metrics, LIMITS.to_dict())
    assert "500 ms at best" in text and "over the 300 ms target" in text


# ---------------------------------------------------------------------------- in a run

def test_gap_per_step_and_final(fake_model, tmp_path):
    """The baseline shows the gap, each measured step what is left, the report which were met and why not."""
    recipe = small_recipe_dict(fake_model, max_new_tokens=8, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}]})
    recipe["targets"] = {"decode_tokens_per_s": 1500, "throughput_tokens_per_s": 1e7}
    result = _run(recipe, tmp_path, speed={"hardware.dtype": {"bfloat16": 2.0}})
    base = result.trace.baseline.metrics["targets"]
    assert not base["decode_tokens_per_s"]["met"] and "short" in base["decode_tokens_per_s"]["text"]
    (step,) = result.trace.steps
    assert step.status == "kept" and step.reason.startswith("decode_tokens_per_s paired estimate +100.0% [95%: +100.0%, +100.0%], medians 1000.0 -> 2000.0"), step.reason
    assert step.metrics["targets"]["decode_tokens_per_s"]["met"]
    final = result.trace.final["targets"]
    assert final["decode_tokens_per_s"]["met"] and not final["throughput_tokens_per_s"]["met"]
    # The throughput target is out of reach: the binding limit is named with numbers.
    binding = final["throughput_tokens_per_s"]["binding"]
    assert "GB/s" in binding and "this machine gives 12.0 GB/s" in binding
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "Targets met: decode_tokens_per_s; not met: throughput_tokens_per_s." in report
    assert "| baseline | baseline |" in report
    assert "Targets met" in result.to_text()
    saved = json.loads((tmp_path / "trace.json").read_text(encoding="utf-8"))
    assert saved["final"]["targets"]["decode_tokens_per_s"]["met"]


def test_stop_at_target_skips_the_rest(fake_model):
    """Once every target is met, the remaining steps are recorded as skipped with that reason."""
    recipe = small_recipe_dict(fake_model, max_new_tokens=8, policy={"guards": {"ttft_ms": None}},
                               passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}], "application": [{"max_new_tokens": {"limit": 4}}]})
    recipe["targets"] = {"decode_tokens_per_s": 1500}
    build = {"speed": {"hardware.dtype": {"bfloat16": 2.0}}}
    stopped = _run(recipe, stop_at_target=True, **build)
    assert [s.status for s in stopped.trace.steps] == ["kept", "skipped"]
    assert stopped.trace.steps[0].reason.startswith("decode_tokens_per_s paired estimate +100.0% [95%: +100.0%, +100.0%], medians 1000.0 -> 2000.0")
    assert stopped.trace.steps[1].reason == "stop-at-target: every target is met (decode_tokens_per_s 2000 vs 1500: met (1.3x))"
    # Without the flag the same run goes on to the next pass.
    full = _run(recipe, **build)
    assert [s.status for s in full.trace.steps] == ["kept", "kept"], [s.reason for s in full.trace.steps]
    assert full.trace.steps[1].reason.startswith("e2e_ms paired estimate -50.0% [95%: -50.0%, -50.0%], medians 4 -> 2"), full.trace.steps[1].reason


def test_stop_at_target_does_not_stop_an_unmet_run(fake_model):
    """--stop-at-target with a target out of reach runs every pass, and the final gap names what binds."""
    recipe = small_recipe_dict(fake_model, max_new_tokens=8, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}]})
    recipe["targets"] = {"decode_tokens_per_s": 1e6}
    result = _run(recipe, stop_at_target=True, speed={"hardware.dtype": {"bfloat16": 2.0}})
    assert result.trace.steps[0].status == "kept"
    assert "fewer bytes per token" in result.trace.final["targets"]["decode_tokens_per_s"]["binding"]


def test_no_targets_no_lines(fake_model):
    """A recipe without targets writes no targets field and no Targets line."""
    result = _run(small_recipe_dict(fake_model, passes={}))
    assert "targets" not in result.trace.final and "Targets" not in result.to_markdown()
