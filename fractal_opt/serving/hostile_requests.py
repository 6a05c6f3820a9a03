"""A corpus of hostile requests to an OpenAI-compatible endpoint, and the raw client that sends them.

What a careless or malicious client sends ``fractal-opt serve``: answer lengths and seeds out of
any range, prompts far over the model's context (100,000 text parts, 10,000 messages), malformed
JSON, wrong types, huge headers and bodies, and request-smuggling attempts (a Content-Length next
to a Transfer-Encoding, two lengths, chunk sizes that overflow). A server that holds is one that
answers each with a 4xx (or closes the connection of one it cannot parse), never a 500, within a
bounded time, and answers a normal request after each: tests/serving/test_hostile_requests.py
runs the corpus in the test suite, benchmarks/serve_soak.py mixes it into its load.

Every request is built as raw bytes (no HTTP client library would send most of them) and sent on
a fresh connection by :func:`send`, which reads until the server closes it or the response is
complete.

Example:
    >>> cases = corpus(context=4096)
    >>> len(cases) >= 90
    True
    >>> outcome = send("127.0.0.1", 8000, cases[0].raw)                     # doctest: +SKIP
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Hostile", "Outcome", "answer_complete", "check", "corpus", "normal_request", "outcome_of", "problem", "send"]

PATH = "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}
CLOSED = 0  # an outcome's status when the server closed the connection without an answer


@dataclass(frozen=True)
class Hostile:
    """One hostile request.

    Attributes:
        name: what it tries, unique in the corpus.
        raw: the bytes sent, request line to the last body byte.
        allowed: the statuses a sound server may answer (:data:`CLOSED`: it may close the
            connection without an answer, as HTTP allows for bytes it cannot parse).
        waits_for: the server limit that ends it, when the server must wait for it
            (``"body_timeout_s"``: a body that never arrives), else None (answered at once).
    """

    name: str
    raw: bytes
    allowed: frozenset[int]
    waits_for: str | None = None


@dataclass(frozen=True)
class Outcome:
    """What the server did: the status (:data:`CLOSED` when it closed without one), the seconds
    from the last byte sent to the end of the answer, and the body (the first one, when pipelined)."""

    status: int
    seconds: float
    body: bytes

    def error(self) -> dict[str, Any]:
        """The JSON error object of the answer ({} when it is not one)."""
        try:
            value = json.loads(self.body)
        except ValueError:
            return {}
        return value.get("error") or {} if isinstance(value, dict) else {}


def request(body: bytes, *, path: str = PATH, headers: str = "", method: str = "POST", length: bool = True) -> bytes:
    """A whole HTTP/1.1 request with ``body`` (Content-Length set unless ``length`` is False)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\n"
    if length:
        head += f"Content-Length: {len(body)}\r\n"
    return (head + headers + "\r\n").encode() + body


def chat(**fields: Any) -> bytes:
    """A chat request with ``fields`` over a one-message conversation."""
    return request(json.dumps({"messages": [USER], **fields}).encode())


def normal_request(*, max_tokens: int = 2) -> bytes:
    """The request every hostile one is followed by: a short chat that must be answered 200."""
    return chat(max_tokens=max_tokens)


def corpus(*, context: int = 4096, body_limit: int = 4 << 20) -> list[Hostile]:
    """The hostile requests, for a server whose model holds ``context`` tokens and whose body limit
    is ``body_limit`` bytes (its ``--max-body-mb``). Names are unique."""
    cases = [*_answer_lengths(context), *_sampling(), *_prompts(context, body_limit), *_malformed_json(body_limit), *_wrong_types(),
             *_headers(), *_bodies(body_limit), *_smuggling(), *_routes()]
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "corpus names must be unique"
    return cases


def _case(name: str, raw: bytes, *allowed: int, waits_for: str | None = None) -> Hostile:
    return Hostile(name=name, raw=raw, allowed=frozenset(allowed), waits_for=waits_for)


def _answer_lengths(context: int) -> list[Hostile]:
    huge = {"1e12": 10**12, "1e30": 10**30, "2^31": 2**31, "2^63": 2**63, "2^64": 2**64, "context": context, "context+1": context + 1}
    out = [_case(f"max_tokens {name}", chat(max_tokens=value), 400) for name, value in huge.items()]
    out += [_case(f"max_completion_tokens {name}", chat(max_completion_tokens=value), 400) for name, value in (("1e12", 10**12), ("2^64", 2**64))]
    out += [_case(f"max_tokens {name}", chat(max_tokens=value), 400)
            for name, value in (("0", 0), ("-1", -1), ("-2^63", -(2**63)), ("1.5", 1.5), ("1e30 float", 1e30), ("string", "10"), ("true", True),
                                ("list", [5]), ("object", {"n": 5}))]
    out.append(_case("max_tokens with 5000 digits", request(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}"), 400))
    out.append(_case("max_tokens Infinity", request(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}'), 400))
    return out


def _sampling() -> list[Hostile]:
    values: list[tuple[str, str, Any]] = [
        ("seed", "2^64", 2**64), ("seed", "2^63", 2**63), ("seed", "-2^63-1", -(2**63) - 1), ("seed", "1e30", 1e30), ("seed", "1.5", 1.5),
        ("seed", "string", "1"), ("seed", "true", True), ("seed", "10^100", 10**100),
        ("n", "2", 2), ("n", "0", 0), ("n", "1e30", 10**30), ("n", "-1", -1), ("n", "string", "1"),
        ("top_k", "1e30", 10**30), ("top_k", "-1", -1), ("best_of", "2^64", 2**64), ("top_logprobs", "2^64", 2**64),
        ("temperature", "-1", -1), ("temperature", "1e308", 1e308), ("temperature", "string", "0.5"), ("top_p", "0", 0), ("top_p", "2", 2),
        ("frequency_penalty", "1e308", 1e308), ("presence_penalty", "-1e308", -1e308),
    ]
    out = [_case(f"{field} {name}", chat(temperature=1.0, **{field: value}) if field == "seed" else chat(**{field: value}), 400)
           for field, name, value in values]
    for field in ("temperature", "top_p", "seed", "n"):  # JSON extensions Python's decoder accepts
        out.append(_case(f"{field} NaN", request(b'{"messages": [{"role": "user", "content": "hi"}], "%s": NaN}' % field.encode()), 400))
    return out


def _prompts(context: int, body_limit: int) -> list[Hostile]:
    word = "hello "
    fill = max(1, (body_limit - 200) // len(word))

    def sized(name: str, body: Any, path: str = PATH, *, stream: bool = False) -> Hostile:
        """Refused as too long (400), or as too large a body (413) where it is over ``body_limit``."""
        payload = json.dumps(body).encode()
        return _case(name, request(payload, path=path), 413 if len(payload) > body_limit else 400)

    return [
        sized("100,000 text parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": word}] * 100_000}], "max_tokens": 4}),
        sized("10,000 messages", {"messages": [USER, {"role": "assistant", "content": "ok"}] * 5000, "max_tokens": 4}),
        sized("one message of the whole body", {"messages": [{"role": "user", "content": word * fill}]}),
        sized("a prompt of 4x the context in words", {"messages": [{"role": "user", "content": word * (4 * context)}]}),
        sized("a stop sequence of 100,000 characters", {"messages": [USER], "stop": "x" * 100_000, "stream": True}),
        sized("five stop sequences", {"messages": [USER], "stop": ["a", "b", "c", "d", "e"]}),
        sized("completion prompt of 100,000 strings", {"prompt": ["hello"] * 100_000}, "/v1/completions"),
        sized("completion prompt 4x the context", {"prompt": word * (4 * context)}, "/v1/completions"),
    ]


def _malformed_json(body_limit: int) -> list[Hostile]:
    bodies = {
        "empty body": b"", "truncated object": b'{"messages": [', "trailing comma": b'{"messages": [],}', "single quotes": b"{'messages': []}",
        "a bare null": b"null", "a bare list": b"[]", "a bare number": b"1", "a bare string": b'"hi"', "invalid UTF-8": b'{"messages": "\xff\xfe"}',
        "UTF-16 with BOM": '{"messages": []}'.encode("utf-16"), "nesting 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
        "nesting 40 deep in a field": b'{"messages": ' + b"[" * 40 + b"]" * 40 + b"}", "a lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "NUL bytes": b'{"messages": [\x00]}', "two objects": b'{"messages": []}{"messages": []}', "a huge exponent": b'{"max_tokens": 1e999999}',
        "duplicate keys": b'{"messages": [], "messages": 5}', "a key half the body limit long": b'{"' + b"k" * (body_limit // 2) + b'": 1}',
    }
    return [_case(f"malformed JSON: {name}", request(body), 400) for name, body in bodies.items()]


def _wrong_types() -> list[Hostile]:
    bodies: dict[str, Any] = {
        "messages a string": {"messages": "hi"}, "messages an object": {"messages": {"role": "user"}}, "messages empty": {"messages": []},
        "a message a list": {"messages": [["user", "hi"]]}, "content a number": {"messages": [{"role": "user", "content": 5}]},
        "content an image part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        "role a number": {"messages": [{"role": 1, "content": "hi"}]}, "role unknown": {"messages": [{"role": "root", "content": "hi"}]},
        "a message field unknown": {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "stop a number": {"messages": [USER], "stop": 5},
        "stream a string": {"messages": [USER], "stream": "yes"}, "stream_options a list": {"messages": [USER], "stream_options": []},
        "model a number": {"messages": [USER], "model": 5}, "user an object": {"messages": [USER], "user": {}}, "ignore_eos a string": {"messages": [USER], "ignore_eos": "no"},
        "an unknown field": {"messages": [USER], "max_token": 5}, "logit_bias huge": {"messages": [USER], "logit_bias": {str(i): 100 for i in range(1000)}},
    }
    out = [_case(f"wrong type: {name}", request(json.dumps(body).encode()), 400) for name, body in bodies.items()]
    out.append(_case("completions without a prompt", request(b'{"max_tokens": 2}', path="/v1/completions"), 400))
    return out


def _headers() -> list[Hostile]:
    body = json.dumps({"messages": [USER], "max_tokens": 2}).encode()
    return [
        _case("one header of 64 KiB", request(body, headers=f"X-Big: {'a' * (64 << 10)}\r\n"), 431),
        _case("2,000 headers", request(body, headers="".join(f"X-H{i}: v\r\n" for i in range(2000))), 431),
        _case("a request line of 64 KiB", request(body, path="/v1/chat/completions?" + "a" * (64 << 10)), 414, 431),
        _case("an obsolete folded header", request(body, headers="X-Fold: a\r\n b\r\n"), 200, 400, CLOSED),  # RFC 9112: refuse, or unfold (h11)
        _case("a header without a colon", request(body, headers="NoColon\r\n"), 400, CLOSED),
        _case("a header name with a space", request(body, headers="X Bad: v\r\n"), 400, CLOSED),
        _case("a NUL in a header value", request(body, headers="X-Nul: a\x00b\r\n"), 400, CLOSED),
        _case("no Host header", request(body).replace(b"Host: localhost\r\n", b""), 400, CLOSED),
        _case("bare LF line endings", request(body).replace(b"\r\n", b"\n"), 200, 400, CLOSED),
        _case("a bad Authorization header", request(body, headers=f"Authorization: Bearer {'x' * 8000}\r\n"), 200, 401),
        _case("a Content-Type that is not JSON", request(body).replace(b"application/json", b"text/plain"), 200, 400, 415),
    ]


def _bodies(body_limit: int) -> list[Hostile]:
    big = b"x" * (body_limit + 1)
    chunk = b"x" * (64 << 10)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(body_limit // len(chunk) + 2)) + b"0\r\n\r\n"
    return [
        _case("a Content-Length of 50 GB", request(b"", headers=f"Content-Length: {50 << 30}\r\n", length=False), 413),
        _case("a body one byte over the limit", request(big), 413),
        _case("a chunked body over the limit", request(chunked, headers="Transfer-Encoding: chunked\r\n", length=False), 413),
        _case("a body shorter than its Content-Length", request(b'{"messages": [', headers="Content-Length: 1000\r\n", length=False), 408, waits_for="body_timeout_s"),
        _case("a chunked body that never ends", request(b"5\r\n{\"mes\r\n", headers="Transfer-Encoding: chunked\r\n", length=False), 400, 408, waits_for="body_timeout_s"),
        _case("a Content-Length of 2^64", request(b"{}", headers=f"Content-Length: {2**64}\r\n", length=False), 400, 413, CLOSED),
    ]


def _smuggling() -> list[Hostile]:
    """Ambiguous message framing (RFC 9112 section 6.3): each must be refused, never read two ways."""
    body = json.dumps({"messages": [USER], "max_tokens": 2}).encode()
    inner = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    out = [
        _case("Content-Length and Transfer-Encoding", request(chunked + inner, headers=f"Transfer-Encoding: chunked\r\nContent-Length: {len(chunked)}\r\n", length=False), 400),
        _case("Transfer-Encoding and a shorter Content-Length", request(chunked, headers="Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", length=False), 400),
        _case("two different Content-Lengths", request(body, headers=f"Content-Length: {len(body) + 5}\r\n"), 400, CLOSED),
        _case("a Content-Length with a plus sign", request(body, headers=f"Content-Length: +{len(body)}\r\n", length=False), 400, CLOSED),
        _case("a negative Content-Length", request(body, headers="Content-Length: -1\r\n", length=False), 400, CLOSED),
        _case("a Content-Length in hex", request(body, headers=f"Content-Length: 0x{len(body):x}\r\n", length=False), 400, CLOSED),
        _case("Transfer-Encoding xchunked", request(chunked, headers="Transfer-Encoding: xchunked\r\n", length=False), 400, CLOSED),
        _case("Transfer-Encoding chunked, identity", request(chunked, headers="Transfer-Encoding: chunked, identity\r\n", length=False), 400, CLOSED),
        _case("Transfer-Encoding with a space before the colon", request(chunked, headers="Transfer-Encoding : chunked\r\n", length=False), 400, CLOSED),
        _case("Transfer-Encoding twice", request(chunked, headers="Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", length=False), 200, 400, CLOSED),
        _case("a chunk size that overflows", request(b"ffffffffffffffffffff\r\n" + body + b"\r\n0\r\n\r\n", headers="Transfer-Encoding: chunked\r\n", length=False),
              400, 408, 413, CLOSED, waits_for="body_timeout_s"),  # h11 takes 20 hex digits, then the body never arrives
        _case("a chunk size with a bad extension", request(b"5;\x00=x\r\nhello\r\n0\r\n\r\n", headers="Transfer-Encoding: chunked\r\n", length=False), 400, CLOSED),
        _case("a chunk without its CRLF", request(b"5\r\nhelloXX0\r\n\r\n", headers="Transfer-Encoding: chunked\r\n", length=False), 400, CLOSED),
        _case("a request hidden after the body", request(body) + inner, 200),
        _case("HTTP/1.0 with chunked encoding", request(chunked, headers="Transfer-Encoding: chunked\r\n", length=False).replace(b"HTTP/1.1", b"HTTP/1.0", 1), 200, 400, CLOSED),
        _case("an HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, 404, 405, CLOSED),
        _case("HTTP/0.9", b"GET /health\r\n", 400, CLOSED, waits_for="header_timeout_s"),  # no blank line: the head never ends
        _case("an absolute-form target", request(body, path="http://evil.example/v1/chat/completions"), 200, 400, 404),
        _case("a request line with two spaces", request(body).replace(b"POST /v1", b"POST  /v1", 1), 400, CLOSED),
    ]
    return out


def _routes() -> list[Hostile]:
    body = json.dumps({"messages": [USER], "max_tokens": 2}).encode()
    return [
        _case("an unknown method", request(body, method="BREW"), 400, 405),
        _case("GET on the chat route", request(b"", method="GET"), 405),
        _case("a path traversal", request(body, path="/v1/../../etc/passwd"), 404, 400),
        _case("a percent-encoded traversal", request(body, path="/v1/%2e%2e/%2e%2e/etc/passwd"), 404),
        _case("a NUL in the path", request(body, path="/v1/chat/completions%00"), 404),
        _case("a very long path", request(body, path="/" + "a" * 8000), 404, 414, 431, CLOSED),
    ]


def send(host: str, port: int, raw: bytes, *, timeout_s: float = 10.0) -> Outcome:
    """Send ``raw`` on a fresh connection and read the first answer (until the server closes the
    connection, the answer is complete, or ``timeout_s`` passes: then the outcome's status is
    :data:`CLOSED` and its seconds over ``timeout_s``)."""
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        try:
            s.sendall(raw)
        except OSError:  # a server that answered before reading it all may reset
            pass
        start = time.monotonic()
        data = b""
        while not answer_complete(data):
            s.settimeout(max(0.01, timeout_s - (time.monotonic() - start)))
            try:
                chunk = s.recv(1 << 16)
            except TimeoutError:
                return Outcome(CLOSED, time.monotonic() - start + timeout_s, data)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        seconds = time.monotonic() - start
    return outcome_of(data, seconds)


def answer_complete(data: bytes) -> bool:
    """True once ``data`` holds a whole response with a Content-Length (streams end at close)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value)
    return False


def outcome_of(data: bytes, seconds: float) -> Outcome:
    """The :class:`Outcome` of the bytes a server sent back (its first answer) in ``seconds``."""
    if not data.startswith(b"HTTP/"):
        return Outcome(CLOSED, seconds, data)
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = _unchunk(body)
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            body = body[: int(value)]
    return Outcome(status, seconds, body)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        try:
            n = int(size.split(b";")[0], 16)
        except ValueError:
            return out
        if n == 0:
            return out
        out, data = out + rest[:n], rest[n + 2 :]
    return out


def problem(case: Hostile, outcome: Outcome, *, limit_s: float = 10.0) -> str | None:
    """Why ``outcome`` is wrong for ``case`` (None when it is right): a 5xx, a status the case does
    not allow, a 4xx that is not a JSON error naming what was wrong, or no answer within ``limit_s``
    (plus the server limit the case waits for)."""
    if outcome.status >= 500:
        return f"{case.name}: {outcome.status} {outcome.body[:200]!r}"
    if outcome.status not in case.allowed:
        return f"{case.name}: answered {outcome.status or 'nothing (closed)'}, expected one of {sorted(case.allowed)}: {outcome.body[:200]!r}"
    if outcome.seconds > limit_s:
        return f"{case.name}: answered after {outcome.seconds:.1f} s, over {limit_s:g} s"
    return None


def check(host: str, port: int, cases: list[Hostile], *, waits: Mapping[str, float] | None = None, limit_s: float = 10.0) -> list[str]:
    """Send every case, each followed by :func:`normal_request`; the problems found (empty: the
    server held). ``waits``: the server's own limits a case may wait for (``body_timeout_s``,
    ``header_timeout_s``), added to ``limit_s`` for such a case."""
    problems = []
    for case in cases:
        extra = (waits or {}).get(case.waits_for, 0.0) if case.waits_for else 0.0
        outcome = send(host, port, case.raw, timeout_s=limit_s + extra + 5)
        if (found := problem(case, outcome, limit_s=limit_s + extra)) is not None:
            problems.append(found)
        after = send(host, port, normal_request(), timeout_s=limit_s + 5)
        if after.status != 200 or after.seconds > limit_s:
            problems.append(f"after {case.name}: a normal request answered {after.status or 'nothing'} in {after.seconds:.1f} s: {after.body[:200]!r}")
    return problems
