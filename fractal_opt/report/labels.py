"""How a step is named in reports: the pass and only the parameters that differ from its defaults.

``batching(mode=static, batch_size=6)`` rather than every field of the pass; trace.json keeps all
of them (``Step.params``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["non_default_params", "pass_label"]


def non_default_params(pass_name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` without the ones equal to the pass's defaults, except the first
    (:meth:`fractal_opt.tower.passes.Pass.shown_params`); all of them for an unknown pass."""
    from ..layers import registry
    from ..search.search_pass import Search

    cls = Search if pass_name == Search.name else registry().get(pass_name)  # `search`: one class a layer, the same parameters
    if cls is None:  # a plugin not installed here: show everything rather than guess
        return dict(params)
    return cls.shown_params(params)


def pass_label(pass_name: str, params: dict[str, Any], status: str = "") -> str:
    """``name(k=v, ...)`` with non-default parameters only; ``baseline`` for the baseline."""
    if status == "baseline":
        return "baseline"
    inner = ", ".join(f"{k}={v}" for k, v in non_default_params(pass_name, params).items())
    return f"{pass_name}({inner})"
