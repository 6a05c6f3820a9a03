"""Prompt budgets: keep a request's prompt within a token budget with a named strategy.

The fastest prompt token is the one never prefilled. Three strategies, one per kind of workload:

- ``recent_turns`` (chat): keep every system message and the most recent turns; older turns are
  dropped oldest first, a user turn together with the assistant reply that follows it, so the kept
  history still starts with a user turn. The last message is always kept.
- ``head_tail`` (documents): cut the middle out of the longest message, keeping its first and last
  tokens (``head_share`` of the kept tokens from the head) joined by the marker ``\\n[...]\\n``.
  Instructions usually sit at the start or the end of a long prompt; the middle is filler.
- ``drop_chunks`` (RAG): retrieved passages are paragraphs that start with a numbered marker such
  as ``[3]`` (a request's ``chunks:`` list is rendered that way, see workload.py). Passages are
  dropped from the last one back (retrievers rank the best first) until the prompt fits.

Budgets count the whole rendered prompt (chat template included), as the model sees it. When a
strategy cannot reach the budget (a single message longer than it under ``recent_turns``, or no
chunk left to drop) it returns the best it could do; :class:`Fitted` says whether it fits.

Example:
    >>> from fractal_opt.prompting import WordTokens, fit_prompt
    >>> chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one two three"},
    ...         {"role": "assistant", "content": "four five"}, {"role": "user", "content": "six"}]
    >>> fit_prompt(chat, budget=5, strategy="recent_turns", tokens=WordTokens()).messages[-1]["content"]
    'six'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.errors import BadRequest, RecipeError, closest

__all__ = ["STRATEGIES", "AtLeast", "Fitted", "HFTokens", "Tokens", "WordTokens", "fit_prompt", "split_chunks"]

STRATEGIES = ("recent_turns", "head_tail", "drop_chunks")
MARKER = "\n[...]\n"  # stands where head_tail removed the middle of a message
_CHUNK = re.compile(r"^\s*\[\d+\]")  # a retrieved passage starts with "[n]"
_MAX_ROUNDS = 8  # head_tail re-tokenizes to absorb boundary effects; a few rounds always suffice

Messages = list[dict[str, str]]


class Tokens(Protocol):
    """What a strategy needs from a tokenizer: count a rendered prompt, encode and decode text."""

    def count(self, messages: Sequence[dict[str, str]]) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Fitted:
    """A prompt after trimming, with its token counts before and after."""

    messages: Messages
    tokens_before: int
    tokens_after: int
    budget: int
    note: str = ""  # what was cut, for reports and debugging

    @property
    def saved(self) -> int:
        """Prompt tokens removed (never negative)."""
        return max(0, self.tokens_before - self.tokens_after)

    @property
    def fits(self) -> bool:
        return self.tokens_after <= self.budget


def fit_prompt(messages: Sequence[dict[str, str]], *, budget: int, strategy: str, tokens: Tokens, head_share: float = 0.5) -> Fitted:
    """Trim ``messages`` to at most ``budget`` prompt tokens with ``strategy``.

    Args:
        messages: chat messages (``{"role", "content"}``); not modified.
        budget: maximum tokens of the rendered prompt.
        strategy: one of :data:`STRATEGIES`.
        tokens: the tokenizer adapter (:class:`HFTokens` for a transformers tokenizer).
        head_share: ``head_tail`` only: the share of kept tokens taken from the head (0..1).

    Raises:
        RecipeError: an unknown strategy (with the valid ones and the closest match).
    """
    if strategy not in STRATEGIES:
        raise RecipeError(f"prompt budget: unknown strategy {strategy!r}. Valid strategies are: {list(STRATEGIES)}.{closest(strategy, STRATEGIES)}")
    msgs = [dict(m) for m in messages]
    before = tokens.count(msgs)
    if before <= budget:
        return Fitted(msgs, before, before, budget)
    if strategy == "recent_turns":
        out, note = _recent_turns(msgs, budget, tokens)
    elif strategy == "head_tail":
        out, note = _head_tail(msgs, budget, tokens, head_share)
    else:
        out, note = _drop_chunks(msgs, budget, tokens)
    return Fitted(out, before, tokens.count(out), budget, note)


def _recent_turns(msgs: Messages, budget: int, tokens: Tokens) -> tuple[Messages, str]:
    system = [i for i, m in enumerate(msgs) if m["role"] == "system"]
    turns = [i for i, m in enumerate(msgs) if m["role"] != "system"]
    if len(turns) <= 1:
        return msgs, "nothing to drop: one turn"
    start = 0
    keep = msgs
    while start < len(turns) - 1:
        start += 1
        # Never begin the kept history with an assistant reply to a question that was dropped.
        while start < len(turns) - 1 and msgs[turns[start]]["role"] == "assistant":
            start += 1
        kept_idx = sorted(system + turns[start:])
        keep = [msgs[i] for i in kept_idx]
        if tokens.count(keep) <= budget:
            break
    return keep, f"dropped the {start} oldest turn(s)"


def _head_tail(msgs: Messages, budget: int, tokens: Tokens, head_share: float) -> tuple[Messages, str]:
    encoded = [tokens.encode(m["content"]) for m in msgs]
    target = max(range(len(msgs)), key=lambda i: len(encoded[i]))
    ids = encoded[target]
    marker = len(tokens.encode(MARKER))
    keep = len(ids) - (tokens.count(msgs) - budget) - marker
    out = msgs
    for _ in range(_MAX_ROUNDS):
        keep = max(0, keep)
        head = round(keep * head_share)
        tail = keep - head
        content = tokens.decode(ids[:head]) + MARKER + (tokens.decode(ids[len(ids) - tail :]) if tail else "")
        out = [*msgs[:target], {**msgs[target], "content": content}, *msgs[target + 1 :]]
        over = tokens.count(out) - budget
        if over <= 0 or keep == 0:
            break
        keep -= over
    return out, f"cut the middle of message {target}: kept {keep} of {len(ids)} tokens"


def split_chunks(content: str) -> list[tuple[bool, str]]:
    """Split a message into paragraphs, each flagged True when it is a retrieved passage (``[n] ...``).

    Paragraphs are separated by blank lines; joining the pieces with ``"\\n\\n"`` restores the text
    up to the exact blank-line whitespace.
    """
    return [(bool(_CHUNK.match(p)), p) for p in re.split(r"\n[ \t]*\n", content)]


def _drop_chunks(msgs: Messages, budget: int, tokens: Tokens) -> tuple[Messages, str]:
    parts = {i: split_chunks(m["content"]) for i, m in enumerate(msgs)}
    # Every passage, last first: (message index, paragraph index).
    order = [(i, j) for i in sorted(parts, reverse=True) for j in range(len(parts[i]) - 1, -1, -1) if parts[i][j][0]]
    if not order:
        return msgs, "no retrieved passages ([n] paragraphs) to drop"
    dropped: set[tuple[int, int]] = set()
    out = msgs
    for pos in order:
        dropped.add(pos)
        out = [
            {**m, "content": "\n\n".join(p for j, (_, p) in enumerate(parts[i]) if (i, j) not in dropped)} if any(d[0] == i for d in dropped) else m
            for i, m in enumerate(msgs)
        ]
        if tokens.count(out) <= budget:
            break
    return out, f"dropped {len(dropped)} of {len(order)} retrieved passages"


class HFTokens:
    """:class:`Tokens` over a transformers tokenizer, counting prompts as the engine renders them
    (``prompt_format``: :class:`fractal_opt.weights.prompts.PromptFormat`; None: the tokenizer's own)."""

    def __init__(self, tokenizer: Any, prompt_format: Any = None):
        from ..weights.prompts import prompt_format as format_of

        self.tokenizer = tokenizer
        self.format = prompt_format if prompt_format is not None or tokenizer is None else format_of(tokenizer)
        self._longest: int | None = None  # the most UTF-8 bytes one token's spelling holds (read from the vocabulary once)

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt text the model reads (:class:`fractal_opt.weights.prompts.PromptFormat`).

        Raises:
            BadRequest: the chat template refuses the messages (a template's own check, such as
                roles that must alternate).
        """
        from jinja2 import TemplateError

        try:
            return self.format.render(messages, self.tokenizer)
        except TemplateError as e:
            raise BadRequest("messages", f"the model's chat template refuses these messages: {e}") from None

    def count(self, messages: Sequence[dict[str, str]], *, limit: int | None = None) -> int:
        """The prompt's tokens, as :func:`fractal_opt.weights.prompts.prompt_ids` gives them. With
        ``limit``, a prompt certain to be longer than that from its size alone is not tokenized
        (4 MB take seconds): :class:`AtLeast` its floor is returned.

        The floor: no token spans more of the text than its own spelling, in UTF-8 bytes, holds (the
        vocabulary's longest), and a normalizer shrinks text at most 4-fold (a 4-byte character to a
        1-byte one), so a text of B bytes holds at least B / (4 x longest) tokens.
        """
        from ..weights.prompts import tokenize

        text = self.render(messages)
        if limit is not None and (floor := len(text.encode("utf-8")) // (4 * self.longest())) > limit:
            return AtLeast(floor)
        return len(tokenize(self.tokenizer, self.format, text))

    def longest(self) -> int:
        """The most UTF-8 bytes one token's spelling in the vocabulary holds."""
        if self._longest is None:
            self._longest = max((len(token.encode("utf-8")) for token in self.tokenizer.get_vocab()), default=1) or 1
        return self._longest

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


class AtLeast(int):
    """A token count known from below only: the prompt holds this many tokens or more."""


class WordTokens:
    """A whitespace 'tokenizer' for examples and tests: one token per word, plus one per message."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = []

    def count(self, messages: Sequence[dict[str, str]]) -> int:
        return sum(1 + len(m["content"].split()) for m in messages)

    def encode(self, text: str) -> list[int]:
        out = []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = len(self._words)
                self._words.append(word)
            out.append(self._ids[word])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self._words[i] for i in ids)
