"""OpenAI request bodies -> what the request server takes.

Pure (no web framework), so the rules are tested without a socket. Every refusal is a
:class:`BadRequest` naming the field (``param``), the value and what is allowed; the HTTP layer
turns it into a 400 with OpenAI's error shape.

Validation is written here rather than with pydantic models so each message can say what is
allowed in the words of this server (one prompt, text only, n 1).

Every field a request sends is either honoured or refused, never ignored (:data:`CHAT_FIELDS`,
:data:`COMPLETION_FIELDS`; an unknown name gets the closest known one):

- honoured: ``messages`` / ``prompt``, ``model`` (the name ``/v1/models`` lists), ``max_tokens``
  (``max_completion_tokens``), ``stop``, ``stream`` (+ ``stream_options.include_usage``),
  ``temperature``, ``top_p``, ``seed``, ``ignore_eos`` (when it matches the server's mode:
  ``serve --ignore-eos``), and ``user`` (an end-user id for the client's own records; it changes
  no answer). Omitted fields take the plan's values (and the server's seed). Temperature 0 is
  greedy; above 0 samples, also on a greedy plan (:mod:`.sampling`). A scheduler that cannot
  honour a request's own sampling (transformers' continuous batching) refuses it at
  ``Server.submit``, naming the field.
- accepted only at their neutral value, refused otherwise: ``logprobs`` / ``top_logprobs``,
  ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, ``response_format`` (``{"type": "text"}``),
  ``frequency_penalty`` / ``presence_penalty`` (0), ``logit_bias`` (empty), ``n`` (1); on
  completions also ``echo``, ``suffix``, ``best_of``.
- every string (message text, stop sequences, the model name) must be Unicode text: a lone
  UTF-16 surrogate (``"\\ud800"``, which JSON allows) is refused, since no tokenizer can encode it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import BadRequest, closest
from .sampling import check

__all__ = ["CHAT_FIELDS", "COMPLETION_FIELDS", "NEUTRAL", "Parsed", "parse_chat", "parse_completion"]

ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_STOPS = 4  # OpenAI's limit on stop sequences per request
# Longer than any turn marker or stop word a client uses; the answer is scanned for every prefix
# of every stop sequence as it streams (Ticket._settled), so their length must be bounded.
MAX_STOP_CHARS = 256
_SURROGATE = re.compile("[\ud800-\udfff]")  # UTF-16 halves: JSON may carry one alone ("\\ud800"), UTF-8 cannot


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
    max_tokens_field: str = "max_tokens"  # the name the request used (max_completion_tokens too), for errors about it


def parse_chat(body: Any, *, served: str | None = None, ignore_eos: bool = False) -> Parsed:
    """A ``/v1/chat/completions`` body, checked. ``served``: the model name this server answers to
    (None: any); ``ignore_eos``: the server's mode, the only value a request may send."""
    body = _mapping(body)
    _known(body, CHAT_FIELDS)
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
        for key in m:
            if key not in ("role", "content", "name"):
                raise BadRequest(f"messages[{i}].{key}", f"messages[{i}].{key} is not supported by this server (text messages only: role, content, name).")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), f"messages[{i}].content")})
    return _common(body, out, served=served, ignore_eos=ignore_eos)


def parse_completion(body: Any, *, served: str | None = None, ignore_eos: bool = False) -> Parsed:
    """A ``/v1/completions`` body. The prompt is served as one user message, through the plan's
    chat template, because that is the request the plan was measured on."""
    body = _mapping(body)
    _known(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt", f"'prompt' must be a non-empty string (one prompt per request), got {_show(prompt)}.")
    _text(prompt, "prompt")
    return _common(body, [{"role": "user", "content": prompt}], served=served, ignore_eos=ignore_eos)


# Fields each endpoint knows. A known field with no meaning here is accepted at its neutral value
# only (NEUTRAL); any other value of it, and any unknown name, is a 400 naming it.
_COMMON = ("model", "max_tokens", "n", "stop", "stream", "stream_options", "temperature", "top_p", "seed", "ignore_eos", "user",
           "frequency_penalty", "presence_penalty", "logit_bias", "logprobs")
CHAT_FIELDS = ("messages", *_COMMON, "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format")
COMPLETION_FIELDS = ("prompt", *_COMMON, "echo", "suffix", "best_of")
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "n": (None, 1),
}
_WHY = {
    "logprobs": "log-probabilities of the answer's tokens are not returned by this server", "top_logprobs": "log-probabilities are not returned by this server",
    "tools": "tool calling is not offered (the plan was measured on plain text answers)", "tool_choice": "tool calling is not offered",
    "response_format": "only plain text answers are offered ({\"type\": \"text\"})", "n": "this server answers each request once (n: 1)",
    "logit_bias": "logit biases are not applied", "frequency_penalty": "the plan's decoding is served as measured (its repetition_penalty applies)",
    "presence_penalty": "the plan's decoding is served as measured (its repetition_penalty applies)", "best_of": "this server answers each request once",
}


def _known(body: Mapping[str, Any], fields: tuple[str, ...]) -> None:
    for name, value in body.items():
        if name not in fields:
            raise BadRequest(str(name), f"unknown field {_show(name)}: this endpoint takes {sorted(fields)}.{closest(str(name), fields)}")
        if name in NEUTRAL and not any(_same(value, v) for v in NEUTRAL[name]):
            why = _WHY.get(name, "it is not supported by this server")
            raise BadRequest(name, f"'{name}': got {_show(value)}; {why}. Omit it, or send {_show(NEUTRAL[name][1])}.")


def _same(a: Any, b: Any) -> bool:
    """Equal, with booleans apart from numbers (JSON's false is not 0) and 0.0 equal to 0."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _common(body: Mapping[str, Any], messages: list[dict[str, str]], *, served: str | None, ignore_eos: bool) -> Parsed:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"'model' must be a string, got {_show(model)}.")
    if model is not None and served is not None and model != served:
        _text(model, "model")
        raise BadRequest("model", f"'model': got {_show(model)}; this server serves {served!r} only (GET /v1/models lists it).")
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
    for s in stops:
        _text(s, "stop")
        if len(s) > MAX_STOP_CHARS:
            raise BadRequest("stop", f"'stop': a stop sequence of {len(s):,} characters; each may hold at most {MAX_STOP_CHARS:,}.")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", f"'stream': got {_show(stream)}, expected true or false.")
    options = body.get("stream_options")
    options = {} if options is None else options
    # vLLM's continuous_usage_stats (usage in every chunk) is not offered; false asks for nothing
    # beyond include_usage, and guidellm sends it (true by default, false when told).
    if not isinstance(options, Mapping) or any(k not in ("include_usage", "continuous_usage_stats") for k in options) \
            or options.get("continuous_usage_stats") not in (None, False):
        raise BadRequest("stream_options", f"'stream_options': got {_show(options)}, expected an object such as {{\"include_usage\": true}} "
                         "(include_usage; continuous_usage_stats, usage in every chunk, is not offered: omit it or send false).")
    if body.get("ignore_eos") not in (None, ignore_eos) or not isinstance(body.get("ignore_eos", False), bool):
        mode = "runs every answer to its max_tokens (serve --ignore-eos)" if ignore_eos else "ends an answer at end-of-sequence, as the plan was measured"
        raise BadRequest("ignore_eos", f"'ignore_eos': got {_show(body.get('ignore_eos'))}; this server {mode}, for every request. "
                         f"Omit it, or send {ignore_eos!r}.")
    if body.get("user") is not None and not isinstance(body.get("user"), str):
        raise BadRequest("user", f"'user': got {_show(body.get('user'))}, expected a string (an end-user id).")
    sampling = check(body.get("temperature"), body.get("top_p"), body.get("seed"))
    return Parsed(messages=messages, max_tokens=max_tokens, stop=stops, stream=stream, include_usage=bool(options.get("include_usage")), model=model,
                  temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed, max_tokens_field=name)


def _text(value: str, where: str) -> str:
    """``value`` when it is Unicode text; a lone surrogate (valid JSON, not text) is refused."""
    if (m := _SURROGATE.search(value)) is not None:
        raise BadRequest(where, f"{where} holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x}) at character {m.start()}, which is not text; "
                         "send the character as UTF-8 or as a surrogate pair.")
    return value


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return _text("".join(p["text"] for p in content), where)
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
