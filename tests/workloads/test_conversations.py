"""Conversation suites: the packaged shape, ShareGPT and OpenAI messages are read turn by turn,
and a bad file is refused naming the conversation, the field and what is allowed."""

from __future__ import annotations

import json

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.workloads.conversations import load_conversations
from fractal_opt.workloads.workload import Workload


def test_sharegpt_lines_replay_every_turn_with_their_answers(tmp_path):
    """A ShareGPT line gives one turn per human message, the gpt message after it as its reference answer."""
    line = {"id": "s1", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                          {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Why?"}]}
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (conv,) = Workload(suite=str(path), load={"mode": "conversations"}).conversations()
    assert conv.system == "Be brief." and conv.turns == (("Hi", "Hello!"), ("Why?", None))
    assert conv.messages(1, ["model said"]) == (("system", "Be brief."), ("user", "Hi"), ("assistant", "model said"), ("user", "Why?"))


def test_openai_messages_become_turns_not_one_request(tmp_path):
    """Under a conversations load an OpenAI-messages line is replayed turn by turn, all its user turns."""
    line = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                         {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]}
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (conv,) = Workload(suite=str(path), load={"mode": "conversations"}).conversations()
    assert [u for u, _ in conv.turns] == ["a", "c", "e"]


def test_packaged_suite_shares_one_system_prompt_and_serves_first_turns_as_requests():
    """The packaged conversations suite: 8 conversations of 4 turns under one system prompt; as
    single requests it is each conversation's first turn."""
    wl = Workload(suite="conversations")
    convs = wl.conversations()
    assert len(convs) == 8 and {len(c.turns) for c in convs} == {4} and len({c.system for c in convs}) == 1
    assert [r.messages[-1][1] for r in wl.requests()] == [c.turns[0][0] for c in convs]


def test_bad_conversations_name_the_conversation_and_what_is_allowed():
    """An unknown ShareGPT speaker and a turn without a user message are refused by name."""
    with pytest.raises(RecipeError, match=r"conversation 'x'.*unknown speaker 'robot'.*Valid speakers"):
        load_conversations([{"id": "x", "conversations": [{"from": "robot", "value": "hi"}]}], where="suite")
    with pytest.raises(RecipeError, match=r"conversation 'y': turn 2 needs 'user'"):
        load_conversations({"conversations": [{"id": "y", "turns": [{"user": "a"}, {"assistant": "b"}]}]}, where="suite")


def test_reference_history_needs_recorded_answers(tmp_path):
    """history: reference on a file without answers fails before any model loads, naming the turn."""
    path = tmp_path / "c.yaml"
    path.write_text("system: Be brief.\nconversations:\n  - id: q\n    turns:\n      - {user: a}\n      - {user: b}\n")
    with pytest.raises(RecipeError, match=r"'q' has no reference answer for turn 1.*history: model"):
        Workload(suite=str(path), load={"mode": "conversations", "history": "reference"}).requests()
