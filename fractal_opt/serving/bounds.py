"""A request bounded by what the deployment can do, before any compute.

``fractal-opt serve`` calls :func:`bound` on every completion request before it is queued: the
prompt is counted once, as the model will read it (:meth:`Engine.count_prompt`: chat template
included, after the plan's prompt budget trimmed it), and compared with the tokens one request
may hold (:meth:`Engine.context_limit`: the model's context, the plan's ``context_cap``, the
runtime's cache per request). Then:

- a prompt that leaves no room for an answer is refused (``context_length_exceeded``), naming its
  token count and the limit;
- ``max_tokens`` above the room the prompt leaves is refused (``max_tokens_over_context``), naming
  both numbers, unless serve lowers it (``over_cap="cap"``); an omitted ``max_tokens`` takes the
  plan's budget, lowered to that room, as vLLM and llama-server do;
- ``max_tokens`` above the plan's own cap (``application.max_new_tokens``) is refused, honoured or
  lowered to the cap (``over_cap``); a lowered answer that reaches it ends with ``finish_reason``
  ``"length"``, as any answer cut by its budget;
- where nothing is known of the context, ``max_tokens`` is still bounded by
  :data:`MAX_TOKENS_CEILING`.

Pure arithmetic over the Engine protocol, so every runtime is bounded alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..core.errors import BadRequest
from .prompting import AtLeast

if TYPE_CHECKING:
    from ..engine.protocol import ContextLimit
    from ..workloads.workload import Request

__all__ = ["MAX_TOKENS_CEILING", "OVER_CAP", "Bounded", "bound"]

MAX_TOKENS_CEILING = 2**31 - 1  # llama.cpp reads n_predict into a C int; no runtime takes more
OVER_CAP = ("refuse", "honour", "cap")  # serve --max-tokens-over-cap
OverCap = Literal["refuse", "honour", "cap"]


@dataclass(frozen=True)
class Bounded:
    """A request within bounds: its prompt tokens (None where the engine cannot count them), the
    token budget it runs with, and the context limit it was checked against (None: unknown)."""

    prompt_tokens: int | None
    max_new_tokens: int
    limit: ContextLimit | None


def bound(engine: Any, request: Request, *, max_tokens: int | None, field: str = "max_tokens", over_cap: OverCap = "refuse") -> Bounded:
    """``request`` checked against ``engine``'s context and the plan's cap, with the budget it runs with.

    Args:
        engine: a built Engine (its ``plan``, ``context_limit``, ``count_prompt``, ``budget``).
        request: the request as it will be submitted.
        max_tokens: the answer length the client asked for (None: the plan's budget).
        field: the name the client used for it (``max_tokens`` or ``max_completion_tokens``).
        over_cap: a ``max_tokens`` over the plan's cap or over the context left: refused with a
            400 (``refuse``), honoured up to the context (``honour``), or lowered to them (``cap``).

    Raises:
        BadRequest: the prompt leaves no room for an answer (``param`` "messages"), or
            ``max_tokens`` is over what the plan or the context allows (``param`` ``field``).
    """
    limit = engine.context_limit()
    prompt = engine.count_prompt(request, limit=limit.tokens) if limit is not None else None
    if limit is not None and prompt is not None and prompt >= limit.tokens:
        raise BadRequest("messages", _prompt_too_long(engine, prompt, limit), code="context_length_exceeded")
    room = None if limit is None else limit.tokens - (prompt if prompt is not None else 1)
    budget = engine.budget(None) if max_tokens is None else _asked(engine, max_tokens, field, over_cap)
    if room is not None and budget > room:
        if max_tokens is not None and over_cap != "cap":
            given = f"the prompt takes {prompt:,}" if prompt is not None else "the prompt takes at least 1"
            msg = (f"'{field}': got {_count(max_tokens)}, but {limit} and {given}, which leaves {room:,} for the answer: ask for at most {room:,} "
                   "(or omit it: the answer then ends at the context), or start serve with --max-tokens-over-cap cap to have it lowered.")
            raise BadRequest(field, msg, code="max_tokens_over_context")
        budget = room  # ends with finish_reason "length" once it reaches the context
    if budget > MAX_TOKENS_CEILING:
        raise BadRequest(field, f"'{field}': got {_count(budget)}, expected an integer in [1, {MAX_TOKENS_CEILING:,}].")
    return Bounded(prompt_tokens=prompt, max_new_tokens=budget, limit=limit)


def _asked(engine: Any, max_tokens: int, field: str, over_cap: OverCap) -> int:
    """The budget a request's own ``max_tokens`` gives under the plan's cap."""
    cap = engine.plan.application.max_new_tokens
    if not cap or max_tokens <= cap or over_cap == "honour":
        return max_tokens
    if over_cap == "cap":
        return cap
    msg = (f"'{field}': got {_count(max_tokens)}, above this plan's cap of {cap} tokens (its application.max_new_tokens, the max_new_tokens pass): "
           f"ask for at most {cap}, or start serve with --max-tokens-over-cap honour (or cap, to have it lowered).")
    raise BadRequest(field, msg, code="max_tokens_over_cap")


def _prompt_too_long(engine: Any, prompt: int, limit: ContextLimit) -> str:
    app = engine.plan.application
    trimmed = f", after the plan's prompt_budget of {app.prompt_budget:,} trimmed what it could ({app.prompt_strategy})" if app.prompt_budget else ""
    over = "which leaves no room for an answer" if prompt == limit.tokens else f"over {limit}"
    room = f"{limit.tokens - 1:,} tokens or fewer" if limit.tokens > 1 else "fewer tokens"
    hint = "" if app.prompt_budget else " (a prompt_budget pass trims long prompts)"
    size = f"at least {prompt:,} tokens (from its size alone)" if isinstance(prompt, AtLeast) else f"{prompt:,} tokens"
    return (f"the prompt is {size} as the model reads it (chat template included{trimmed}), {over}"
            f"{'' if prompt > limit.tokens else f' ({limit})'}. Send {room}{hint}.")


def _count(n: int) -> str:
    """``n`` with thousands separators, or its first digits and length when it is absurdly long."""
    text = f"{n:,}"
    return text if len(text) <= 40 else f"{str(n)[:12]}... ({len(str(n))} digits)"
