"""`fractal-opt serve` under hostile clients: bodies too large, too slow, nested too deep or not
text; slowloris and idle sockets; more connections than the cap; fields it does not offer; a
max_tokens over the plan's cap; an engine that cannot serve; a request past its deadline; and
the whole hostile corpus (fractal_opt.serving.hostile_requests). Each gets a JSON error (or its
connection closed) and the server goes on answering.

The app runs in-process under uvicorn with the limits serve sets (``uvicorn_options``), small
ones so each case takes a fraction of a second, on a model-less engine whose prompt tokens are
its bytes (a context of 4,096 of them).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

import pytest

from conftest import served_app

from fractal_opt.core.errors import EngineError
from fractal_opt.serving import hostile_requests
from fractal_opt.serving.http_limits import HttpLimits
from fractal_opt.serving.server import Server
from fractal_opt.testing import FakeEngine
from fractal_opt.tower.plan import Plan

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

MESSAGES = [{"role": "user", "content": "hi"}]
CAP = 6  # the plan's application.max_new_tokens
CONTEXT = 4096  # the plan's context_cap: prompt bytes + answer tokens of one request
LIMITS = HttpLimits(max_body_bytes=256 << 10, header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=0.5, max_connections=8)


class EchoServer(Server):
    """One token a millisecond, the request's budget of them; a prompt holding FAIL ends in an error."""

    def _run(self) -> None:
        while not self._closed.is_set():
            ticket = self._next(0.01)
            if ticket is None or not ticket._start(len(ticket.request.as_messages()[-1]["content"])):
                continue
            if "FAIL" in ticket.request.as_messages()[-1]["content"]:
                self._end(ticket, "error", EngineError("POST to llama-server failed (llama-server exited with status 9); its log ends:\nSECRET LOG TAIL"))
                continue
            for _ in range(ticket.max_new_tokens):
                time.sleep(0.001)
                ticket._add([1], [time.perf_counter()])
                self._expire()  # a deadline ends the ticket between tokens, as the runtimes' servers do
                if ticket.finished:
                    break
            self._end(ticket, "done")


class EchoEngine(FakeEngine):
    health_reason: str | None = None
    fatal: str | None = None
    count_fails: str | None = None  # count_prompt raises EngineError(this): a tokenizer that cannot load

    def count_prompt(self, request, *, limit=None):
        if self.count_fails is not None:
            raise EngineError(self.count_fails)
        return super().count_prompt(request, limit=limit)

    def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Server:
        return EchoServer(self, seed=seed, ignore_eos=ignore_eos)

    def decode(self, token_ids):
        return "x" * len(token_ids)

    def health(self) -> str | None:
        if self.fatal is not None:
            raise EngineError(self.fatal)
        return self.health_reason


def _engine(**plan_model: Any) -> EchoEngine:
    plan = Plan(source="fake").replace_section("application", max_new_tokens=CAP).replace_section("model", **{"context_cap": CONTEXT, **plan_model})
    engine = FakeEngine.factory()(plan)
    engine.__class__ = EchoEngine
    return engine


@pytest.fixture(scope="module")
def app():
    engine = _engine()
    with served_app(engine, limits=LIMITS) as (host, port, _):
        yield host, port, engine


def _raw(app, data: bytes, *, wait_s: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or ``wait_s``)."""
    host, port, _ = app
    out = b""
    with socket.create_connection((host, port), timeout=wait_s) as s:
        try:
            s.sendall(data)
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError, BrokenPipeError):  # a server that answered before reading it all may reset
            pass
    return out


def _post(app, body: Any = None, *, raw: bytes | None = None, path: str = "/v1/chat/completions", headers: str = "") -> tuple[int, dict]:
    payload = raw if raw is not None else json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n{headers}\r\n"
    return _parsed(_raw(app, head.encode() + payload))


def _parsed(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, json.loads(body) if body.strip().startswith(b"{") else {}


def _still_serving(app) -> None:
    status, body = _post(app, {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200 and body["choices"][0]["message"]["content"] == "xx", body


def test_a_body_over_the_limit_is_413_before_it_is_read(app):
    """A Content-Length over --max-body-mb: 413 at once (the body is never sent); a chunked body past it: 413 too."""
    host, port, _ = app
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {50 << 20}\r\n\r\n"
    status, body = _parsed(_raw(app, head.encode()))
    assert status == 413 and body["error"]["code"] == "request_too_large" and "262,144" in body["error"]["message"]
    chunk = b"x" * (128 << 10)
    chunked = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 3 + b"0\r\n\r\n"
    status, body = _parsed(_raw(app, chunked))
    assert status == 413
    _still_serving(app)


def test_a_body_shorter_than_its_length_gets_408_within_the_body_timeout(app):
    """A body that stops arriving (shorter than its Content-Length) is answered 408 after --body-timeout-s, not waited on forever."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\":"
    t = time.monotonic()
    status, body = _parsed(_raw(app, head))
    assert status == 408 and body["error"]["code"] == "request_timeout" and time.monotonic() - t < 3
    _still_serving(app)


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_a_400_naming_the_body(app, depth):
    """JSON nested past 32 levels (or deep enough for the decoder's own guard) is a 400, not a 500."""
    status, body = _post(app, raw=b'{"messages": ' + b"[" * depth + b"]" * depth + b"}")
    assert status == 400 and body["error"]["param"] == "body" and "nested deeper than 32" in body["error"]["message"], body
    _still_serving(app)


def test_a_lone_surrogate_is_a_400_naming_the_field(app):
    """JSON may carry "\\ud800" alone; it is not text, so the field holding it is refused with a 400."""
    status, body = _post(app, raw=b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    assert status == 400 and body["error"]["param"] == "messages[0].content" and "surrogate" in body["error"]["message"]
    status, body = _post(app, raw=b'{"prompt": "\\udfff"}', path="/v1/completions")
    assert status == 400 and body["error"]["param"] == "prompt"
    _still_serving(app)


def test_slowloris_and_idle_sockets_are_closed(app):
    """A connection that sends nothing, one that sends its headers a byte at a time, and one idle
    after an answer are all closed by the server (header timeout, keep-alive), within seconds."""
    host, port, _ = app
    t = time.monotonic()
    with socket.create_connection((host, port), timeout=5) as idle:
        assert idle.recv(10) == b""  # closed by the server
    assert time.monotonic() - t < 3
    with socket.create_connection((host, port), timeout=5) as slow:
        t = time.monotonic()
        closed = False
        for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n":
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
        if not closed:
            slow.settimeout(5)
            assert slow.recv(10) == b""
        assert time.monotonic() - t < 5
    with socket.create_connection((host, port), timeout=5) as kept:
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = kept.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        t = time.monotonic()
        while kept.recv(65536):
            pass
        assert time.monotonic() - t < 3


def test_connections_past_the_cap_get_503(app):
    """With --max-connections 8 held open, the ninth connection gets a 503 JSON error and is closed; once they close, requests are served again."""
    host, port, _ = app
    held = [socket.create_connection((host, port), timeout=5) for _ in range(8)]
    try:
        time.sleep(0.05)
        status, body = _parsed(_raw(app, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503 and body["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    time.sleep(0.1)
    _still_serving(app)


UNOFFERED = [  # a field the server does not offer, sent at a value that asks for it: 400 naming it
    ({"logprobs": True}, "logprobs"), ({"logprobs": True, "top_logprobs": 2}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"model": "gpt-4o"}, "model"), ({"ignore_eos": True}, "ignore_eos"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logit_bias": {"1": 5}}, "logit_bias"), ({"temprature": 0.5}, "temprature"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
]


@pytest.mark.parametrize(("extra", "param"), UNOFFERED, ids=[p for _, p in UNOFFERED])
def test_a_field_not_offered_is_refused_naming_it(app, extra, param):
    """Chat logprobs / top_logprobs, tools, response_format json, an unknown model, ignore_eos, an unknown field: 400 naming it, never ignored."""
    status, body = _post(app, {"messages": MESSAGES, **extra})
    assert status == 400 and body["error"]["param"] == param, body


def test_neutral_values_of_fields_not_offered_are_accepted(app):
    """What clients send by default (logprobs false, tools [], response_format text, the served model, a user id) is answered."""
    status, body = _post(app, {"messages": MESSAGES, "model": "tiny", "logprobs": False, "tools": [], "response_format": {"type": "text"},
                               "frequency_penalty": 0, "presence_penalty": 0.0, "user": "u-1", "n": 1, "max_tokens": 3})
    assert status == 200 and body["choices"][0]["message"]["content"] == "xxx", body


def test_max_tokens_over_the_plans_cap_is_refused_naming_the_cap(app):
    """max_tokens above the plan's application.max_new_tokens: 400 naming the cap and the flag; at the cap: answered in full."""
    status, body = _post(app, {"messages": MESSAGES, "max_tokens": CAP + 10})
    assert status == 400 and body["error"]["param"] == "max_tokens" and f"cap of {CAP} tokens" in body["error"]["message"]
    assert "--max-tokens-over-cap honour" in body["error"]["message"]
    status, body = _post(app, {"prompt": "hi", "max_tokens": CAP}, path="/v1/completions")
    assert status == 200 and body["usage"]["completion_tokens"] == CAP


def test_an_app_that_honours_max_tokens_over_the_cap_generates_them():
    """--max-tokens-over-cap honour: a request for more than the plan's cap gets that many tokens."""
    with served_app(_engine(), limits=LIMITS, over_cap="honour") as (host, port, _):
        status, body = _post((host, port, None), {"messages": MESSAGES, "max_tokens": CAP + 4})
        assert status == 200 and body["usage"]["completion_tokens"] == CAP + 4


def test_health_tells_the_truth_and_a_failed_request_gets_a_short_error(app, caplog):
    """/health is 503 with the engine's reason while it cannot serve; a request that failed gets
    a short error while the whole error (a child's log tail) goes to the server's log only."""
    host, port, engine = app
    with caplog.at_level(logging.ERROR, logger="fractal_opt.serve"):
        status, body = _post(app, {"messages": [{"role": "user", "content": "FAIL"}]})
    assert status == 500 and "status 9" in body["error"]["message"] and "SECRET" not in body["error"]["message"]
    assert "SECRET LOG TAIL" in caplog.text
    engine.health_reason = "llama-server exited with status -9; restarting it (1 of 3)"
    try:
        status, body = _parsed(_raw(app, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        assert status == 503 and body["status"] == "unavailable" and "restarting" in body["reason"]
    finally:
        engine.health_reason = None
    status, body = _parsed(_raw(app, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
    assert status == 200 and body["status"] == "ok"


def test_an_engine_that_will_never_serve_again_ends_the_app():
    """When the engine's health check raises (restarts spent), /health says failed and on_fatal is called once with the reason."""
    engine = _engine()
    fatal: list[str] = []
    with served_app(engine, limits=LIMITS, on_fatal=fatal.append) as (host, port, _):
        engine.fatal = "llama-server exited with status -9 and did not start again after 3 tries"
        t = time.monotonic()
        while not fatal and time.monotonic() - t < 5:
            time.sleep(0.05)
        assert fatal == [engine.fatal]
        status, body = _parsed(_raw((host, port, None), b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        assert status == 503 and body["status"] == "failed"


def test_the_hostile_corpus_gets_no_500_and_every_request_an_answer(app):
    """Every request of the hostile corpus (over 90: answer lengths and seeds out of range, prompts of
    100,000 parts or 10,000 messages, malformed JSON, wrong types, huge heads and bodies, smuggling)
    is answered within 10 s (plus the body / header timeout it waits for) with a status it allows,
    never a 5xx, and a normal request is answered after each."""
    host, port, _ = app
    cases = hostile_requests.corpus(context=CONTEXT, body_limit=LIMITS.max_body_bytes)
    assert len(cases) >= 90
    waits = {"body_timeout_s": LIMITS.body_timeout_s, "header_timeout_s": LIMITS.header_timeout_s}
    assert hostile_requests.check(host, port, cases, waits=waits) == []


def test_a_request_past_its_deadline_ends_with_its_tokens_so_far():
    """A request still generating at its deadline (serve --timeout-s) is answered 200 with its tokens
    so far, finish_reason length and incomplete_details naming the timeout; streamed too. One that
    never reached a token is a 503."""
    with served_app(_engine(), limits=LIMITS, over_cap="honour", timeout_s=0.3) as (host, port, _):
        t = time.monotonic()
        status, body = _post((host, port, None), {"messages": MESSAGES, "max_tokens": 3000})  # 3 s of tokens
        assert status == 200 and time.monotonic() - t < 2, body
        assert 0 < body["usage"]["completion_tokens"] < 3000 and body["choices"][0]["finish_reason"] == "length"
        assert body["incomplete_details"]["reason"] == "timeout" and "0.3 s" in body["incomplete_details"]["message"]
        events = _raw((host, port, None), _request_bytes({"messages": MESSAGES, "max_tokens": 3000, "stream": True})).decode()
        chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["incomplete_details"]["reason"] == "timeout"
        assert "data: [DONE]" in events


def test_cap_mode_lowers_max_tokens_to_the_cap_and_says_length():
    """--max-tokens-over-cap cap: a max_tokens over the plan's cap (or the context left) is answered with the cap's tokens and finish_reason length."""
    with served_app(_engine(), limits=LIMITS, over_cap="cap") as (host, port, _):
        for asked in (CAP + 4, 10**12):
            status, body = _post((host, port, None), {"messages": MESSAGES, "max_tokens": asked})
            assert status == 200 and body["usage"]["completion_tokens"] == CAP and body["choices"][0]["finish_reason"] == "length", body


def test_a_prompt_over_the_context_and_max_tokens_of_10_to_the_12_are_refused_at_once(app):
    """A prompt of context + 1 tokens: 400 naming both numbers; max_tokens 10^12 and seed 2^64: 400 naming the field, within a second."""
    t = time.monotonic()
    status, body = _post(app, {"messages": [{"role": "user", "content": "a" * (CONTEXT + 1)}]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "messages"
    assert f"{CONTEXT + 1:,} tokens" in body["error"]["message"] and f"{CONTEXT:,} tokens" in body["error"]["message"]
    status, body = _post(app, {"messages": MESSAGES, "max_tokens": 10**12})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = _post(app, {"messages": MESSAGES, "temperature": 1.0, "seed": 2**64})
    assert status == 400 and body["error"]["param"] == "seed" and "signed 64-bit" in body["error"]["message"]
    assert time.monotonic() - t < 1
    _still_serving(app)


def _request_bytes(body: Any) -> bytes:
    payload = json.dumps(body).encode()
    return f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload


def test_a_prompt_the_engine_cannot_count_gets_a_short_engine_error(app):
    """Counting the prompt failing (the model's tokenizer missing) is answered like a failed generation: a short 500, never a traceback."""
    _, _, engine = app
    engine.count_fails = "the model's tokenizer cannot be read\nTraceback: SECRET"
    try:
        status, body = _post(app, {"messages": MESSAGES})
    finally:
        engine.count_fails = None
    assert status == 500 and body["error"]["message"] == "generation failed: the model's tokenizer cannot be read", body
    _still_serving(app)
