"""fractal_opt: optimize LLM inference the way a careful expert does.

Measure first, change one thing, measure again, keep it only if it helped — across a tower of four
layers (hardware, model, scheduling, application).

Example:
    >>> import fractal_opt
    >>> result = fractal_opt.optimize("recipes/quickstart.yaml", out="fractal-out")  # doctest: +SKIP
    >>> engine = fractal_opt.Engine.from_recipe("fractal-out/recipe.yaml")         # doctest: +SKIP
    >>> engine.generate("What is the capital of France?")                          # doctest: +SKIP

Importing this package does not import torch or transformers: the heavy modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core.errors import EngineError, FractalOptError, ModelSourceError, RecipeError
from .layers import get_pass, passes_by_layer, registry
from .measure.budget import budget  # arithmetic only: no torch (the module and the function share a name)
from .tower.passes import Layer, Pass, register
from .tower.plan import Plan

if TYPE_CHECKING:
    from .core.machine import Machine
    from .language.recipe import Recipe, dump_recipe, load_recipe
    from .pipeline.runner import Pipeline, Result, optimize
    from .report.trace import Trace
    from .runtimes import Engine
    from .workloads.workload import Workload

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "EngineError",
    "FractalOptError",
    "Layer",
    "Machine",
    "ModelSourceError",
    "Pass",
    "Pipeline",
    "Plan",
    "Recipe",
    "RecipeError",
    "Result",
    "Trace",
    "Workload",
    "budget",
    "dump_recipe",
    "get_pass",
    "load_recipe",
    "optimize",
    "passes_by_layer",
    "register",
    "registry",
]

# Names resolved on first access, so that `import fractal_opt` stays cheap (no torch).
_LAZY = {
    "Engine": "runtimes",
    "Machine": "core.machine",
    "Pipeline": "pipeline.runner",
    "Result": "pipeline.runner",
    "optimize": "pipeline.runner",
    "Recipe": "language.recipe",
    "dump_recipe": "language.recipe",
    "load_recipe": "language.recipe",
    "Trace": "report.trace",
    "Workload": "workloads.workload",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fractal_opt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
