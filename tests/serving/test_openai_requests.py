"""OpenAI request bodies checked: each refusal names the field; sampling fields pass through."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import BadRequest
from fractal_opt.serving.openai_requests import parse_chat, parse_completion

MSGS = [{"role": "user", "content": "hi"}]


def _param(body, parse=parse_chat) -> str:
    with pytest.raises(BadRequest) as e:
        parse(body)
    return e.value.param


def test_a_plain_chat_request_takes_the_plans_defaults():
    got = parse_chat({"model": "x", "messages": MSGS})
    assert got.messages == MSGS and got.max_tokens is None and got.stop == () and not got.stream
    parts = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert parts.messages == [{"role": "system", "content": "ab"}]
    got = parse_chat({"messages": MSGS, "stop": "\n", "max_completion_tokens": 5, "stream": True, "stream_options": {"include_usage": True}})
    assert (got.max_tokens, got.stop, got.stream, got.include_usage) == (5, ("\n",), True, True)


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": {"x": 1}}]}, "messages[0].content"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": "8"}, "max_tokens"),
    ({"messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": MSGS, "stop": [""]}, "stop"),
    ({"messages": MSGS, "n": 2}, "n"),
    ({"messages": MSGS, "stream": "yes"}, "stream"),
    ({"messages": MSGS, "temperature": 3}, "temperature"),
    ({"messages": MSGS, "temperature": -1}, "temperature"),
    ({"messages": MSGS, "temperature": "hot"}, "temperature"),
    ({"messages": MSGS, "top_p": 2}, "top_p"),
    ({"messages": MSGS, "top_p": 0}, "top_p"),
    ({"messages": MSGS, "seed": 1.5}, "seed"),
    ({"messages": MSGS, "seed": 2**64}, "seed"),
    ({"messages": MSGS, "seed": -(2**63) - 1}, "seed"),
    ({"messages": MSGS, "stop": "x" * 257}, "stop"),
    ({"messages": MSGS, "stream_options": []}, "stream_options"),
    ([1, 2], "body"),
])
def test_bad_fields_are_named(body, param):
    assert _param(body) == param


def test_sampling_fields_pass_through_and_omitted_ones_stay_none():
    got = parse_chat({"messages": MSGS, "temperature": 0.7, "top_p": 0.9, "seed": 3})
    assert (got.temperature, got.top_p, got.seed) == (0.7, 0.9, 3)
    got = parse_completion({"prompt": "a", "temperature": 0})
    assert (got.temperature, got.top_p, got.seed) == (0.0, None, None)


def test_completions_take_one_prompt():
    assert parse_completion({"prompt": ["Once"]}).messages == [{"role": "user", "content": "Once"}]
    assert _param({"prompt": ["a", "b"]}, parse=parse_completion) == "prompt"
    assert _param({"prompt": "a", "echo": True}, parse=parse_completion) == "echo"
    assert _param({"prompt": "a", "logprobs": 3}, parse=parse_completion) == "logprobs"


def test_continuous_usage_stats_false_asks_for_nothing_more_and_is_accepted():
    """guidellm's stream_options {include_usage: true, continuous_usage_stats: false} is a plain streamed request with usage at the end."""
    got = parse_chat({"messages": MSGS, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
    assert got.stream and got.include_usage


def test_a_seed_is_any_signed_64_bit_integer():
    """The ends of the signed 64-bit range are taken; one past either is refused naming the range."""
    assert parse_chat({"messages": MSGS, "seed": 2**63 - 1}).seed == 2**63 - 1
    assert parse_chat({"messages": MSGS, "seed": -(2**63)}).seed == -(2**63)
    with pytest.raises(BadRequest, match=r"signed 64-bit"):
        parse_chat({"messages": MSGS, "seed": 2**63})
