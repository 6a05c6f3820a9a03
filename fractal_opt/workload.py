"""Workload: what is measured — a suite of chat requests, a token budget, seeds and repeats.

Suites are data files: the packaged ones live in ``fractal_opt/data/suites/NAME.yaml``; a recipe can
also point ``suite:`` at its own ``.yaml`` (same shape) or ``.jsonl`` file (one request per line:
``{"id": ..., "messages": [...]}`` or ``{"prompt": "..."}``). A request may add ``"chunks": [...]``
(retrieved passages, best first): they are put before the last user message as ``[1] ...``
paragraphs, which the ``drop_chunks`` prompt budget can drop. docs/workloads.md lists the suites.

Example:
    >>> from fractal_opt.workload import Workload
    >>> wl = Workload(suite="default", max_new_tokens=32)
    >>> [r.id for r in wl.requests()][:2]
    ['short-1', 'short-2']
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .errors import RecipeError, closest

__all__ = ["Request", "Workload", "packaged_suites"]


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
            raise RecipeError(f"{where}: request {index} must be a mapping with 'messages' or 'prompt', got {data!r}.")
        rid = str(data.get("id", f"request-{index + 1}"))
        if "messages" in data:
            messages = data["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
                raise RecipeError(f"{where}: request {rid!r}: 'messages' must be a list of {{role, content}} mappings.")
            pairs = tuple((str(m["role"]), str(m["content"])) for m in messages)
        elif "prompt" in data:
            pairs = (("user", str(data["prompt"])),)
        else:
            raise RecipeError(f"{where}: request {rid!r} needs 'messages' (a chat) or 'prompt' (one user turn).")
        if "chunks" in data:
            pairs = _with_chunks(pairs, data["chunks"], where=f"{where}: request {rid!r}")
        return cls(id=rid, messages=pairs)


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


def packaged_suites() -> list[str]:
    """Names of the suites shipped with fractal_opt."""
    folder = resources.files("fractal_opt") / "data" / "suites"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What each measurement runs.

    Attributes:
        suite: a packaged suite name (``fractal_opt.workload.packaged_suites()``) or a path to a
            ``.yaml`` / ``.jsonl`` file of requests.
        max_new_tokens: the token budget per request (generation stops earlier at end-of-sequence).
        repeats: timed passes over the suite per measurement (the warm-up is extra).
        max_repeats: budget for adaptive repeats: when a comparison's interval is still too wide
            after ``repeats`` rounds, rounds are added up to this many (None = ``repeats``, no extension).
        warmup: untimed passes over the suite (8 tokens each) after every build; kernels, caches
            and torch.compile warm up here.
        seed: seed for sampling, reset before every request so runs compare like for like.
        limit: use only the first ``limit`` requests of the suite (None = all).
        load: how requests arrive (``{mode: closed|poisson, concurrency, rate, requests,
            output_tokens, ...}``, see :class:`fractal_opt.load.LoadProfile`). With it, every plan is
            measured through a server under that load (aggregate tokens/s, TTFT / ITL percentiles);
            without it, the suite is served synchronously.
    """

    suite: str = "default"
    max_new_tokens: int = 64
    repeats: int = 3
    max_repeats: int | None = None
    warmup: int = 1
    seed: int = 0
    limit: int | None = None
    load: dict[str, Any] | None = None  # a load profile (fractal_opt.load.LoadProfile): measure through a server under load

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("repeats", 1), ("warmup", 0)):
            if getattr(self, name) < low:
                raise RecipeError(f"workload, key {name!r}: got {getattr(self, name)}, expected an integer >= {low}.")
        if self.max_repeats is not None and self.max_repeats < self.repeats:
            raise RecipeError(f"workload, key 'max_repeats': got {self.max_repeats}, expected an integer >= repeats ({self.repeats}) or null.")
        if self.limit is not None and self.limit < 1:
            raise RecipeError(f"workload, key 'limit': got {self.limit}, expected an integer >= 1 or null.")
        if self.load is not None:
            self.load_profile()  # validates now, before any model loads

    def load_profile(self):
        """The ``load`` key as a :class:`fractal_opt.load.LoadProfile` (None without one)."""
        from .load import LoadProfile

        return None if self.load is None else LoadProfile.from_data(self.load)

    def requests(self) -> list[Request]:
        """Load the suite's requests (validated)."""
        data = _load_suite(self.suite)
        where = f"workload suite {self.suite!r}"
        raw = data.get("requests") if isinstance(data, dict) else data
        if not isinstance(raw, list) or not raw:
            raise RecipeError(f"{where}: expected a non-empty list of requests.")
        requests = [Request.from_data(item, index=i, where=where) for i, item in enumerate(raw)]
        return requests[: self.limit] if self.limit else requests


def _load_suite(suite: str) -> Any:
    path = Path(suite).expanduser()
    if path.suffix in (".yaml", ".yml", ".jsonl", ".json"):
        if not path.is_file():
            raise RecipeError(f"workload, key 'suite': file {suite!r} does not exist.")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            try:
                return [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as e:
                raise RecipeError(f"workload suite {suite!r}: line {e.lineno} is not valid JSON: {e.msg}.") from None
        return yaml.safe_load(text)
    names = packaged_suites()
    if suite not in names:
        msg = f"workload, key 'suite': unknown suite {suite!r}. Packaged suites are: {names}, or give a path to a .yaml/.jsonl file.{closest(suite, names)}"
        raise RecipeError(msg)
    text = (resources.files("fractal_opt") / "data" / "suites" / f"{suite}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)
