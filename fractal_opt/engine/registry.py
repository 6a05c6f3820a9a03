"""The runtimes by name: one registry that every question about a runtime goes through.

:class:`Runtimes` holds :class:`~.capabilities.Capabilities` values, rejects a duplicate name
when it is registered (pluggy's registration-time checks), and answers what the house asks of a
plan's runtime: build it, what it refuses, whether it takes the whole device, evict or clear the
cached instances of every runtime, availability on a machine. :data:`RUNTIMES` is the process's
registry: :mod:`fractal_opt.runtimes` registers the built-in runtimes into it, and a third-party
package adds one with ``fractal_opt.runtimes.register(...)`` or an entry point in the
``fractal_opt.runtimes`` group (loaded on the first lookup, as the passes' plugins are).

The pipeline receives a registry (``Pipeline(runtimes=...)``), so a test can hand it its own.
The registry lives beside the Engine protocol, not under ``runtimes/``: the passes read the table
(what a plan's runtime serves), and the runtimes sit above the recipe that loads the passes.

Example:
    >>> from fractal_opt.engine.capabilities import Capabilities
    >>> mine = Runtimes()
    >>> mine.register(Capabilities(name="mine", summary="my engine", engine="my_pkg:Engine"))
    >>> mine.names()
    ['mine']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..core.errors import FractalOptError, RecipeError, closest
from ..core.machine import Machine, resolve_device
from .capabilities import Capabilities, resolve

if TYPE_CHECKING:
    from ..tower.plan import Plan
    from .protocol import Engine

__all__ = ["ENTRY_POINT_GROUP", "RUNTIMES", "Runtimes", "register"]

ENTRY_POINT_GROUP = "fractal_opt.runtimes"


class Runtimes:
    """A registry of runtimes (see the module docstring). ``load_plugins``: read the entry-point
    group on the first lookup (the process's registry does; a test's own need not)."""

    def __init__(self, *capabilities: Capabilities, load_plugins: bool = False):
        self._table: dict[str, Capabilities] = {}
        self._plugins_pending = load_plugins
        for caps in capabilities:
            self.register(caps)

    # ------------------------------------------------------------------ the table
    def register(self, caps: Capabilities) -> Capabilities:
        """Add ``caps``. Raises RecipeError for a name already registered (or not an identifier)."""
        if not isinstance(caps, Capabilities):
            raise TypeError(f"register() takes a fractal_opt.runtimes.Capabilities, got {type(caps).__name__}")
        if not caps.name.isidentifier():
            raise RecipeError(f"runtime name {caps.name!r}: must be an identifier (it is the value of plan.hardware.runtime).")
        if caps.name in self._table:
            raise RecipeError(f"runtime {caps.name!r} is registered already ({self._table[caps.name].summary}); pick another name.")
        self._table[caps.name] = caps
        return caps

    def unregister(self, name: str) -> None:
        """Remove a runtime (a test's own, when it is done)."""
        self._table.pop(name, None)

    def names(self) -> list[str]:
        self._load_plugins()
        return list(self._table)

    def __iter__(self) -> Iterator[Capabilities]:
        return iter([self._table[n] for n in self.names()])

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def get(self, name: str) -> Capabilities:
        """The runtime registered as ``name``. Raises RecipeError naming the valid ones and the closest."""
        if name not in self.names():
            valid = self.names()
            if not valid:
                raise RecipeError(f"plan.hardware.runtime {name!r}: no runtime is registered. fractal_opt's own register when fractal_opt.runtimes "
                                  f"is imported, which the {ENTRY_POINT_GROUP!r} entry point of its installed metadata does on the first lookup: "
                                  "reinstall the package (make setup) if that entry point is missing.")
            raise RecipeError(f"plan.hardware.runtime: unknown runtime {name!r}. Valid runtimes are: {valid}.{closest(name, valid)}")
        return self._table[name]

    def of(self, plan: Plan) -> Capabilities:
        """The capabilities of the runtime ``plan`` names."""
        return self.get(plan.hardware.runtime)

    def engine_class(self, name: str) -> type[Engine]:
        return resolve(self.get(name).engine)

    # ------------------------------------------------------------------ what the house asks
    def build(self, plan: Plan, *, machine: Machine | None = None, progress: Callable[[str], None] = print, max_new_tokens: int | None = None) -> Engine:
        """Load (or reuse) the deployment ``plan`` describes on the runtime it names."""
        return self.engine_class(plan.hardware.runtime).build(plan, machine=machine, progress=progress, max_new_tokens=max_new_tokens)

    def refuse(self, plan: Plan) -> str | None:
        """Why the runtime the plan names cannot honour it, or None (the runner skips such a step)."""
        if plan.application.chat_template is not None and not self.of(plan).token_prompts:
            return (f"application.chat_template: the {plan.hardware.runtime} runtime formats prompts its own way (its capabilities say "
                    "token_prompts: false), so it cannot take the prompt fractal_opt renders from the recipe's template")
        return self.engine_class(plan.hardware.runtime).refuse(plan)

    def takes_whole_device(self, plan: Plan) -> bool:
        """True when the plan's runtime reserves most of its device at start (``Capabilities.whole_device``)."""
        caps = self.of(plan)
        return caps.whole_device != "never" and caps.takes_whole_device(resolve_device(plan.hardware.device))

    def evict_except(self, keep: set[tuple]) -> None:
        """Drop every runtime's cached instances whose weights key is not in ``keep``."""
        for caps in self:
            if caps.evict is not None:
                resolve(caps.evict)(keep)

    def clear_cache(self) -> None:
        """Drop every runtime's cached instances (frees memory; the next build loads again)."""
        for caps in self:
            if caps.clear is not None:
                resolve(caps.clear)()

    def availability(self, machine: Machine) -> dict[str, str | None]:
        """Per runtime, why it cannot run here (a missing package, no vLLM found), or None when it
        can. Looks, never loads: what ``fractal-opt passes`` shows under the runtime pass."""
        out: dict[str, str | None] = {}
        for caps in self:
            missing = [p for p in caps.packages if not machine.has_package(p)]
            if missing:
                out[caps.name] = f"needs the {missing[0]} package (pip install {missing[0]}; make setup installs it)"
                continue
            try:
                out[caps.name] = resolve(caps.available)(machine) if caps.available is not None else None
            except FractalOptError as e:
                out[caps.name] = str(e)
        return out

    # ------------------------------------------------------------------ plugins
    def _load_plugins(self) -> None:
        if not self._plugins_pending:
            return
        self._plugins_pending = False
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = ep.load()
            except Exception as e:  # a broken plugin must not break the other runtimes
                import warnings

                warnings.warn(f"fractal_opt: could not load runtime plugin {ep.name!r} ({ep.value}): {e}", stacklevel=2)
                continue
            if isinstance(loaded, Capabilities) and loaded.name not in self._table:
                self.register(loaded)


# The process's registry: the built-in runtimes (fractal_opt.runtimes registers them) and plugins.
RUNTIMES = Runtimes(load_plugins=True)


def register(caps: Capabilities) -> Capabilities:
    """Add a runtime to the process's registry (:data:`RUNTIMES`)."""
    return RUNTIMES.register(caps)


def capabilities_of(plan: Any) -> Capabilities:
    """The capabilities of ``plan``'s runtime in the process's registry (what a pass reads)."""
    return RUNTIMES.of(plan)
