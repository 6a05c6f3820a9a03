"""Shared fixtures: a tiny offline model, a hand-made CPU machine, and small recipes.

Every model test runs torch single-threaded. On a shared 2-core machine, torch's default of two
OpenMP threads spin-waits against other processes and makes a 4-layer model up to 50x slower
(measured: 0.85 s vs 0.016 s per 67-token forward); one thread keeps the suite fast and its
timings steady. Tests that need another thread count set it through a plan and ``runtime()``.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fractal_opt.testing import cpu_machine, tiny_model

# The tiny model: 4 layers of width 256, random weights, vocab 512 (seconds to build and run).
TINY_HIDDEN = 256
TINY_LAYERS = 4
# Scale of the "lively" copy's weights. The tiny model's initial weights (std 0.02) are so small
# that the residual stream is its input embedding, and greedy decoding repeats one token forever;
# x4 makes each next token depend on the context, so path-equivalence tests compare real sequences.
LIVELY_SCALE = 4.0


def quiet(message: str) -> None:
    """A progress callback that prints nothing (engines and pipelines take one)."""


class PadTokenizer:
    """The one tokenizer attribute generate_kwargs reads (the pad id), for plan-only tests."""

    pad_token_id = 0


@pytest.fixture(scope="session", autouse=True)
def _single_thread_torch():
    """Run torch on one intra-op thread for the whole session (see the module docstring)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_FROZEN_AT = [0]  # how many modules were imported at the last gc.freeze()


@pytest.fixture(autouse=True)
def _freeze_what_imports_left():
    """After a test that imported a large library (torch, transformers, xllamacpp ...), move every
    object alive then out of the cyclic collector's sight (``gc.freeze``).

    The runtimes and the step measurement call ``gc.collect()`` whenever they release a model; with
    transformers' modules on the heap each call took 0.15-0.5 s, about a third of a fake-engine
    pipeline test (measured: 43 s -> 32 s for tests/advice, test_noise and four pipeline test files, load ~4 on 2 cores). A full
    collection runs first, so no garbage is frozen; objects that die later are freed as usual.
    """
    yield
    if len(sys.modules) > _FROZEN_AT[0] + 200:  # 200 modules: a large import, not a test's own helpers
        gc.collect()
        gc.freeze()
        _FROZEN_AT[0] = len(sys.modules)


@pytest.fixture(scope="session", autouse=True)
def _short_load_reading():
    """Every run reads the machine's load for 0.05 s instead of 1 s (busy.snapshot's default).

    The reading only words the report's busy warning; at 1 s it was about a third of a fake-engine
    run's time. tests/measure/test_busy.py, which tests that reading, puts the real one back.
    """
    from fractal_opt.measure import busy
    from fractal_opt.pipeline import step_measurement

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_measurement, "snapshot", lambda: busy.snapshot(0.05))
        yield


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory) -> Path:
    """A model folder a recipe accepts, holding a config only: the fake engines never read it."""
    path = tmp_path_factory.mktemp("fake") / "model"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "fake"}', encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A random-weight Llama folder (4 layers, hidden 256) with a chat-template tokenizer."""
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=TINY_HIDDEN, layers=TINY_LAYERS)


@pytest.fixture(scope="session")
def lively_dir(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model with every weight matrix scaled by LIVELY_SCALE: greedy outputs vary token to token."""
    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("lively") / "model"
    shutil.copytree(tiny_dir, target)
    weights = load_file(target / "model.safetensors")
    scaled = {name: (t * LIVELY_SCALE if t.dim() == 2 else t).contiguous() for name, t in weights.items()}
    save_file(scaled, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.fixture
def machine():
    """A hand-made 2-core CPU machine with torchao and bitsandbytes installed (no probing)."""
    return cpu_machine()


@pytest.fixture(scope="session")
def mixed_suite(tmp_path_factory) -> Path:
    """A suite file with one short and one long prompt, both copied from the packaged default suite."""
    from importlib import resources

    data = yaml.safe_load((resources.files("fractal_opt") / "data" / "suites" / "default.yaml").read_text(encoding="utf-8"))
    by_id = {r["id"]: r for r in data["requests"]}
    path = tmp_path_factory.mktemp("suites") / "short-and-long.yaml"
    path.write_text(yaml.safe_dump({"name": "short-and-long", "requests": [by_id["short-1"], by_id["long-1"]]}), encoding="utf-8")
    return path


def small_recipe_dict(model: str | Path, *, passes: dict[str, list] | None = None, policy: dict | None = None, **workload: Any) -> dict[str, Any]:
    """A recipe dict for the tiny model: 2 requests, 8 new tokens, 2 repeats after 1 warm-up."""
    wl = {"suite": "default", "limit": 2, "max_new_tokens": 8, "repeats": 2, "warmup": 1}
    wl.update(workload)
    # No eval set unless a test asks (quality: {eval: auto}): the packaged 45 questions, served by a
    # fake engine at its per-token pace in every step, were most of the unit suite's wall time.
    data: dict[str, Any] = {"name": "tiny-test", "model": str(model), "workload": wl, "quality": {"reference_tokens": 64, "eval": None}}
    if policy is not None:
        data["policy"] = policy
    data["passes"] = passes or {}
    return data


@pytest.fixture(scope="session")
def small_recipe():
    """Factory: ``small_recipe(model, passes=..., policy=..., **workload)`` -> a recipe dict."""
    return small_recipe_dict


@contextlib.contextmanager
def served_app(engine: Any, *, limits: Any = None, **app_kwargs: Any) -> Iterator[tuple[str, int, Any]]:
    """``fractal-opt serve``'s app on ``engine``, under uvicorn in a thread of this process on a free
    port, with serve's connection limits (``limits``: an HttpLimits, default serve's own); yields
    ``(host, port, app)`` and stops the server after."""
    import socket
    import threading
    import time

    import uvicorn

    from fractal_opt.serving.http import create_app
    from fractal_opt.serving.http_limits import HttpLimits
    from fractal_opt.serving.http_protocol import uvicorn_options

    limits = limits or HttpLimits()
    app = create_app(engine, model_name="tiny", limits=limits, **app_kwargs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_options(limits)))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    while not web.started and thread.is_alive():
        time.sleep(0.01)
    try:
        yield "127.0.0.1", port, app
    finally:
        web.should_exit = True
        thread.join(10)
