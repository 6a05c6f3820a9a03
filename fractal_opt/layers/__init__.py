"""The built-in passes, one module a layer of the tower, and the registry lookups.

Importing this package registers the built-in passes (each layer module's ``@register``);
:func:`registry` adds the third-party passes of the ``fractal_opt.passes`` entry-point group.
Layer modules must not import torch at module level: ``check`` and ``apply`` are pure plan
arithmetic, and ``import fractal_opt`` must stay cheap.
"""

from __future__ import annotations

from ..core.errors import RecipeError, closest
from ..tower.passes import ENTRY_POINT_GROUP, Layer, Pass, registered
from . import application, hardware, model, placement, scheduling  # noqa: F401  (importing registers the built-in passes)

__all__ = ["get_pass", "passes_by_layer", "registry"]

_plugins_loaded = False


def registry() -> dict[str, type[Pass]]:
    """All registered passes by name: the built-in layers plus entry-point plugins."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        _load_entry_points()
    return registered()


def _load_entry_points() -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # a broken plugin must not break the built-in passes
            import warnings

            warnings.warn(f"fractal_opt: could not load pass plugin {ep.name!r} ({ep.value}): {e}", stacklevel=2)


def get_pass(name: str) -> type[Pass]:
    """The pass class registered as ``name``.

    Raises:
        RecipeError: unknown name, with the valid names and the closest match.
    """
    passes = registry()
    if name not in passes:
        valid = sorted(passes)
        msg = f"Unknown pass {name!r}. Valid passes are: {valid}.{closest(name, valid)}"
        raise RecipeError(msg)
    return passes[name]


def passes_by_layer() -> dict[Layer, list[type[Pass]]]:
    """Registered passes grouped by layer, bottom up."""
    grouped: dict[Layer, list[type[Pass]]] = {layer: [] for layer in Layer}
    for cls in registry().values():
        grouped[cls.layer].append(cls)
    return grouped
