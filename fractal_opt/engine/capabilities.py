"""What a runtime declares about itself: one table the rest of the house reads.

A runtime is a folder under ``fractal_opt/runtimes/`` plus one :class:`Capabilities` value
registered with :func:`fractal_opt.runtimes.register` (or the ``fractal_opt.runtimes``
entry-point group, :mod:`.registry`). Everything the house needs to know about a runtime without
building it is a field here: the pipeline's eviction and side-by-side rule, the passes' view of
what a plan's runtime serves, ``fractal-opt passes`` and the doctor, the export's note. Nothing
outside ``runtimes/`` compares a plan's runtime against a name.

The table is data, so registering costs nothing: the engine and the hooks that need the
runtime's code are named as ``"module:attribute"`` (imported on first use) or given as objects
(a test's fake runtime).

Example:
    >>> caps = Capabilities(name="mine", summary="my engine", engine="my_pkg.engine:MyEngine")
    >>> caps.takes_whole_device("cuda:0"), caps.takes_whole_device("cpu")
    (False, False)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["PLACEMENTS", "Capabilities", "Idle", "Refusal", "refusals", "resolve"]

# The ways a runtime may spread one plan over processes or machines, each a placement pass's
# (layers/placement.py): the model's layers over llama.cpp rpc-servers; each layer's matrices over
# devices (vLLM tensor parallel); the stack of layers over devices or nodes (pipeline parallel);
# whole copies of the plan behind a router (replicas).
PLACEMENTS = {
    "rpc": "the model's layers over llama.cpp rpc-server processes (llama-server --rpc)",
    "tensor_parallel": "each layer's matrices split over devices (vllm serve --tensor-parallel-size)",
    "pipeline_parallel": "the stack of layers split over devices or nodes (vllm serve --pipeline-parallel-size)",
    "replicas": "whole copies of the plan, each on its own cores, behind a router",
}


@dataclass(frozen=True, kw_only=True)
class Idle:
    """What an instance that serves nothing costs, and how the runner pauses or evicts it (words,
    for ``fractal-opt passes``, the doctor and docs/runtimes.md)."""

    threads: str = "none"  # threads it keeps in this process
    children: str = "none"  # child processes it keeps
    memory: str = "its weights and KV cache, while cached"  # what it keeps reserved
    pause: str = "nothing to pause: it computes only while called"  # what happens between timed rounds
    evict: str = "dropped from the runtime's cache (evict_except / clear_cache)"


@dataclass(frozen=True)
class Refusal:
    """One row of a runtime's refusal table: the plan field, when the runtime cannot honour it,
    and why (a sentence, after ``field=value: ``; or a function of the plan writing the whole reason)."""

    field: str
    when: Callable[[Any], bool]
    why: str | Callable[[Any], str]

    def reason(self, plan: Any) -> str:
        """``field=value: why`` (a ``why`` function writes the whole reason itself)."""
        return self.why(plan) if callable(self.why) else f"{self.field}={_value(plan, self.field)!r}: {self.why}"


def refusals(rows: tuple[Refusal, ...], plan: Any) -> list[str]:
    """Every row of ``rows`` that refuses ``plan``, as its reason (in the table's order)."""
    return [row.reason(plan) for row in rows if row.when(plan)]


def _value(plan: Any, dotted: str) -> Any:
    section, name = dotted.split(".", 1)
    return getattr(getattr(plan, section), name)


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """One runtime, as the house reads it.

    Args:
        name: the value of ``plan.hardware.runtime`` (and of the runtime pass's ``backend``).
        summary: one line for ``fractal-opt passes``.
        engine: the Engine class, or ``"module:Class"`` imported on first build.
        refuses: the plan fields it cannot honour, with the reasons (:class:`Refusal` rows, or
            ``"module:ROWS"``); the engine's ``refuse(plan)`` reads them and may add what needs a
            look at the model (a missing GGUF).
        maps: where each plan field it honours goes (``"module:FIELDS"``), when the runtime keeps such a table.
        weights: what it serves: ``transformers`` (a model folder, quantized on load) or ``gguf``
            (a GGUF file: the quantize pass's ``auto`` backend re-quantizes the GGUF).
        options: the runtime pass's parameters it takes beside ``backend`` and ``dtype``.
        packages: Python packages it needs in this environment (the runtime pass is unavailable without them).
        available: ``"module:function"`` of a Machine: why it cannot run here, or None.
        whole_device: ``accelerator``: a server reserves most of a GPU at start, so two plans
            cannot be measured side by side there; ``never``: it takes what it needs.
        batch_invariant: a request's greedy tokens do not depend on what it is batched with.
        token_prompts: it takes each prompt as the token ids fractal_opt renders once from the
            model's template (:mod:`fractal_opt.weights.prompts`), so every runtime receives the
            same prompt; False: it formats prompts its own way, and a plan that names a chat
            template (``application.chat_template``) is refused on it.
        default_threads: the :class:`~fractal_opt.core.machine.Machine` attribute counting the
            threads an instance runs when the plan sets none; None: the runtime picks its own
            count when it starts (the threads pass then cannot tell a no-op).
        idle: what an idle instance costs, and how it is paused and evicted.
        telemetry: the keys it adds to a measurement's ``extra`` that the trace keeps.
        export_targets: the ``fractal-opt export --to`` targets that run this same runtime.
        placements: how it can spread a plan over processes or machines (:data:`PLACEMENTS`:
            ``rpc``, ``tensor_parallel``, ``pipeline_parallel``, ``replicas``); a placement pass
            on a runtime that does not list its placement is refused with the ones it does.
        knobs: what a search tries on this runtime beside its weight ladder: ``(pass, params,
            why)`` rows, ``why`` one line saying what the knob attacks (a ``runtime`` row is a way to
            reach the runtime, tried from any other; the other rows only on a plan it serves).
        evict: ``evict(keep)``: drop cached instances whose ``Plan.weights_key()`` is not in ``keep``.
        clear: ``clear()``: drop every cached instance.
    """

    name: str
    summary: str
    engine: str | type
    refuses: str | tuple[Refusal, ...] = ()
    maps: str | dict[str, str] | None = None
    weights: Literal["transformers", "gguf"] = "transformers"
    options: frozenset[str] = frozenset()
    packages: tuple[str, ...] = ()
    available: str | Callable[[Any], str | None] | None = None
    whole_device: Literal["never", "accelerator"] = "never"
    batch_invariant: bool = False
    token_prompts: bool = False
    default_threads: str | None = None
    idle: Idle = field(default_factory=Idle)
    telemetry: tuple[str, ...] = ()
    export_targets: tuple[str, ...] = ()
    placements: frozenset[str] = frozenset()
    knobs: tuple[tuple[str, dict[str, Any], str], ...] = ()
    evict: str | Callable[[set[tuple]], None] | None = None
    clear: str | Callable[[], None] | None = None

    def takes_whole_device(self, device: str) -> bool:
        """True when a server on ``device`` (a resolved device name) reserves most of it at start."""
        return self.whole_device == "accelerator" and device != "cpu"

    def refusal_rows(self) -> tuple[Refusal, ...]:
        return resolve(self.refuses)

    def refused_fields(self) -> list[str]:
        """The plan fields this runtime refuses at some value (sorted, once each)."""
        return sorted({row.field for row in self.refusal_rows()})


def resolve(ref: Any) -> Any:
    """``ref`` itself, or the object a ``"module:attribute"`` string names (imported now)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
