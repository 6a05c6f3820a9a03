"""Export a tuned plan as the launch settings of the servers people run (no model is loaded).

``fractal-opt export RUN_DIR --to TARGET`` prints, for the kept plan, one module per target:

- ``transformers-serve`` (:mod:`.transformers_serve`): the ``transformers serve`` command (flags
  of transformers 5.x) plus the generation_config.json its model folder should hold;
- ``vllm`` (:mod:`.vllm`): the ``vllm serve`` command, its environment and the per-request
  fields, from the same mapping the vllm runtime measures with;
- ``llama-server`` (:mod:`.llama_server`): llama.cpp's ``llama-server`` command, from the
  mapping the llama_cpp runtime measures with, decoding defaults as flags;
- ``generation-config`` (:mod:`.gen_config`): generation_config.json alone (any
  transformers-based server reads it).

Each names the weights the run measured (the GGUF for llama-server; for the others the folder the
GGUF was dequantized to, with its tokenizer, made once and cached) and the thread count the
measured plan ran with; it comes with the plan fields that do not carry over to that target (and
why), the kept passes they belong to, and the line that the numbers were measured on the runtime
the plan names: a plan carried to another server is a starting point to re-measure there, not a
measured result.

:func:`table` says, for every plan field and every target, where the field goes; the table test
(tests/serving/test_export.py) iterates the Plan dataclass, so a new plan field fails until mapped.

Example:
    >>> from fractal_opt.tower.plan import Plan
    >>> plan = Plan(source="my-model").replace_section("scheduling", batching="continuous", max_concurrency=8)
    >>> export(plan, "vllm").command[:3]
    ['vllm', 'serve', 'my-model']
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ..core.errors import RecipeError, closest
from ..tower.plan import Plan
from . import gen_config, llama_server, transformers_serve, vllm
from .common import KINDS, Export, Where, changed, in_use, plan_fields, value
from .gen_config import generation_config

__all__ = ["KINDS", "TARGETS", "Export", "Where", "export", "generation_config", "plan_fields", "table"]

# Target -> the module that maps a plan onto it (TABLE or table(), build(plan, where, out), RUNTIME).
_MODULES = {"transformers-serve": transformers_serve, "vllm": vllm, "llama-server": llama_server, "generation-config": gen_config}
TARGETS = tuple(_MODULES)


@functools.cache
def table(target: str) -> dict[str, tuple[str, str]]:
    """For ``target``, every plan field -> ``(kind, where or why)``; kinds are :data:`KINDS`.

    Built on first use: the vllm table reads the vllm runtime's own (engine_args.FIELDS).
    """
    module = _MODULES[target]
    return module.table() if callable(getattr(module, "table", None)) else module.TABLE


def export(plan: Plan, target: str, *, passes: Sequence[Any] = (), model_path: str | None = None, measured: str | None = None,
           host: str = "127.0.0.1", port: int = 8000, threads: int | None = None) -> Export:
    """The launch settings of ``target`` for ``plan``.

    Args:
        plan: the kept plan (a tuned recipe's ``plan()``).
        target: one of :data:`TARGETS`.
        passes: the kept passes (a tuned recipe's ``passes``), to name the ones that do not carry.
        model_path: the model's local path (default: the plan's source as written).
        measured: where the numbers were measured ("llama_cpp on 2-core Xeon ..."), for the note.
        threads: the thread count the measured plan ran with (the run's trace.json), passed where
            the plan says ``auto`` or leaves the count to the runtime.

    Raises:
        RecipeError: an unknown target (with the valid ones and the closest match).
    """
    if target not in TARGETS:
        raise RecipeError(f"export --to: unknown target {target!r}. Valid targets are: {list(TARGETS)}.{closest(target, TARGETS)}")
    fields_of = table(target)
    base = Plan(source=plan.source)
    out = Export(target=target)
    where = Where(model=model_path or plan.source, host=host, port=port, threads=threads)
    reasons = _MODULES[target].build(plan, where, out)  # field -> why it does not carry, for this plan's value
    for name in filter(functools.partial(in_use, plan), changed(base, plan)):
        kind, why = fields_of[name]
        if kind == "lost" or name in reasons:
            out.lost.append((name, value(plan, name), reasons.get(name, why)))
    lost_names = {name for name, _, _ in out.lost}
    previous = base
    for p in passes:
        after = p.apply(previous)
        fields = [n for n in changed(previous, after) if n in lost_names]
        if fields:
            out.lost_passes.append((f"{p.layer.section}/{p.name}", fields))
        previous = after
    out.note = _note(plan, target, measured)
    return out


def _note(plan: Plan, target: str, measured: str | None) -> str:
    runtime = plan.hardware.runtime
    where = f" ({measured})" if measured else ""
    server = "the server that loads this file" if target == "generation-config" else target
    return (f"The numbers in this run were measured on the {runtime} runtime{where}, with fractal_opt's own request server; "
            f"{server} is another server" + ("" if _same_runtime(runtime, target) else " on another runtime") +
            ": re-measure there before relying on them.")


def _same_runtime(runtime: str, target: str) -> bool:
    """Whether ``target`` runs the runtime the plan was measured on (its capabilities' export targets)."""
    from ..engine.registry import RUNTIMES

    return runtime in RUNTIMES.names() and target in RUNTIMES.get(runtime).export_targets
