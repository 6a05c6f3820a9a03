"""A runtime that lives only in this test module, registered as a third-party package would
(``fractal_opt.runtimes.register``), runs a recipe end to end: built, measured, judged through
``fractal_opt.optimize``, exported by ``fractal-opt export``, and served by the HTTP app."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import fractal_opt
from fractal_opt.cli import main
from fractal_opt.engine.capabilities import refusals
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.runtimes import RUNTIMES, Capabilities, Refusal, Runtimes, register
from fractal_opt.testing import ServingFakeEngine, fake_model_folder

NAME = "third_party"
SPEED_UP = 3.0  # the third-party engine's tokens come this many times faster than the baseline's
LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
BUILT: list[str] = []  # the runtimes that built an engine, in order
EVICTED: list[set] = []  # the weights keys each eviction kept


class BaselineEngine(ServingFakeEngine):
    """The test registry's baseline runtime: the fake engine at its base speed."""

    @classmethod
    def build(cls, plan, *, machine=None, progress=print, max_new_tokens=None):
        BUILT.append(plan.hardware.runtime)
        return cls.factory(per_token_ms=4.0)(plan, machine=machine, max_new_tokens=max_new_tokens)


class ThirdPartyEngine(ServingFakeEngine):
    """The third-party runtime: the same tokens, SPEED_UP times faster; no beam search."""

    @classmethod
    def build(cls, plan, *, machine=None, progress=print, max_new_tokens=None):
        BUILT.append(plan.hardware.runtime)
        return cls.factory(per_token_ms=4.0 / SPEED_UP)(plan, machine=machine, max_new_tokens=max_new_tokens)

    @classmethod
    def refuse(cls, plan):
        return "; ".join(refusals(CAPS.refusal_rows(), plan)) or None


CAPS = Capabilities(
    name=NAME, summary="a runtime from outside the package", engine=ThirdPartyEngine, export_targets=("generation-config",),
    refuses=(Refusal("application.num_beams", lambda p: p.application.num_beams > 1, "this runtime has no beam search"),),
    evict=EVICTED.append, clear=lambda: EVICTED.append(set()),
)


@pytest.fixture(scope="module")
def third_party() -> Iterator[Capabilities]:
    register(CAPS)
    BUILT.clear()
    EVICTED.clear()
    try:
        yield CAPS
    finally:
        RUNTIMES.unregister(NAME)


@pytest.fixture(scope="module")
def run_dir(third_party, tmp_path_factory) -> Iterator[Path]:
    import fractal_opt.pipeline.runner as runner

    tmp_path = tmp_path_factory.mktemp("third-party")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(runner, "probe_limits", lambda *a, **k: LIMITS)  # no bandwidth probe: the fake engines read no memory
        yield _run(tmp_path)


def _run(tmp_path: Path) -> Path:
    recipe = {"name": "third-party", "model": str(fake_model_folder(tmp_path / "model")),
              "workload": {"suite": "default", "limit": 2, "max_new_tokens": 6, "repeats": 2, "max_repeats": 2, "warmup": 0},
              "quality": {"reference_tokens": 32}, "passes": {"hardware": [{"runtime": {"backend": NAME}}]}}
    # The run's own registry: the baseline's runtime (a fake transformers) and the third-party one.
    mine = Runtimes(Capabilities(name="transformers", summary="the baseline, faked", engine=BaselineEngine), CAPS)
    result = fractal_opt.optimize(recipe, out=tmp_path / "out", progress=False, runtimes=mine)
    assert result.trace.steps[0].status == "kept", result.trace.steps[0].reason
    return tmp_path / "out"


def test_a_registered_runtime_is_built_measured_and_kept(run_dir):
    """The runtime pass to a third-party runtime is measured against the baseline and kept: its
    decode speed-up is the fake's SPEED_UP within the noise, and the final plan names it."""
    trace = json.loads((run_dir / "trace.json").read_text())
    step = trace["steps"][0]
    assert step["status"] == "kept" and step["plan"]["hardware"]["runtime"] == NAME
    assert step["changes"]["decode_tokens_per_s"] == pytest.approx(SPEED_UP - 1, rel=0.35), step["changes"]
    assert trace["final"]["kept"] == ["hardware/runtime"] and trace["final"]["plan"]["hardware"]["runtime"] == NAME
    assert NAME in BUILT and BUILT[0] == "transformers"  # the baseline first, on the registry the run was given
    assert EVICTED, "the run's own registry evicts through the runtime's hook"


def test_the_registered_runtime_is_exported_and_served(run_dir, capsys):
    """`fractal-opt export` names the third-party runtime as the one measured, and the HTTP app
    serves the tuned recipe on it (Engine.from_recipe builds through the process's registry)."""
    from fractal_opt.runtimes import Engine
    from fractal_opt.serving.http import create_app

    assert main(["export", str(run_dir), "--to", "generation-config"]) == 0
    out = capsys.readouterr().out
    assert f"measured on the {NAME} runtime" in out and "on another runtime" not in out  # generation-config is one of its export targets
    engine = Engine.from_recipe(run_dir, progress=lambda m: None)
    assert isinstance(engine, ThirdPartyEngine)
    status, body = _serve_once(create_app(engine, model_name="tuned"))
    assert status == 200 and body["choices"][0]["message"]["content"], body


def test_the_registry_refuses_a_duplicate_and_reads_the_runtime_s_table(third_party):
    """Registering the same name twice is refused naming it; the runtime's refusal rows are what the registry refuses."""
    with pytest.raises(fractal_opt.core.errors.RecipeError, match=f"runtime '{NAME}' is registered already"):
        register(CAPS)
    plan = fractal_opt.Plan(source="m").replace_section("hardware", runtime=NAME)
    assert RUNTIMES.refuse(plan) is None
    assert RUNTIMES.refuse(plan.replace_section("application", num_beams=2)) == "application.num_beams=2: this runtime has no beam search"


def _serve_once(app) -> tuple[int, dict]:
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not web.started and time.monotonic() < deadline:
            time.sleep(0.01)
        body = json.dumps({"model": "tuned", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    finally:
        web.should_exit = True
        thread.join(10)
        app.state.server.close()
