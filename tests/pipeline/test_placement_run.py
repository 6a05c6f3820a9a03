"""A recipe with placement passes runs through the pipeline like any other: the replicas step is
built, measured and judged (its verdict and numbers in the trace), and a split the runtime does not
offer is skipped with the runtime's table's reason, before any round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fractal_opt
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.runtimes import RUNTIMES, Capabilities, Runtimes, register
from fractal_opt.testing import ServingFakeEngine, fake_model_folder

NAME = "placed_fake"
LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})


class BaselineEngine(ServingFakeEngine):
    @classmethod
    def build(cls, plan, *, machine=None, progress=print, max_new_tokens=None):
        return cls.factory(per_token_ms=4.0)(plan, machine=machine, max_new_tokens=max_new_tokens)


class PlacedEngine(ServingFakeEngine):
    """Two replicas serve twice as fast as one (the fake stands for copies on cores of their own)."""

    @classmethod
    def build(cls, plan, *, machine=None, progress=print, max_new_tokens=None):
        return cls.factory(per_token_ms=2.0 / plan.scheduling.replicas)(plan, machine=machine, max_new_tokens=max_new_tokens)

    @classmethod
    def refuse(cls, plan):
        return None


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> dict:
    import fractal_opt.pipeline.runner as runner

    tmp_path = tmp_path_factory.mktemp("placement-run")
    recipe = {"name": "placement", "model": str(fake_model_folder(tmp_path / "model")),
              "workload": {"suite": "default", "limit": 2, "max_new_tokens": 6, "repeats": 2, "max_repeats": 2, "warmup": 0},
              "quality": {"reference_tokens": 32},
              "passes": {"hardware": [{"runtime": {"backend": NAME}}, {"split": {"rpc_workers": 2}}], "scheduling": [{"replicas": {"count": 2, "cores": 1}}]}}
    caps = Capabilities(name=NAME, summary="a runtime offering replicas only", engine=PlacedEngine, placements=frozenset({"replicas"}))
    mine = Runtimes(Capabilities(name="transformers", summary="the baseline, faked", engine=BaselineEngine), caps)
    register(caps)  # the passes read the process's registry (the runtime pass's backend, the placement checks)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(runner, "probe_limits", lambda *a, **k: LIMITS)
            fractal_opt.optimize(recipe, out=tmp_path / "out", progress=False, runtimes=mine)
    finally:
        RUNTIMES.unregister(NAME)
    return json.loads(Path(tmp_path / "out" / "trace.json").read_text())


def test_the_replicas_step_is_measured_and_judged_like_any_step(trace):
    """The replicas pass is a step with a verdict and measured numbers, judged on the scheduling layer's objective.

    Whether it is kept depends on the rounds' noise (two rounds on a shared machine); that it was
    measured against the previous plan and judged on throughput does not."""
    step = next(s for s in trace["steps"] if s["pass"] == "replicas")
    assert step["status"] in ("kept", "rolled_back"), step["reason"]
    assert step["plan"]["scheduling"]["replicas"] == 2 and step["plan"]["scheduling"]["replica_cores"] == 1
    assert step["metrics"]["throughput_tokens_per_s"] > 0 and "throughput_tokens_per_s" in step["changes"]
    assert step["reason"].split(":")[0] in ("no change beyond noise", "throughput_tokens_per_s paired estimate") or "throughput_tokens_per_s" in step["reason"]


def test_a_placement_the_runtime_does_not_offer_is_skipped_with_its_reason(trace):
    step = next(s for s in trace["steps"] if s["pass"] == "split")
    assert step["status"] == "skipped" and "does not offer rpc" in step["reason"] and "['replicas']" in step["reason"]
    assert not step["metrics"], "a refused placement is never measured"
