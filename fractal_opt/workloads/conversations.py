"""Conversations: users whose next prompt is the whole history plus the next user message.

A conversation is a system prompt (shared by every user of a suite, optionally with a document
after it) and a list of turns, each a user message with an optional reference answer. The load mode
``conversations`` (:mod:`fractal_opt.measure.conversation_load`) replays them turn by turn; this
module only reads them, from three shapes of data (a packaged or own ``.yaml``, or ``.jsonl`` /
``.json`` lines):

- the packaged shape: ``{system: ..., document: ..., conversations: [{id, turns: [{user, assistant}]}]}``;
- ShareGPT: ``{"id": ..., "conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}``;
- OpenAI messages: ``{"id": ..., "messages": [{"role": "system" | "user" | "assistant", "content": ...}]}``.

Every user turn of a file is replayed, not only the first (a benchmark that replays first turns
only sees no prefix reuse at all). A reference answer is what ``history: reference`` puts in the
history instead of the model's own answer.

Example:
    >>> convs = load_conversations({"system": "Be brief.", "conversations": [{"id": "c", "turns": [{"user": "Hi"}, {"user": "Why?"}]}]}, where="suite")
    >>> [len(c.turns) for c in convs], convs[0].first_request().messages[0]
    ([2], ('system', 'Be brief.'))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import RecipeError
from .request import Request

__all__ = ["Conversation", "is_conversation_data", "load_conversations"]

# ShareGPT's speaker names (the dataset uses several for the assistant) -> chat roles.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
                   "bing": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    """One user's conversation: a system prompt and its turns (user message, reference answer or None)."""

    id: str
    system: str | None
    turns: tuple[tuple[str, str | None], ...]

    def messages(self, turn: int, answers: list[str]) -> tuple[tuple[str, str], ...]:
        """The prompt of turn ``turn`` (0-based): the system prompt, every earlier turn with the
        answer in ``answers`` (the model's own or the reference), and this turn's user message."""
        pairs: list[tuple[str, str]] = [("system", self.system)] if self.system else []
        for k in range(turn):
            pairs += [("user", self.turns[k][0]), ("assistant", answers[k])]
        pairs.append(("user", self.turns[turn][0]))
        return tuple(pairs)

    def first_request(self) -> Request:
        """Turn 1 as a single request (what a conversation suite is when no conversation load runs)."""
        return Request(id=self.id, messages=self.messages(0, []))


def is_conversation_data(data: Any) -> bool:
    """True for the packaged shape or lines in ShareGPT shape (``conversations`` lists)."""
    if isinstance(data, dict):
        return "conversations" in data
    return isinstance(data, list) and bool(data) and isinstance(data[0], dict) and "conversations" in data[0]


def load_conversations(data: Any, *, where: str) -> list[Conversation]:
    """Every conversation of ``data`` (any of the three shapes), validated.

    Raises:
        RecipeError: a conversation without a user turn, a message that is not text, an unknown
            ShareGPT speaker or role, naming the conversation and the valid values.
    """
    from ..core.validate import Problems

    shared = None
    items = data
    if isinstance(data, dict):
        shared = _shared_system(data, where=where)
        items = data.get("conversations")
    if not isinstance(items, list) or not items:
        raise RecipeError(f"{where}: expected a non-empty list of conversations, got {_short(items)}.")
    found = Problems()
    out: list[Conversation] = []
    for i, item in enumerate(items):
        with found.collect():
            out.append(_one(item, index=i, shared=shared, where=where))
    found.raise_if_any()
    return out


def _shared_system(data: dict[str, Any], *, where: str) -> str | None:
    """The packaged shape's system prompt, with its document after it (both shared by all users)."""
    parts = []
    for key in ("system", "document"):
        value = data.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise RecipeError(f"{where}: {key!r} must be a non-empty string, got {_short(value)}.")
        if value:
            parts.append(value.strip())
    return "\n\n".join(parts) or None


def _one(item: Any, *, index: int, shared: str | None, where: str) -> Conversation:
    if not isinstance(item, dict):
        raise RecipeError(f"{where}: conversation {index + 1} must be a mapping with 'turns', 'conversations' or 'messages', got {_short(item)}.")
    cid = str(item.get("id", f"conversation-{index + 1}"))
    here = f"{where}: conversation {cid!r}"
    if "turns" in item:
        return _from_turns(item["turns"], cid=cid, system=shared, where=here)
    if "conversations" in item:
        messages = _sharegpt(item["conversations"], where=here)
    elif "messages" in item:
        messages = item["messages"]
    else:
        raise RecipeError(f"{here} needs 'turns' (the packaged shape), 'conversations' (ShareGPT) or 'messages' (OpenAI).")
    return _from_messages(messages, cid=cid, system=shared, where=here)


def _from_turns(turns: Any, *, cid: str, system: str | None, where: str) -> Conversation:
    if not isinstance(turns, list) or not turns:
        raise RecipeError(f"{where}: 'turns' must be a non-empty list of {{user, assistant}} mappings, got {_short(turns)}.")
    out = []
    for k, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or not isinstance(turn.get("user"), str) or not turn["user"].strip():
            raise RecipeError(f"{where}: turn {k} needs 'user' (a non-empty string), got {_short(turn)}.")
        answer = turn.get("assistant")
        if answer is not None and not isinstance(answer, str):
            raise RecipeError(f"{where}: turn {k}: 'assistant' must be a string (the reference answer), got {_short(answer)}.")
        unknown = sorted(set(turn) - {"user", "assistant"})
        if unknown:
            raise RecipeError(f"{where}: turn {k}: unknown keys {unknown}. Valid keys are: ['assistant', 'user'].")
        out.append((turn["user"], answer))
    return Conversation(id=cid, system=system, turns=tuple(out))


def _sharegpt(messages: Any, *, where: str) -> list[dict[str, str]]:
    """ShareGPT's ``{from, value}`` messages as ``{role, content}`` ones."""
    if not isinstance(messages, list):
        raise RecipeError(f"{where}: 'conversations' must be a list of {{from, value}} messages, got {_short(messages)}.")
    out = []
    for k, m in enumerate(messages, start=1):
        if not isinstance(m, dict) or "from" not in m or "value" not in m:
            raise RecipeError(f"{where}: message {k} must be a {{from, value}} mapping, got {_short(m)}.")
        role = _SHAREGPT_ROLES.get(str(m["from"]).lower())
        if role is None:
            raise RecipeError(f"{where}: message {k}: unknown speaker {m['from']!r}. Valid speakers are: {sorted(_SHAREGPT_ROLES)}.")
        out.append({"role": role, "content": m["value"]})
    return out


def _from_messages(messages: Any, *, cid: str, system: str | None, where: str) -> Conversation:
    """Turns from chat messages: a leading system message, then each user message with the
    assistant message after it (if any) as its reference answer; consecutive user messages are one turn."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
        raise RecipeError(f"{where}: 'messages' must be a list of {{role, content}} mappings, got {_short(messages)}.")
    own_system = None
    turns: list[list[Any]] = []
    for k, m in enumerate(messages, start=1):
        role, content = m["role"], m["content"]
        if not isinstance(content, str):
            raise RecipeError(f"{where}: message {k}: 'content' must be a string, got {_short(content)}.")
        if role == "system" and not turns and own_system is None:
            own_system = content
        elif role == "user":
            if turns and turns[-1][1] is None:
                turns[-1][0] += "\n\n" + content  # two user messages in a row are one turn
            else:
                turns.append([content, None])
        elif role == "assistant":
            if turns and turns[-1][1] is None:
                turns[-1][1] = content
            # an assistant message before any user turn (a greeting) is not a turn: left out
        else:
            raise RecipeError(f"{where}: message {k}: role {role!r} is not replayed. Valid roles are: ['assistant', 'system' (first only), 'user'].")
    if not turns:
        raise RecipeError(f"{where}: no user message to replay.")
    return Conversation(id=cid, system=own_system or system, turns=tuple((u, a) for u, a in turns))


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
