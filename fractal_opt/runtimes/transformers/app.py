"""The engine's application-layer state: prompt budget, response cache and draft model.

The engine owns one :class:`AppRuntime` per built plan. It keeps what the application section of
the plan needs at serving time, so engine.py only calls into it:

- :meth:`AppRuntime.fit` / :meth:`AppRuntime.fit_counted` trim a request to the plan's prompt
  budget (prompting.py) and count the prompt tokens saved;
- :meth:`AppRuntime.lookup` / :meth:`AppRuntime.store` consult the response cache, keyed by the
  request and every plan field that changes the answer;
- :meth:`AppRuntime.generate_extras` adds the draft model for assisted decoding (loaded once per
  source and cached here, outside the main weights cache);
- :func:`trim_stop` cuts the answer's text before the first stop sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ...core.errors import EngineError
from ...serving.prompting import HFTokens, fit_prompt
from ...serving.response_cache import CacheHit, ResponseCache
from ...tower.plan import Plan
from ...workloads.workload import Request

__all__ = ["AppRuntime", "trim_stop"]

# Draft models by (source, device, dtype): one entry, since a run tries one draft at a time.
_DRAFTS: dict[tuple, Any] = {}


class AppRuntime:
    """Serving-time state for ``plan.application`` (see the module docstring)."""

    def __init__(self, plan: Plan, tokenizer: Any, prompt_format: Any = None):
        self.plan = plan
        self.app = plan.application
        self.tokens = HFTokens(tokenizer, prompt_format)
        self.cache: ResponseCache | None = None
        if self.app.response_cache:
            self.cache = ResponseCache(mode=self.app.response_cache, max_entries=self.app.cache_max_entries, ttl_s=self.app.cache_ttl_s, threshold=self.app.cache_threshold)
        self.draft: Any = None
        self.saved: dict[str, int] = {}  # request id -> prompt tokens the budget removed (latest fit)

    def prepare(self, main_tokenizer: Any, *, progress: Callable[[str], None] = print) -> None:
        """Load what serving needs before the clock runs: the draft model, the embedding model."""
        if self.app.draft:
            self.draft = _load_draft(self.plan, main_tokenizer, progress=progress)
        if self.cache is not None and self.cache.mode == "semantic":
            self.cache.embed(["warm up"])  # loads all-MiniLM-L6-v2 now, not inside a timed request

    # ------------------------------------------------------------------ prompt budget
    def fit(self, request: Request) -> Request:
        """The request trimmed to the prompt budget; the tokens saved go to ``saved[request.id]``."""
        return self.fit_counted(request)[0]

    def fit_counted(self, request: Request) -> tuple[Request, int]:
        """The request trimmed to the prompt budget, and the prompt tokens that removed.

        Called while the prompt is encoded, inside the request's timing, so trimming costs count.
        The count is returned (not only kept in ``saved``): concurrent requests may share an id.
        """
        if not self.app.prompt_budget:
            return request, 0
        fitted = fit_prompt(request.as_messages(), budget=self.app.prompt_budget, strategy=self.app.prompt_strategy, tokens=self.tokens, head_share=self.app.head_share)
        self.saved[request.id] = fitted.saved
        if not fitted.saved:
            return request, 0
        return dataclasses.replace(request, messages=tuple((m["role"], m["content"]) for m in fitted.messages)), fitted.saved

    def count(self, request: Request, *, limit: int | None = None) -> int:
        """The request's prompt tokens as the model reads it: rendered with the chat template and
        trimmed to the prompt budget (what :meth:`fit_counted` then encodes). ``limit``: a prompt
        certain to be longer is not tokenized (:meth:`HFTokens.count`), unless a budget trims it."""
        messages = request.as_messages()
        if not self.app.prompt_budget:
            return self.tokens.count(messages, limit=limit)
        return fit_prompt(messages, budget=self.app.prompt_budget, strategy=self.app.prompt_strategy, tokens=self.tokens, head_share=self.app.head_share).tokens_after

    # ------------------------------------------------------------------ response cache
    def params_key(self, budget: int) -> tuple:
        """Everything besides the messages that decides the answer: the model and decoding."""
        app = dataclasses.asdict(self.app)
        for name in ("response_cache", "cache_max_entries", "cache_ttl_s", "cache_threshold", "prompt_lookup_tokens", "draft", "draft_tokens"):
            app.pop(name)  # caching and speculation never change which answer is right
        return (self.plan.numerics_key(), budget, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in app.items())))

    def lookup(self, request: Request, budget: int, *, ignore_eos: bool = False) -> CacheHit | None:
        """The cached answer for ``request`` (None without a cache). ``ignore_eos`` answers are
        kept apart: they run past end-of-sequence, so they are other answers."""
        if self.cache is None:
            return None
        return self.cache.lookup(request.as_messages(), (*self.params_key(budget), ignore_eos))

    def store(self, request: Request, budget: int, value: dict[str, Any], *, ignore_eos: bool = False) -> None:
        if self.cache is not None:
            self.cache.store(request.as_messages(), (*self.params_key(budget), ignore_eos), value)

    def generate_extras(self) -> dict[str, Any]:
        """generate() arguments that hold objects rather than plan values (the draft model)."""
        return {"assistant_model": self.draft} if self.draft is not None else {}


def trim_stop(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to the first stop sequence (which is left out, as chat APIs do)."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def _load_draft(plan: Plan, main_tokenizer: Any, *, progress: Callable[[str], None]) -> Any:
    """Load the draft model on the plan's hardware (no quantization) and check its vocabulary."""
    from .loading import load

    draft_plan = Plan(source=plan.application.draft or "", hardware=plan.hardware)
    key = draft_plan.weights_key()
    if key not in _DRAFTS:
        _DRAFTS.clear()
        progress(f"loading draft model {draft_plan.source}")
        model, tokenizer = load(draft_plan, progress=progress)
        if tokenizer.get_vocab() != main_tokenizer.get_vocab():
            msg = (
                f"assisted decoding: draft model {draft_plan.source!r} has a different tokenizer vocabulary than {plan.source!r} "
                f"({len(tokenizer.get_vocab())} vs {len(main_tokenizer.get_vocab())} entries); choose a draft from the same model family"
            )
            raise EngineError(msg)
        _DRAFTS[key] = model
    return _DRAFTS[key]
