"""Checking YAML values against dataclass fields: names, types and the closest valid name.

Used for pass parameters, workloads and policies, so every part of a recipe fails the same way:
the field, the value, what is allowed and the closest valid name. :func:`build` reports every bad
key of a section at once (:class:`RecipeProblems`), and :class:`Problems` collects them section by
section, so ``fractal-opt check`` lists everything wrong with a file in one go.

Every number is bounded (:func:`bounds`): finite, not negative, and below a ceiling no real
deployment reaches, so a typo (``repeats: 100000000000``, ``timeout_s: .inf``) is refused before
any work starts. A field may declare its own range with ``metadata={"bounds": (low, high)}``;
:data:`NAMED_BOUNDS` holds the ranges of fields whose unit makes a tighter ceiling obvious
(tokens, fractions). The JSON Schema (fractal_opt/schema.py) reads the same ranges.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Union

from .errors import RecipeError, closest

__all__ = ["MAX_DATA_BYTES", "MAX_DEPTH", "MAX_NODES", "MAX_RECIPE_BYTES", "MAX_TOKENS", "NAMED_BOUNDS", "Problems", "RecipeProblems", "bounds", "build", "check_bounds", "coerce", "load_data", "parse_yaml", "plain", "problems_of", "read_text", "type_name", "yaml_problem"]

# 10 M tokens: the longest context window of any released model (Llama 4 Scout). A token count
# above it is a typo, and would size caches of terabytes.
MAX_TOKENS = 10_000_000
# Caps on a file a recipe names and on the values it may expand to: far above any real recipe
# (a few KB, ~200 values) or suite (10,000 prompts are ~50,000 values and a few MB), and low
# enough that a hostile file is refused in milliseconds. Parsing and building 100,000 values
# takes ~1.5 s with the C loader on a 2-core CPU, so the node cap also bounds the time.
MAX_RECIPE_BYTES = 1 << 20  # 1 MiB
MAX_DATA_BYTES = 64 << 20  # 64 MiB: suites and eval sets
MAX_NODES = 100_000
MAX_DEPTH = 64
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


def read_text(path: Path, *, what: str, max_bytes: int = MAX_DATA_BYTES) -> str:
    """A text file's contents, or a RecipeError naming the file: missing, a folder, unreadable, not
    UTF-8, larger than ``max_bytes`` (refused from its size, before a byte is read), or a path the
    operating system cannot use (too long a name, a loop of links)."""
    try:
        if path.is_dir():
            raise RecipeError(f"{what} {_shown(path)} is a folder, expected a file.")
        if not path.is_file():
            raise RecipeError(f"{what} {_shown(path)} does not exist.")
        size = path.stat().st_size
        if size > max_bytes:
            raise RecipeError(f"{what} {_shown(path)} is {size / 2**20:.1f} MiB; such a file may hold at most {max_bytes / 2**20:g} MiB "
                              f"(the limit of fractal_opt.validate). Split it, or point at a smaller one.")
        raw = path.read_bytes()
    except OSError as e:
        raise RecipeError(f"{what} {_shown(path)} cannot be read: {e.strerror or e}.") from None
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark is allowed and dropped
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise RecipeError(f"{what} {_shown(path)} is not UTF-8 text: byte {e.start} (line {line}) is {raw[e.start:e.start + 1]!r}. Save it as UTF-8.") from None


def _shown(path: Path | str) -> str:
    """A path as messages quote it: whole, or its first and last characters when very long."""
    text = str(path)
    return repr(text) if len(text) <= 120 else repr(f"{text[:60]}...{text[-40:]}") + f" ({len(text)} characters)"


def load_data(path: Path, *, what: str) -> Any:
    """Parse a ``.yaml`` / ``.yml`` / ``.json`` / ``.jsonl`` file (a ``.jsonl`` file becomes the list
    of its lines' values), or raise a RecipeError naming the file, the line and what is wrong,
    including a file over the size, node or depth caps (:func:`parse_yaml`)."""
    import yaml

    text = read_text(path, what=what)
    if path.suffix == ".jsonl":
        return _jsonl(text, where=f"{what} {_shown(path)}")
    try:
        return parse_yaml(text, where=f"{what} {_shown(path)}")  # JSON is YAML too
    except yaml.YAMLError as e:
        raise RecipeError(f"{what} {_shown(path)} is not valid YAML{yaml_problem(e)}.") from None


def _jsonl(text: str, *, where: str) -> list[Any]:
    import json

    out: list[Any] = []
    nodes = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecipeError(f"{where}: line {number} is not valid JSON ({e.msg} at column {e.colno}); each line holds one JSON object.") from None
        except RecursionError:  # the C decoder's own guard against nesting that would overflow the stack
            raise RecipeError(f"{where}: line {number} is nested deeper than {MAX_DEPTH} levels (the limit of fractal_opt.validate).") from None
        nodes += _json_shape(value, where=f"{where}: line {number}", budget=MAX_NODES - nodes)
        out.append(value)
    return out


def _json_shape(value: Any, *, where: str, budget: int) -> int:
    """The nodes of a parsed JSON value (refused past ``budget`` or :data:`MAX_DEPTH`), walked with
    a stack of its own so no nesting can reach Python's recursion limit."""
    count, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            raise RecipeError(f"{where} is nested deeper than {MAX_DEPTH} levels (the limit of fractal_opt.validate).")
        if count > budget:
            raise RecipeError(f"{where}: the file holds more than {MAX_NODES:,} values (the limit of fractal_opt.validate). Split it.")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return count


def parse_yaml(text: str, *, where: str) -> Any:
    """YAML text (safe tags only) as Python values, with libyaml's C parser where PyYAML has it.

    Before anything is built, one pass over the parser's events refuses a document larger than
    :data:`MAX_NODES` values *with aliases expanded* (an alias bomb: nine anchors of nine aliases
    are 1 KB of text and 387 million values once expanded, which every later reading of the
    value, from validation to an error message that quotes it, would walk), nested deeper than
    :data:`MAX_DEPTH`, or longer than :data:`MAX_RECIPE_BYTES`. The pass counts; it never expands,
    so a refusal costs milliseconds and no memory. PyYAML offers no such limit itself, hence this.

    Raises:
        RecipeError: over a cap, naming ``where`` and the limit.
        yaml.YAMLError: not valid YAML (callers word that message with the line).
    """
    import yaml

    if len(text) > MAX_DATA_BYTES:
        raise RecipeError(f"{where}: {len(text) / 2**20:.1f} MiB of YAML; at most {MAX_DATA_BYTES / 2**20:g} MiB is read (the limit of fractal_opt.validate).")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader: ~6x faster (libyaml)
    _yaml_shape(yaml.parse(text, Loader=loader), where=where)
    return yaml.load(text, Loader=loader)  # noqa: S506 (a safe loader: CSafeLoader or SafeLoader)


def _yaml_shape(events: Any, *, where: str) -> None:
    """Refuse a YAML event stream whose values, aliases expanded, exceed the node or depth caps."""
    import yaml

    expanded: dict[str, tuple[int, int]] = {}  # anchor -> (values, depth) of what it names, aliases expanded
    open_: list[list[Any]] = []  # the collections being read: [anchor, values so far, depth below]
    total = 0  # values so far, aliases expanded
    for event in events:
        if isinstance(event, yaml.CollectionStartEvent):
            open_.append([event.anchor, 1, 0])
            total += 1
            size = None
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, values, below = open_.pop()
            size = (values, below + 1)
            if anchor:
                expanded[anchor] = size
        elif isinstance(event, yaml.AliasEvent):
            size = expanded.get(event.anchor, (1, 0))  # an unknown anchor: the loader's own error follows
            total += size[0]
        elif isinstance(event, yaml.ScalarEvent):
            size = (1, 0)
            total += 1
            if event.anchor:
                expanded[event.anchor] = size
        else:
            continue  # stream and document boundaries
        if total > MAX_NODES:
            raise RecipeError(f"{where}: more than {MAX_NODES:,} values with aliases expanded (the limit of fractal_opt.validate; "
                              "an anchor repeated through aliases counts each time).")
        depth = len(open_) + (size[1] if size else 0)
        if depth > MAX_DEPTH:
            raise RecipeError(f"{where}: values nested deeper than {MAX_DEPTH} levels (aliases expanded; the limit of fractal_opt.validate).")
        if size and open_:
            parent = open_[-1]
            parent[1] += size[0]
            parent[2] = max(parent[2], size[1])


def yaml_problem(error: Exception) -> str:
    """``" at line L, column C: what"`` for a PyYAML error (its own text spans several lines)."""
    mark = getattr(error, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{at}: {getattr(error, 'problem', None) or error}"


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


