"""Checking YAML values against dataclass fields: names, types and the closest valid name.

Used for pass parameters, workloads and policies, so every part of a recipe fails the same way:
the field, the value, what is allowed and the closest valid name.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from .errors import RecipeError, closest

__all__ = ["build", "coerce", "plain", "type_name"]


def build(cls: type, data: Mapping[str, Any] | None, *, where: str, noun: str = "key") -> Any:
    """Construct dataclass ``cls`` from YAML ``data``, checking every key and value.

    Raises:
        RecipeError: an unknown key (with the valid ones and the closest match), a value of the
            wrong type (with the field, the value and the expected type), or a value the class's
            ``__post_init__`` rejects.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        msg = f"{where}: expected a mapping like {{name: value}}, got {data!r}."
        raise RecipeError(msg)
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    values = {}
    for key, value in data.items():
        if key not in fields:
            valid = sorted(fields)
            msg = f"{where}: unknown {noun} {key!r}. Valid {noun}s are: {valid}.{closest(str(key), valid)}"
            raise RecipeError(msg)
        values[key] = coerce(value, hints[key], where=f"{where}, {noun} {key!r}")
    try:
        return cls(**values)
    except RecipeError:
        raise
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: {e}") from None


def plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


def type_name(annotation: Any) -> str:
    """A readable name for a type annotation (``int | 'auto'``)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is dict:
        return "mapping"
    if origin is tuple:
        return f"list of {type_name(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def coerce(value: Any, annotation: Any, *, where: str) -> Any:
    """Check ``value`` against ``annotation`` and convert YAML shapes (list -> tuple, int -> float).

    Raises:
        RecipeError: naming ``where``, the value and the expected type.
    """
    try:
        return _coerce(value, annotation)
    except _Mismatch:
        msg = f"{where}: got {value!r} ({type(value).__name__}), expected {type_name(annotation)}."
        if isinstance(value, str):
            options = [a for a in _literals(annotation) if isinstance(a, str)]
            msg += closest(value, options)
        raise RecipeError(msg) from None


class _Mismatch(Exception):
    pass


def _literals(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return list(typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return [lit for a in typing.get_args(annotation) for lit in _literals(a)]
    return []


def _coerce(value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin is Literal:
        if value in typing.get_args(annotation) and type(value) in {type(a) for a in typing.get_args(annotation)}:
            return value
        raise _Mismatch
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(annotation):
            try:
                return _coerce(value, arg)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _Mismatch
        return dict(value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _Mismatch
        (item_type, *_) = typing.get_args(annotation)
        return tuple(_coerce(v, item_type) for v in value)
    if annotation is type(None):
        if value is None:
            return None
        raise _Mismatch
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if annotation is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if isinstance(annotation, type) and isinstance(value, annotation):
        return value
    raise _Mismatch


