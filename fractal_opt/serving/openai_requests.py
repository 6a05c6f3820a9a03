"""OpenAI request bodies -> what the request server takes.

Pure (no web framework), so the rules are tested without a socket. Every refusal is a
:class:`BadRequest` naming the field (``param``), the value and what is allowed; the HTTP layer
turns it into a 400 with OpenAI's error shape.

Validation is written here rather than with pydantic models so each message can say what is
allowed in the words of this server (one prompt, text only, n 1).

Per request: ``messages`` / ``prompt``, ``max_tokens`` (``max_completion_tokens``), ``stop``,
``stream`` (+ ``stream_options.include_usage``), ``temperature``, ``top_p``, ``seed``; omitted
fields take the plan's values (and the server's seed). Temperature 0 is greedy; above 0 samples,
also on a greedy plan (:mod:`.sampling`). A scheduler that cannot honour a request's own sampling
(transformers' continuous batching) refuses it at ``Server.submit``, naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import closest
from .sampling import SamplingError, check

__all__ = ["BadRequest", "Parsed", "parse_chat", "parse_completion"]

ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_STOPS = 4  # OpenAI's limit on stop sequences per request


class BadRequest(ValueError):
    """A request field the server cannot take: ``param`` names it (``messages[1].content``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Parsed:
    """A checked request: what ``Server.submit`` takes, and how to answer."""

    messages: list[dict[str, str]]
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


def parse_chat(body: Any) -> Parsed:
    """A ``/v1/chat/completions`` body, checked."""
    body = _mapping(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", f"'messages' must be a non-empty list of {{role, content}} objects, got {_show(messages)}.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise BadRequest(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content', got {_show(m)}.")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role", f"messages[{i}].role: got {_show(role)}, expected one of {list(ROLES)}.{closest(str(role), ROLES)}")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), f"messages[{i}].content")})
    return _common(body, out)


def parse_completion(body: Any) -> Parsed:
    """A ``/v1/completions`` body. The prompt is served as one user message, through the plan's
    chat template, because that is the request the plan was measured on."""
    body = _mapping(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt", f"'prompt' must be a non-empty string (one prompt per request), got {_show(prompt)}.")
    unsupported = {"echo": bool(body.get("echo")), "suffix": bool(body.get("suffix")), "best_of": body.get("best_of") not in (None, 1),
                   "logprobs": body.get("logprobs") not in (None, 0)}
    for name, asked in unsupported.items():
        if asked:
            raise BadRequest(name, f"'{name}' is not supported by this server (got {_show(body.get(name))}); omit it.")
    return _common(body, [{"role": "user", "content": prompt}])


def _common(body: Mapping[str, Any], messages: list[dict[str, str]]) -> Parsed:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"'model' must be a string, got {_show(model)}.")
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("n", f"'n': got {_show(n)}; this server answers each request once (n: 1).")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise BadRequest(name, f"'{name}': got {_show(max_tokens)}, expected an integer >= 1.")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest("stop", f"'stop': got {_show(stop)}, expected a non-empty string or a list of at most {MAX_STOPS} non-empty strings.")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", f"'stream': got {_show(stream)}, expected true or false.")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise BadRequest("stream_options", f"'stream_options': got {_show(options)}, expected an object such as {{\"include_usage\": true}}.")
    try:
        sampling = check(body.get("temperature"), body.get("top_p"), body.get("seed"))
    except SamplingError as e:
        raise BadRequest(e.param, str(e)) from None
    return Parsed(messages=messages, max_tokens=max_tokens, stop=stops, stream=stream, include_usage=bool(options.get("include_usage")), model=model,
                  temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed)


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(where, f"{where}: got {_show(content)}, expected a string or a list of {{\"type\": \"text\", \"text\": ...}} parts (this model reads text only).")


def _mapping(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest("body", f"the request body must be a JSON object, got {_show(body)}.")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
