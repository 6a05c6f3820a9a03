"""A request bounded by the deployment before any compute: a prompt over the context, max_tokens
over the context left or the plan's cap, each refused naming both numbers (or lowered, where
serve is told to), on a model-less engine whose prompt tokens are its bytes."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import BadRequest
from fractal_opt.engine.protocol import ContextLimit, as_request, tightest
from fractal_opt.serving.bounds import MAX_TOKENS_CEILING, bound
from fractal_opt.serving.prompting import AtLeast
from fractal_opt.testing import FakeEngine
from fractal_opt.tower.plan import Plan

CONTEXT = 64  # the plan's context cap: prompt + answer tokens of one request


def _engine(*, context: int | None = CONTEXT, cap: int | None = None, prompt_budget: int | None = None) -> FakeEngine:
    plan = Plan(source="fake").replace_section("model", context_cap=context).replace_section("application", max_new_tokens=cap, prompt_budget=prompt_budget)
    return FakeEngine.factory()(plan)


def _text(tokens: int) -> str:
    return "a" * tokens  # FakeEngine counts one token a byte


def test_a_prompt_one_token_over_the_context_is_refused_naming_both_numbers():
    """A prompt of context + 1 tokens: 400 on messages, code context_length_exceeded, its count and the limit in the message."""
    with pytest.raises(BadRequest) as info:
        bound(_engine(), as_request(_text(CONTEXT + 1)), max_tokens=None)
    e = info.value
    assert e.param == "messages" and e.code == "context_length_exceeded"
    assert f"{CONTEXT + 1} tokens" in str(e) and f"context cap of {CONTEXT} tokens" in str(e) and "context_cap pass" in str(e)


def test_a_prompt_that_fills_the_context_leaves_no_room_and_is_refused():
    """A prompt of exactly the context's tokens leaves none for an answer: refused too."""
    with pytest.raises(BadRequest, match="no room for an answer") as info:
        bound(_engine(), as_request(_text(CONTEXT)), max_tokens=None)
    assert info.value.code == "context_length_exceeded"


def test_max_tokens_over_the_room_left_is_refused_and_at_it_is_served():
    """max_tokens one over what the prompt leaves: 400 naming max_tokens, the limit, the prompt and the room; exactly the room: bounded to it."""
    prompt = 10
    room = CONTEXT - prompt
    with pytest.raises(BadRequest) as info:
        bound(_engine(), as_request(_text(prompt)), max_tokens=room + 1, field="max_completion_tokens")
    e = info.value
    assert e.param == "max_completion_tokens" and e.code == "max_tokens_over_context"
    assert f"got {room + 1}" in str(e) and f"the prompt takes {prompt}" in str(e) and f"at most {room}" in str(e)
    ok = bound(_engine(), as_request(_text(prompt)), max_tokens=room)
    assert (ok.prompt_tokens, ok.max_new_tokens, ok.limit.tokens) == (prompt, room, CONTEXT)


def test_max_tokens_of_10_to_the_12_is_refused_at_once():
    """max_tokens 10^12 is a 400 naming the context, without generating anything."""
    with pytest.raises(BadRequest, match="1,000,000,000,000") as info:
        bound(_engine(), as_request("hi"), max_tokens=10**12)
    assert info.value.code == "max_tokens_over_context"


def test_an_omitted_max_tokens_is_lowered_to_the_room_left():
    """No max_tokens: the plan's budget, lowered to what the context leaves (the answer ends there with finish_reason length)."""
    engine = _engine()
    assert engine.budget(None) > CONTEXT
    assert bound(engine, as_request(_text(20)), max_tokens=None).max_new_tokens == CONTEXT - 20


def test_the_plans_cap_is_refused_honoured_or_lowered_as_serve_says():
    """max_tokens over application.max_new_tokens: refuse (400 naming the cap), honour (up to the context), cap (lowered to it)."""
    engine = _engine(cap=8)
    with pytest.raises(BadRequest, match="cap of 8 tokens") as info:
        bound(engine, as_request("hi"), max_tokens=20)
    assert info.value.code == "max_tokens_over_cap"
    assert bound(engine, as_request("hi"), max_tokens=20, over_cap="honour").max_new_tokens == 20
    assert bound(engine, as_request("hi"), max_tokens=20, over_cap="cap").max_new_tokens == 8
    with pytest.raises(BadRequest, match="leaves 62"):  # honouring the cap never honours past the context
        bound(engine, as_request("hi"), max_tokens=CONTEXT, over_cap="honour")
    assert bound(engine, as_request("hi"), max_tokens=CONTEXT, over_cap="cap").max_new_tokens == 8


def test_cap_mode_lowers_max_tokens_over_the_context_instead_of_refusing():
    """--max-tokens-over-cap cap on a plan without a cap: a max_tokens over the room left is lowered to it."""
    assert bound(_engine(), as_request(_text(60)), max_tokens=10**12, over_cap="cap").max_new_tokens == CONTEXT - 60


def test_without_a_known_context_max_tokens_is_still_bounded():
    """An engine that knows no context: max_tokens past what any runtime takes (2^31 - 1) is a 400 naming the range."""
    engine = _engine(context=None)
    assert engine.context_limit() is None
    assert bound(engine, as_request("hi"), max_tokens=MAX_TOKENS_CEILING, over_cap="honour").max_new_tokens == MAX_TOKENS_CEILING
    with pytest.raises(BadRequest, match=r"expected an integer in \[1, 2,147,483,647\]"):
        bound(engine, as_request("hi"), max_tokens=2**64)


def test_a_prompt_known_only_from_below_says_at_least():
    """A count the engine gave from the prompt's size alone (AtLeast) is named as a floor."""
    engine = _engine()
    engine.count_prompt = lambda request, limit=None: AtLeast(5000)  # type: ignore[method-assign]
    with pytest.raises(BadRequest, match="at least 5,000 tokens"):
        bound(engine, as_request("hi"), max_tokens=None)


def test_the_prompt_budget_is_named_when_trimming_could_not_make_it_fit():
    """With a prompt_budget the count is after trimming; a prompt still over the context says the budget was tried."""
    engine = _engine(prompt_budget=32)
    with pytest.raises(BadRequest, match="prompt_budget of 32 trimmed what it could"):
        bound(engine, as_request(_text(100)), max_tokens=None)


def test_the_tightest_limit_wins():
    """tightest() picks the smallest known limit; a tie keeps the first (its wording)."""
    cap, model = ContextLimit(64, "this deployment's context cap"), ContextLimit(4096, "the model's context")
    assert tightest(None, model, cap) == cap and tightest(None, None) is None
    assert tightest(ContextLimit(64, "first"), ContextLimit(64, "second")).what == "first"
