"""Reading the files a recipe is and names (recipes, suites, eval sets), bounded before any work.

Hostile or huge files are refused in milliseconds with a RecipeError naming the file and the
limit (exit 2 in the CLI): a recipe over :data:`MAX_RECIPE_BYTES` or a data file over
:data:`MAX_DATA_BYTES` from its size alone; YAML with more than :data:`MAX_NODES` values once its
aliases are expanded, or nested deeper than :data:`MAX_DEPTH`, from one counting pass over the
parser's events (:func:`parse_yaml`); a JSONL line nested too deep; a path the operating system
refuses. YAML parses with libyaml's C loader where PyYAML has it (6x faster than the Python one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import RecipeError

__all__ = ["MAX_DATA_BYTES", "MAX_DEPTH", "MAX_NODES", "MAX_RECIPE_BYTES", "load_data", "parse_yaml", "read_text", "yaml_problem"]

# Caps on a file a recipe names and on the values it may expand to: far above any real recipe
# (a few KB, ~200 values) or suite (10,000 prompts are ~50,000 values and a few MB), and low
# enough that a hostile file is refused in milliseconds. Building values is the slow part, so the
# node cap also bounds the time a file that passes may take (measured: a mapping of 80,000 keys,
# 160,000 events, took 0.25 s to count and 2.1 s to build with the C loader, 2-core VM at load 5.5).
MAX_RECIPE_BYTES = 1 << 20  # 1 MiB
MAX_DATA_BYTES = 64 << 20  # 64 MiB: suites and eval sets
MAX_NODES = 100_000
MAX_DEPTH = 64


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
                              f"(the limit of fractal_opt.core.files). Split it, or point at a smaller one.")
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
            raise RecipeError(f"{where}: line {number} is nested deeper than {MAX_DEPTH} levels (the limit of fractal_opt.core.files).") from None
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
            raise RecipeError(f"{where} is nested deeper than {MAX_DEPTH} levels (the limit of fractal_opt.core.files).")
        if count > budget:
            raise RecipeError(f"{where}: the file holds more than {MAX_NODES:,} values (the limit of fractal_opt.core.files). Split it.")
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
        raise RecipeError(f"{where}: {len(text) / 2**20:.1f} MiB of YAML; at most {MAX_DATA_BYTES / 2**20:g} MiB is read (the limit of fractal_opt.core.files).")
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
            raise RecipeError(f"{where}: more than {MAX_NODES:,} values with aliases expanded (the limit of fractal_opt.core.files; "
                              "an anchor repeated through aliases counts each time).")
        depth = len(open_) + (size[1] if size else 0)
        if depth > MAX_DEPTH:
            raise RecipeError(f"{where}: values nested deeper than {MAX_DEPTH} levels (aliases expanded; the limit of fractal_opt.core.files).")
        if size and open_:
            parent = open_[-1]
            parent[1] += size[0]
            parent[2] = max(parent[2], size[1])


def yaml_problem(error: Exception) -> str:
    """``" at line L, column C: what"`` for a PyYAML error (its own text spans several lines)."""
    mark = getattr(error, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{at}: {getattr(error, 'problem', None) or error}"
