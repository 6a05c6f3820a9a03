"""One chat request of a workload: its id and messages, read from a suite's data.

Its own module so that what reads requests (the workload, conversations) imports it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import RecipeError

__all__ = ["Request"]


@dataclass(frozen=True)
class Request:
    """One chat request: a list of ``{"role", "content"}`` messages."""

    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs, frozen for hashing

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]

    @classmethod
    def from_data(cls, data: Any, *, index: int, where: str) -> Request:
        if isinstance(data, str):
            data = {"prompt": data}
        if not isinstance(data, dict):
            raise RecipeError(f"{where}: request {index} must be a mapping with 'messages' or 'prompt', got {_short(data)}.")
        rid = str(data.get("id", f"request-{index + 1}"))
        if "messages" in data:
            messages = data["messages"]
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
                raise RecipeError(f"{where}: request {rid!r}: 'messages' must be a non-empty list of {{role, content}} mappings, got {_short(messages)}.")
            bad = [m for m in messages if not isinstance(m["role"], str) or not isinstance(m["content"], str)]
            if bad:
                raise RecipeError(f"{where}: request {rid!r}: a message's role and content must be strings, got {_short(bad[0])}.")
            pairs = tuple((m["role"], m["content"]) for m in messages)
        elif "prompt" in data:
            if not isinstance(data["prompt"], str) or not data["prompt"].strip():
                raise RecipeError(f"{where}: request {rid!r}: 'prompt' must be a non-empty string, got {_short(data['prompt'])}.")
            pairs = (("user", data["prompt"]),)
        else:
            raise RecipeError(f"{where}: request {rid!r} needs 'messages' (a chat) or 'prompt' (one user turn).")
        if "chunks" in data:
            pairs = _with_chunks(pairs, data["chunks"], where=f"{where}: request {rid!r}")
        return cls(id=rid, messages=pairs)


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a suite may hold megabytes of prompt)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _with_chunks(pairs: tuple[tuple[str, str], ...], chunks: Any, *, where: str) -> tuple[tuple[str, str], ...]:
    """Put retrieved passages (best first) before the last user message as ``[1] ...`` paragraphs,
    the form the ``drop_chunks`` prompt budget recognizes (fractal_opt/prompting.py)."""
    if not isinstance(chunks, list) or not all(isinstance(c, str) and c.strip() for c in chunks):
        raise RecipeError(f"{where}: 'chunks' must be a list of non-empty strings (retrieved passages, best first), got {chunks!r}.")
    last = max((i for i, (role, _) in enumerate(pairs) if role == "user"), default=None)
    if last is None:
        raise RecipeError(f"{where}: 'chunks' needs a user message to attach the passages to.")
    context = "\n\n".join(f"[{i}] {' '.join(c.split())}" for i, c in enumerate(chunks, start=1))
    role, content = pairs[last]
    return (*pairs[:last], (role, f"Context:\n\n{context}\n\n{content}"), *pairs[last + 1 :])
