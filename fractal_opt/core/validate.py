"""Checking YAML values against dataclass fields: names, types and the closest valid name.

Used for pass parameters, workloads and policies, so every part of a recipe fails the same way:
the field, the value, what is allowed and the closest valid name. :func:`build` reports every bad
key of a section at once (:class:`RecipeProblems`), and :class:`Problems` collects them section by
section, so ``fractal-opt check`` lists everything wrong with a file in one go.

Every number is bounded (:func:`bounds`): finite, not negative, and below a ceiling no real
deployment reaches, so a typo (``repeats: 100000000000``, ``timeout_s: .inf``) is refused before
any work starts. A field may declare its own range with ``metadata={"bounds": (low, high)}``;
:data:`NAMED_BOUNDS` holds the ranges of fields whose unit makes a tighter ceiling obvious
(tokens, fractions). The JSON Schema (fractal_opt/language/schema.py) reads the same ranges.

Reading the files themselves (size, node and depth caps; libyaml's C loader) is :mod:`.files`;
its names are re-exported here, where callers have always found them.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any, Literal, TypeVar, Union

from .errors import RecipeError, closest
from .files import MAX_DATA_BYTES, MAX_DEPTH, MAX_NODES, MAX_RECIPE_BYTES, load_data, parse_yaml, read_text, yaml_problem

__all__ = ["MAX_DATA_BYTES", "MAX_DEPTH", "MAX_NODES", "MAX_RECIPE_BYTES", "MAX_TOKENS", "NAMED_BOUNDS", "Problems", "RecipeProblems", "bounds", "build", "check_bounds", "coerce", "load_data", "parse_each", "parse_yaml", "plain", "problems_of", "read_text", "type_name", "yaml_problem"]
T = TypeVar("T")

# 10 M tokens: the longest context window of any released model (Llama 4 Scout). A token count
# above it is a typo, and would size caches of terabytes.
MAX_TOKENS = 10_000_000
# A C int: what runtimes and kernels take for counts (llama.cpp's slots, CUDA grid sizes).
MAX_INT = 2**31 - 1
# Seconds, milliseconds, rates, penalties: 1e9 is 31 years of seconds; anything above is a typo.
MAX_FLOAT = 1e9
# Fields whose unit gives a tighter range than the type's, by field name or "owner.field" (owner =
# the pass name, or the section class name in lower case). Lower bounds a field's own
# __post_init__ checks with a better message stay there; these catch what nothing else did.
NAMED_BOUNDS: dict[str, tuple[float, float]] = {
    **{name: (0, 1) for name in ("cancel_fraction", "memory_headroom", "head_share", "threshold", "top_p", "min_p")},
    "max_memory_percent": (0, 100),
    "max_new_tokens.limit": (1, MAX_TOKENS),
    "repeats": (1, 10_000),
    "max_repeats": (1, 10_000),
    "warmup": (0, 10_000),
    "seed": (0, 2**32 - 1),  # numpy's and llama.cpp's seed range
    "top_k": (0, 2**20),  # a k over the vocabulary (the largest are ~256 k tokens)
    "num_beams": (1, 1024),
    "batch_size": (1, 65_536),
    "loadprofile.concurrency": (1, 1_000_000),
    "loadprofile.requests": (1, 10_000_000),
}


class RecipeProblems(RecipeError):
    """Several things wrong with one input at once; ``problems`` holds each message."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        text = self.problems[0] if len(self.problems) == 1 else f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


def problems_of(error: RecipeError) -> list[str]:
    """The messages an error carries: each of a :class:`RecipeProblems`, else the one."""
    return list(error.problems) if isinstance(error, RecipeProblems) else [str(error)]


class Problems:
    """Collects RecipeErrors part by part, so one reading of a file reports every problem in it.

    Example:
        >>> found = Problems()
        >>> with found.collect():
        ...     raise RecipeError("workload: bad")
        >>> found.items
        ['workload: bad']
    """

    def __init__(self) -> None:
        self.items: list[str] = []

    @contextmanager
    def collect(self, prefix: str = ""):
        """Record the RecipeError raised inside the block (each problem starting with ``prefix``)."""
        try:
            yield
        except RecipeError as e:
            head = prefix.rstrip(": ")  # a message that already names the file keeps its own wording
            self.items.extend(p if p.startswith(head) else f"{prefix}{p}" for p in problems_of(e))

    def add(self, message: str) -> None:
        self.items.append(message)

    def raise_if_any(self) -> None:
        if self.items:
            raise RecipeProblems(self.items)


def parse_each(raw: list[Any], parse: Callable[[Any, int], T]) -> list[T]:
    """``parse(entry, index)`` for every entry of a file's list; every bad entry is reported at
    once (RecipeProblems), not the first (a suite's requests, an eval set's items)."""
    found = Problems()
    parsed: list[T] = []
    for i, item in enumerate(raw):
        with found.collect():
            parsed.append(parse(item, i))
    found.raise_if_any()
    return parsed


def _owner(cls: type) -> str:
    name = getattr(cls, "name", None)
    return name if isinstance(name, str) else cls.__name__.lower()


def bounds(cls: type, f: dataclasses.Field, annotation: Any) -> tuple[float, float] | None:
    """The allowed range of a numeric field (None for a field that holds no numbers)."""
    if "bounds" in f.metadata:
        return tuple(f.metadata["bounds"])  # type: ignore[return-value]
    numbers = _number_types(annotation)
    if not numbers:
        return None
    named = NAMED_BOUNDS.get(f"{_owner(cls)}.{f.name}") or NAMED_BOUNDS.get(f.name)
    if named:
        return named
    if "tokens" in f.name or f.name == "page_size":
        return (0, MAX_TOKENS)
    return (0, MAX_INT) if numbers == {int} else (0, MAX_FLOAT)


def _number_types(annotation: Any) -> set[type]:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, tuple):
        return {t for a in typing.get_args(annotation) if a is not Ellipsis for t in _number_types(a)}
    return {annotation} if annotation in (int, float) else set()


def check_bounds(value: Any, allowed: tuple[float, float] | None, *, where: str) -> None:
    """Refuse a number (or a list of numbers) that is not finite or outside ``allowed``.

    Raises:
        RecipeError: naming ``where``, the value and the range.
    """
    if allowed is None:
        return
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue
        low, high = allowed
        if not math.isfinite(v) or not low <= v <= high:
            kind = "an integer" if isinstance(v, int) else "a finite number"
            raise RecipeError(f"{where}: got {v!r}, expected {kind} in [{_num(low)}, {_num(high)}].")


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


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
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values = {}
    found = Problems()
    for key, value in data.items():
        if key not in fields:
            valid = sorted(fields)
            found.add(f"{where}: unknown {noun} {key!r}. Valid {noun}s are: {valid}.{closest(str(key), valid)}")
            continue
        with found.collect():
            coerced = coerce(value, hints[key], where=f"{where}, {noun} {key!r}")
            check_bounds(coerced, bounds(cls, fields[key], hints[key]), where=f"{where}, {noun} {key!r}")
            values[key] = coerced
    found.raise_if_any()  # every bad key at once; the class's own checks need the values right
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


