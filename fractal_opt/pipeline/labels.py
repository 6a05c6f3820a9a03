"""How a step is named in reports: the pass and only the parameters that differ from its defaults.

``batching(mode=static, batch_size=6)`` rather than every field of the pass; trace.json keeps all
of them (``Step.params``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..validate import plain

__all__ = ["non_default_params", "pass_label"]


def non_default_params(pass_name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` without the ones equal to the pass's defaults, except the first (all of them for
    an unknown pass)."""
    from ..layers import registry

    cls = registry().get(pass_name)
    if cls is None:  # a plugin not installed here: show everything rather than guess
        return dict(params)
    defaults: dict[str, Any] = {}
    fields = dataclasses.fields(cls)
    for f in fields[1:]:  # the first parameter says what the pass does (dtype=bfloat16): always shown
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = plain(f.default_factory())
    return {k: v for k, v in params.items() if k not in defaults or defaults[k] != v}


def pass_label(pass_name: str, params: dict[str, Any], status: str = "") -> str:
    """``name(k=v, ...)`` with non-default parameters only; ``baseline`` for the baseline."""
    if status == "baseline":
        return "baseline"
    inner = ", ".join(f"{k}={v}" for k, v in non_default_params(pass_name, params).items())
    return f"{pass_name}({inner})"
