"""Runtimes: each implements the Engine protocol (:mod:`fractal_opt.engine.protocol`) on one
inference engine, and :func:`build` picks the one a plan names (``plan.hardware.runtime``).

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

from ..engine import protocol
from ..errors import FractalOptError, RecipeError, closest
from ..machine import Machine
from ..plan import Plan

__all__ = ["RUNTIMES", "Engine", "availability", "build", "clear_cache", "evict_except", "from_recipe", "recipe_source", "refuse", "takes_whole_device"]

RUNTIMES = ("transformers", "llama_cpp", "vllm")


def _engine_class(runtime: str) -> type[protocol.Engine]:
    if runtime == "transformers":
        from .transformers.engine import TransformersEngine

        return TransformersEngine
    if runtime == "llama_cpp":
        from .llama_cpp.engine import LlamaCppEngine

        return LlamaCppEngine
    if runtime == "vllm":
        from .vllm.engine import VllmEngine

        return VllmEngine
    msg = f"plan.hardware.runtime: unknown runtime {runtime!r}. Valid runtimes are: {list(RUNTIMES)}.{closest(runtime, RUNTIMES)}"
    raise RecipeError(msg)


def availability(machine: Machine) -> dict[str, str | None]:
    """Per runtime, why it cannot run here (a missing package, no vLLM found), or None when it can.

    Looks, never loads: what ``fractal-opt passes`` shows under the runtime pass.
    """
    out: dict[str, str | None] = {"transformers": None}
    out["llama_cpp"] = None if machine.has_package("xllamacpp") else "needs the xllamacpp package (pip install xllamacpp; make setup installs it)"
    from .vllm.process import find_executable, find_url

    if find_url(None):
        out["vllm"] = None
    else:
        try:
            find_executable(None)
            out["vllm"] = None
        except FractalOptError as e:
            out["vllm"] = str(e)
    return out


def refuse(plan: Plan) -> str | None:
    """Why the runtime the plan names cannot honour it, or None (the runner skips such a step)."""
    return _engine_class(plan.hardware.runtime).refuse(plan)


def takes_whole_device(plan: Plan) -> bool:
    """True when the plan's runtime reserves most of its device at start (see the protocol)."""
    return _engine_class(plan.hardware.runtime).takes_whole_device(plan)


def build(plan: Plan, *, machine: Machine | None = None, progress: Callable[[str], None] = print, max_new_tokens: int | None = None) -> protocol.Engine:
    """Load (or reuse) the deployment ``plan`` describes on the runtime it names."""
    return _engine_class(plan.hardware.runtime).build(plan, machine=machine, progress=progress, max_new_tokens=max_new_tokens)


def recipe_source(source: Any) -> Any:
    """``source`` as :func:`~fractal_opt.recipe.load_recipe` takes it: a run folder (what
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
    from ..recipe import load_recipe

    rec = load_recipe(recipe_source(recipe))
    return build(rec.plan(), progress=progress, max_new_tokens=rec.workload.max_new_tokens)


def evict_except(keep: set[tuple]) -> None:
    """Drop every runtime's cached models whose weights key is not in ``keep``."""
    from . import llama_cpp, vllm
    from .transformers.engine import evict_except as transformers_evict

    transformers_evict(keep)
    llama_cpp.evict_except(keep)
    vllm.evict_except(keep)


def clear_cache() -> None:
    """Drop every runtime's cached models (frees memory; the next build loads again)."""
    from . import llama_cpp, vllm
    from .transformers.engine import clear_cache as transformers_clear

    transformers_clear()
    llama_cpp.clear_cache()
    vllm.clear_cache()


class Engine:
    """The face of the runtimes, for apps: ``Engine.from_recipe("recipe.yaml")`` or
    ``Engine.build(plan)`` returns the engine of the runtime the plan names; every one implements
    :class:`fractal_opt.engine.protocol.Engine` (generate, stream, serve, server, census, close)."""

    build = staticmethod(build)
    from_recipe = staticmethod(from_recipe)
    refuse = staticmethod(refuse)
