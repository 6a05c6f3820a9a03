"""Mapping a plan's model and application sections to ``model.generate`` keyword arguments.

The engine calls :func:`generate_kwargs` for every generate call; application-layer passes that
change decoding only need a plan field and a line here.
"""

from __future__ import annotations

from typing import Any

from .plan import Plan

__all__ = ["generate_kwargs"]


def generate_kwargs(plan: Plan, tokenizer: Any, *, budget: int) -> dict[str, Any]:
    """``generate()`` arguments for ``plan`` with a budget of ``budget`` new tokens."""
    app, mp = plan.application, plan.model
    kwargs: dict[str, Any] = {
        "max_new_tokens": budget,
        "do_sample": app.do_sample,
        "repetition_penalty": app.repetition_penalty,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if app.do_sample:
        kwargs.update(temperature=app.temperature, top_p=app.top_p, top_k=app.top_k if app.top_k else 0)
    else:
        # Neutralize sampling defaults a checkpoint's generation_config may carry, so greedy
        # means greedy (and transformers does not warn about unused sampling flags).
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if mp.kv_cache == "off":
        kwargs["use_cache"] = False
    elif mp.kv_cache == "static":
        kwargs["cache_implementation"] = "static"
    return kwargs
