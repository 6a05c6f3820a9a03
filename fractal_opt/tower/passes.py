"""Pass base class, the Layer enum, and the registry.

A pass is a frozen, keyword-only dataclass: its fields are its parameters. It has a ``name``, a
``layer``, and two pure methods: ``check(plan, machine)`` says why it cannot apply here (or
``None``), and ``apply(plan)`` returns a new plan that differs only in the pass's own layer.

Example:
    >>> from dataclasses import dataclass
    >>> from fractal_opt.tower.passes import Layer, Pass, register
    >>> @register
    ... @dataclass(frozen=True, kw_only=True)
    ... class Greedy(Pass):
    ...     '''Turn sampling off.'''
    ...     name = "doc_greedy"
    ...     layer = Layer.APPLICATION
    ...     def apply(self, plan):
    ...         return plan.replace_section("application", do_sample=False)

Third-party passes register through the ``fractal_opt.passes`` entry-point group: each entry
point names a module (or class) whose import runs ``@register``.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ..core.errors import FractalOptError, RecipeError, closest
from ..core.validate import build, plain

if typing.TYPE_CHECKING:
    from ..core.machine import Machine
    from .plan import Plan

__all__ = ["ENTRY_POINT_GROUP", "Layer", "Pass", "SearchContext", "StepResult", "register", "registered"]

ENTRY_POINT_GROUP = "fractal_opt.passes"  # a public name: plugins register under it (not the module path)


class Layer(enum.IntEnum):
    """The four layers of the tower, bottom up; passes run in this order."""

    HARDWARE = 1
    MODEL = 2
    SCHEDULING = 3
    APPLICATION = 4

    @property
    def section(self) -> str:
        """The Plan section this layer owns (``"hardware"``, ...)."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: str) -> Layer:
        try:
            return cls[str(name).upper()]
        except KeyError:
            valid = [layer.section for layer in cls]
            msg = f"Unknown layer {name!r}. Valid layers are: {valid}.{closest(name, valid)}"
            raise RecipeError(msg) from None


@dataclasses.dataclass(frozen=True)
class StepResult:
    """How one step of a pass ended, as the pass sees it when it proposes the next (:meth:`Pass.next_step`).

    ``status`` is the trace's (kept / rolled_back / failed / skipped), or ``unchanged`` when the
    step was skipped because the plan already had what it sets; ``outcome`` is the verdict's
    (kept / no_change / worse / guard / unmeasured; empty when the step was not judged).
    """

    step: Pass
    status: str
    outcome: str = ""
    reason: str = ""  # the step's reason as the trace records it (which guard stopped it, the screen's numbers)
    quality_tripped: tuple[str, ...] = ()  # the quality guards that stopped it (kl_mean, accuracy, ...): its answers were refused
    plan: Any = None  # the candidate plan it measured (Plan.to_dict()), when it was built


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchContext:
    """What a pass that generates its steps may read when it proposes the next one
    (:meth:`Pass.next_step`): the kept plan now, the machine, the workload (its load), the runtimes,
    why the runner would skip a step, and the time the run has left.

    ``skip(pass, plan)``: why the runner would skip that step on that plan, or None (the gate's
    rule: unavailable, check, changes nothing, the runtime refuses). ``runtimes``: the run's
    registry of runtime tables (iterable :class:`~fractal_opt.engine.capabilities.Capabilities`).
    ``remaining_s``: seconds left of the run's time budget for this search, after what the steps
    behind it and the final confirmation need (None: no budget). ``step_s``: the mean seconds a
    ``screened_out`` step and a fully judged one took in this run so far (keys present once one has).
    ``refused``: the plans of this run whose answers a quality guard refused, every layer's.
    """

    plan: Plan
    machine: Machine
    workload: Any = None
    skip: Any = None
    runtimes: Any = ()
    remaining_s: float | None = None
    step_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    refused: tuple[tuple[str, Any, tuple[str, ...]], ...] = ()  # (label, Plan.to_dict(), quality guards) of each plan whose answers were refused


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pass:
    """Base class of every optimization pass. Subclasses are frozen keyword-only dataclasses."""

    name: ClassVar[str]
    layer: ClassVar[Layer]

    def check(self, plan: Plan, machine: Machine) -> str | None:
        """Why this pass cannot apply to ``plan`` on ``machine``, or ``None`` if it can.

        Only the pass's own rules: the runner asks :meth:`unavailable` first, skips a pass whose
        ``apply`` changes nothing ("the plan already has this"), and asks the runtime afterwards
        whether it can honour the new plan (``Engine.refuse``).
        """
        return None

    def unavailable(self, machine: Machine) -> str | None:
        """Why this machine cannot run the pass at all (a missing device or package), or ``None``.

        The runner asks it before ``check``; ``fractal-opt passes`` shows it.
        """
        return None

    def apply(self, plan: Plan) -> Plan:
        """Return a new plan with this pass applied. Must not touch other layers' sections."""
        raise NotImplementedError

    # ------------------------------------------------------------------ searches
    def next_step(self, history: Sequence[StepResult], *, context: SearchContext | None = None) -> Pass | None:
        """The next step the runner runs for this pass, given how its earlier steps ended, or None
        when the pass is done. Default: the pass itself, once.

        ``context`` (:class:`SearchContext`): the kept plan, the machine, the load and the time
        left, for a pass that generates its candidates from them (the ``search`` pass).

        A pass that searches (a concurrency search: double the level until a guard trips, then
        bisect) proposes its steps one at a time from ``history``; the runner measures and judges
        each like any step, asks :meth:`holds` whether to keep one the policy saw no change in,
        and stores :meth:`conclusion` when the pass is done. The runner never knows which pass it is.
        """
        return None if history else self

    def screens(self) -> bool:
        """Whether :meth:`next_step`'s steps first get a short paired screen against the kept plan,
        and only a step whose screen interval can still beat it by ``min_effect`` gets the full
        rounds and the quality gate (the others end ``screened_out``). Default False: every step is
        judged in full (a concurrency level may hold without beating anything)."""
        return False

    def holds(self, outcome: str) -> str | None:
        """Why one of :meth:`next_step`'s steps is kept although its verdict ``outcome`` did not keep
        it (appended to the reason), or None: the policy's verdict stands. Asked only of a pass
        whose steps are not itself (a search)."""
        return None

    def conclusion(self, history: Sequence[StepResult], *, guards: Sequence[Any] = (), context: SearchContext | None = None) -> dict[str, Any] | None:
        """What the steps found, for the trace and the report (``answer``: one sentence), or None.

        ``guards`` are the policy's guards for the pass's layer (objects with ``metric``, ``min``,
        ``max``), so the answer can name the limits it was found under; ``context`` the kept plan
        and the time left when the pass ended (what a search did not try).
        """
        return None

    def params(self) -> dict[str, Any]:
        """The pass's parameters as a YAML-friendly dict (tuples become lists)."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def describe(self) -> str:
        """``name(k=v, ...)`` with the parameters that differ from the defaults: how the pass shows
        up in progress lines and reports (``batching(mode=static, batch_size=6)``)."""
        inner = ", ".join(f"{k}={v}" for k, v in self.shown_params(self.params()).items())
        return f"{self.name}({inner})"

    @classmethod
    def shown_params(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` without those equal to the pass's defaults, except the first parameter, which
        says what the pass does (``dtype=bfloat16``) and is always shown."""
        defaults: dict[str, Any] = {}
        for f in dataclasses.fields(cls)[1:]:
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = plain(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                defaults[f.name] = plain(f.default_factory())
        return {k: v for k, v in params.items() if k not in defaults or defaults[k] != v}

    @classmethod
    def summary(cls) -> str:
        """The first line of the pass's docstring."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None, *, where: str = "") -> Pass:
        """Build the pass from YAML values, checking names and types.

        Raises:
            RecipeError: an unknown parameter (with the valid ones and the closest match), or a
                value of the wrong type (with the field, the value and the expected type).
        """
        return build(cls, params, where=where or f"pass {cls.name!r}", noun="parameter")


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator: add a pass to the registry. Rejects duplicates and malformed passes."""
    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise FractalOptError(f"@register expects a Pass subclass, got {cls!r}.")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise FractalOptError(f"{cls.__qualname__}: a pass needs a class attribute `name` that is an identifier, got {name!r}.")
    if not isinstance(getattr(cls, "layer", None), Layer):
        raise FractalOptError(f"Pass {name!r}: class attribute `layer` must be a Layer, got {getattr(cls, 'layer', None)!r}.")
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__dataclass_fields__" not in cls.__dict__:
        raise FractalOptError(f"Pass {name!r}: decorate the class with @dataclass(frozen=True, kw_only=True) below @register.")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        msg = f"Pass name {name!r} is already registered by {existing.__module__}.{existing.__qualname__}; pass names must be unique."
        raise FractalOptError(msg)
    _REGISTRY[name] = cls
    return cls


def registered() -> dict[str, type[Pass]]:
    """The passes registered so far, by name (:func:`fractal_opt.layers.registry` adds the built-in
    layers and the entry-point plugins first)."""
    return dict(_REGISTRY)
