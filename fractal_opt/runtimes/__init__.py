"""Runtimes: each implements the Engine protocol (:mod:`fractal_opt.engine.protocol`) on one
inference engine, and :func:`build` picks the one a plan names (``plan.hardware.runtime``).

A runtime is a folder here plus one registration: its ``capabilities.py`` declares what the house
reads (:class:`Capabilities`: the fields it refuses, whether it takes the whole device, what an idle
instance costs, its export targets, ...), and this package registers it in
:data:`RUNTIMES` (:mod:`fractal_opt.engine.registry`). A third-party package calls
:func:`register` or names its Capabilities in the ``fractal_opt.runtimes`` entry-point group.

- ``transformers``: Hugging Face transformers in this process (the baseline).
- ``llama_cpp``: llama.cpp's server in this process through the ``xllamacpp`` wheel (GGUF models, CPU),
  or a ``llama-server`` child process (``hardware.runtime_path``; ``native``: built for this CPU).
- ``vllm``: vLLM's OpenAI-compatible server as a child process in its own environment (or a running one).

Example:
    >>> from fractal_opt.runtimes import build                      # doctest: +SKIP
    >>> engine = build(Plan(source="smollm2-135m-instruct"))         # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.errors import RecipeError
from ..core.machine import Machine
from ..engine import protocol
from ..engine.capabilities import Capabilities, Idle, Refusal
from ..engine.registry import RUNTIMES, Runtimes, register
from ..tower.plan import Plan
from .llama_cpp.capabilities import CAPABILITIES as _LLAMA_CPP
from .transformers.capabilities import CAPABILITIES as _TRANSFORMERS
from .vllm.capabilities import CAPABILITIES as _VLLM

__all__ = ["RUNTIMES", "Capabilities", "Engine", "Idle", "Refusal", "Runtimes", "availability", "build", "clear_cache", "evict_except", "from_recipe",
           "recipe_source", "refuse", "register", "takes_whole_device"]

# The built-in runtimes: each a folder here plus this one registration (a third-party package
# registers its own with register(...) or the fractal_opt.runtimes entry-point group).
for _caps in (_TRANSFORMERS, _LLAMA_CPP, _VLLM):
    register(_caps)


def availability(machine: Machine) -> dict[str, str | None]:
    """Per runtime, why it cannot run here (a missing package, no vLLM found), or None when it can
    (:meth:`Runtimes.availability`)."""
    return RUNTIMES.availability(machine)


def refuse(plan: Plan) -> str | None:
    """Why the runtime the plan names cannot honour it, or None (the runner skips such a step)."""
    return RUNTIMES.refuse(plan)


def takes_whole_device(plan: Plan) -> bool:
    """True when the plan's runtime reserves most of its device at start (its capabilities say so)."""
    return RUNTIMES.takes_whole_device(plan)


def build(plan: Plan, *, machine: Machine | None = None, progress: Callable[[str], None] = print, max_new_tokens: int | None = None) -> protocol.Engine:
    """Load (or reuse) the deployment ``plan`` describes on the runtime it names."""
    return RUNTIMES.build(plan, machine=machine, progress=progress, max_new_tokens=max_new_tokens)


def recipe_source(source: Any) -> Any:
    """``source`` as :func:`~fractal_opt.language.recipe.load_recipe` takes it: a run folder (what
    ``fractal-opt run --out DIR`` writes) becomes the tuned ``recipe.yaml`` inside it; anything
    else is returned as is.

    Raises:
        RecipeError: a folder without recipe.yaml (naming what it holds instead).
    """
    from pathlib import Path

    if isinstance(source, (str, Path)) and "\n" not in str(source) and Path(source).is_dir():
        path = Path(source) / "recipe.yaml"
        if not path.is_file():
            held = sorted(p.name for p in Path(source).iterdir())[:8]
            raise RecipeError(f"{str(source)!r} is a folder without recipe.yaml (it holds {held}): give a recipe file, or the --out "
                              "folder of `fractal-opt run` (trace.json, report.md, recipe.yaml).")
        return path
    return source


def from_recipe(recipe: Any, *, progress: Callable[[str], None] = print) -> protocol.Engine:
    """Build the deployment a recipe describes: a path, a run folder (its tuned recipe.yaml), YAML
    text, a dict or a Recipe."""
    from ..language.recipe import load_recipe

    rec = load_recipe(recipe_source(recipe))
    return build(rec.plan(), progress=progress, max_new_tokens=rec.workload.max_new_tokens)


def evict_except(keep: set[tuple]) -> None:
    """Drop every runtime's cached models whose weights key is not in ``keep``."""
    RUNTIMES.evict_except(keep)


def clear_cache() -> None:
    """Drop every runtime's cached models (frees memory; the next build loads again)."""
    RUNTIMES.clear_cache()


class Engine:
    """The face of the runtimes, for apps: ``Engine.from_recipe("recipe.yaml")`` or
    ``Engine.build(plan)`` returns the engine of the runtime the plan names; every one implements
    :class:`fractal_opt.engine.protocol.Engine` (generate, stream, serve, server, census, close)."""

    build = staticmethod(build)
    from_recipe = staticmethod(from_recipe)
    refuse = staticmethod(refuse)
