"""The hostile corpus itself, and `fractal-opt serve` holding against it on real runtimes: the tiny
model (transformers, its own tokenizer and chat template) and the llama.cpp runtime with a
llama-server child (the stand-in executable, tests/runtimes/fake_llama_server.py, counting with the
embedded GGUF's tokenizer). Each runs the whole corpus (no 5xx, an answer within 10 s, a normal
request answered after each), then the three rules the issue names with exact numbers: a prompt one
token over the context is a 400 naming both numbers, max_tokens 10^12 a 400 within a second, seed
2^64 a 400. The model-less run of the same corpus is unit-fast: tests/serving/test_http_limits.py.
"""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import served_app

from fractal_opt.engine.protocol import as_request
from fractal_opt.serving import hostile_requests as hostile
from fractal_opt.serving.http_limits import HttpLimits
from fractal_opt.tower.plan import HardwarePlan, Plan

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

LIMITS = HttpLimits(max_body_bytes=1 << 20, header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_s=1.0, max_connections=64)
WAITS = {"body_timeout_s": LIMITS.body_timeout_s, "header_timeout_s": LIMITS.header_timeout_s}
FAKE_LLAMA = Path(__file__).parents[1] / "runtimes" / "fake_llama_server.py"


def test_the_corpus_holds_over_90_named_requests_of_every_kind():
    """Over 90 requests, names unique, none allowed a 5xx, each kind the issue lists present."""
    cases = hostile.corpus(context=4096)
    assert len(cases) >= 90 and len({c.name for c in cases}) == len(cases)
    assert all(status < 500 for c in cases for status in c.allowed)
    names = " ".join(c.name for c in cases)
    for kind in ("max_tokens 1e12", "seed 2^64", "100,000 text parts", "10,000 messages", "malformed JSON", "wrong type", "one header of 64 KiB",
                 "a body one byte over the limit", "Content-Length and Transfer-Encoding"):
        assert kind in names, kind


def test_a_problem_is_a_5xx_an_unexpected_status_or_a_late_answer():
    """problem() flags a 500, a status the case does not allow and an answer past the limit; a right answer is None."""
    case = hostile.Hostile(name="x", raw=b"", allowed=frozenset({400}))
    assert hostile.problem(case, hostile.Outcome(400, 0.1, b"{}")) is None
    assert "500" in hostile.problem(case, hostile.Outcome(500, 0.1, b""))
    assert "expected one of [400]" in hostile.problem(case, hostile.Outcome(200, 0.1, b""))
    assert "over 10 s" in hostile.problem(case, hostile.Outcome(400, 11.0, b""))


def _prompt_of(engine: Any, tokens: int) -> str:
    """A user message whose prompt, as ``engine`` counts it (chat template included), is exactly ``tokens`` long."""
    words = tokens
    for _ in range(50):
        counted = engine.count_prompt(as_request(" a" * words))
        if counted == tokens:
            return " a" * words
        words += tokens - counted
    pytest.fail(f"no prompt of exactly {tokens} tokens found")


def _holds(engine: Any) -> None:
    """The whole corpus against ``engine``'s app, then the three exact rules; a prompt two tokens
    under the context is served, and its usage is the count the bounds used."""
    limit = engine.context_limit()
    with served_app(engine, limits=LIMITS) as (host, port, _):
        assert hostile.check(host, port, hostile.corpus(context=limit.tokens, body_limit=LIMITS.max_body_bytes), waits=WAITS) == []
        over = hostile.send(host, port, hostile.chat(messages=[{"role": "user", "content": _prompt_of(engine, limit.tokens + 1)}]))
        error = over.error()
        assert over.status == 400 and error["code"] == "context_length_exceeded", over
        assert f"{limit.tokens + 1:,} tokens" in error["message"] and f"{limit.tokens:,} tokens" in error["message"]
        fits = hostile.send(host, port, hostile.chat(messages=[{"role": "user", "content": _prompt_of(engine, limit.tokens - 2)}], max_tokens=2))
        assert fits.status == 200, fits
        assert json.loads(fits.body)["usage"]["prompt_tokens"] == limit.tokens - 2
        t = time.monotonic()
        huge = hostile.send(host, port, hostile.chat(max_tokens=10**12))
        assert huge.status == 400 and huge.error()["param"] == "max_tokens" and time.monotonic() - t < 1
        seed = hostile.send(host, port, hostile.chat(temperature=1.0, seed=2**64))
        assert seed.status == 400 and seed.error()["param"] == "seed"


@pytest.mark.integration
def test_serve_on_the_tiny_model_holds_against_the_corpus(tiny_dir):
    """The transformers runtime on the tiny model (a 4,096-token context, the plan's 5 s deadline): the corpus and the exact rules hold."""
    from fractal_opt.runtimes import Engine

    engine = Engine.build(Plan(source=str(tiny_dir)).replace_section("scheduling", timeout_s=5.0), progress=lambda m: None)
    assert engine.context_limit().tokens == 4096
    _holds(engine)


@pytest.mark.integration
def test_serve_on_a_llama_server_child_holds_against_the_corpus(tmp_path, monkeypatch):
    """The llama.cpp runtime with a llama-server child (the stand-in, holding 4,096 tokens a slot as
    the plan's llama.cpp would), counting prompts with the GGUF's tokenizer: the corpus and the exact rules hold."""
    from fractal_opt.core.errors import ModelSourceError
    from fractal_opt.runtimes.llama_cpp import engine as llama_engine

    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE_LLAMA} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_LLAMA_CONTEXT", "4096")  # the stand-in's slot: what the plan's n_ctx gives one slot
    plan = Plan(source="smollm2-135m-instruct", hardware=HardwarePlan(runtime="llama_cpp", threads=1, runtime_path=str(exe)))
    llama_engine.clear_cache()
    try:
        engine = llama_engine.LlamaCppEngine.build(plan, progress=lambda m: None)
    except ModelSourceError as e:
        pytest.skip(f"embedded model not installed: {e}")
    try:
        assert engine.context_limit().tokens == engine.settings.context_per_request == 4096
        _holds(engine)
    finally:
        llama_engine.clear_cache()
