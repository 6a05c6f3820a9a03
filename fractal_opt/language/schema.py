"""The JSON Schema of recipes, built from what the validator itself reads.

Every section is derived from the dataclass the validator builds (``Workload``, ``LoadProfile``,
``Policy``, ``QualityConfig``) and every pass from the registry (plugins included): the same type
hints (``validate.coerce``), the same numeric ranges (``validate.bounds``), the same defaults. So
an editor that reads the schema (yaml-language-server, docs/cli.md) completes and checks the keys
``fractal-opt check`` accepts. The schema is a superset: rules that need code (a pass's own
``__post_init__``, a suite file's contents, the model's files) are checked by ``fractal-opt check``.

Example:
    >>> from fractal_opt.language.schema import recipe_schema
    >>> schema = recipe_schema()
    >>> schema["required"], "dtype" in str(schema["properties"]["passes"])
    (['model'], True)
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union

from ..core.validate import bounds, plain

__all__ = ["DIALECT", "recipe_schema", "section_schema", "type_schema"]

DIALECT = "https://json-schema.org/draft/2020-12/schema"


def type_schema(annotation: Any) -> dict[str, Any]:
    """The schema of one type hint, as ``validate.coerce`` accepts it (an int is no bool; a float
    takes an int; a tuple is a YAML list)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return {}
    if origin is Literal:
        return {"enum": list(typing.get_args(annotation))}
    if origin in (Union, types.UnionType):
        options = [type_schema(a) for a in typing.get_args(annotation)]
        enums = [v for o in options if list(o) == ["enum"] for v in o["enum"]]
        rest = [o for o in options if list(o) != ["enum"]]
        merged = rest + ([{"enum": enums}] if enums else [])
        return merged[0] if len(merged) == 1 else {"anyOf": merged}
    if origin is dict:
        return {"type": "object"}
    if origin is tuple:
        return {"type": "array", "items": type_schema(typing.get_args(annotation)[0])}
    simple = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string"}
    if annotation in simple:
        return {"type": simple[annotation]}
    return {}


def _with_bounds(schema: dict[str, Any], allowed: tuple[float, float] | None) -> dict[str, Any]:
    """Put ``minimum`` / ``maximum`` on every numeric part of ``schema``."""
    if allowed is None:
        return schema
    if schema.get("type") in ("integer", "number"):
        return {**schema, "minimum": allowed[0], "maximum": allowed[1]}
    if schema.get("type") == "array":
        return {**schema, "items": _with_bounds(schema["items"], allowed)}
    if "anyOf" in schema:
        return {**schema, "anyOf": [_with_bounds(s, allowed) for s in schema["anyOf"]]}
    return schema


def _attribute_docs(cls: type) -> dict[str, str]:
    """``name: text`` lines of the class docstring's ``Attributes:`` section, joined per name."""
    doc = typing.cast(str, cls.__doc__ or "")
    if "Attributes:" not in doc:
        return {}
    out: dict[str, str] = {}
    current = None
    for line in doc.split("Attributes:", 1)[1].splitlines():
        match = re.match(r"^\s{4,8}([\w /]+):\s*(.*)$", line)
        if match and not line.startswith(" " * 12):
            names = [n.strip() for n in match.group(1).split("/")]
            current = names
            for n in names:
                out[n] = match.group(2).strip()
        elif current and line.strip():
            for n in current:
                out[n] += " " + line.strip()
        elif not line.strip() and current:
            current = None
    return out


def section_schema(cls: type, *, overrides: dict[str, dict[str, Any]] | None = None, description: str = "") -> dict[str, Any]:
    """An object schema for dataclass ``cls``: one property per field, no other keys."""
    hints = typing.get_type_hints(cls)
    docs = _attribute_docs(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        prop = (overrides or {}).get(f.name) or _with_bounds(type_schema(hints[f.name]), bounds(cls, f, hints[f.name]))
        default = f.default if f.default is not dataclasses.MISSING else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            prop = {**prop, "default": plain(default)}
        if docs.get(f.name):
            prop = {**prop, "description": docs[f.name]}
        props[f.name] = prop
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if description:
        schema["description"] = description
    return schema


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _guards_schema() -> dict[str, Any]:
    from .policy import ALL_METRICS

    limit = {"type": "number"}
    guard = {"type": "object", "properties": {**{k: limit for k in ("min", "max", "max_regression", "max_drop")}, "accept_unknown": {"type": "boolean"},
                                              "judged_by": {"anyOf": [{"enum": sorted(ALL_METRICS)}, {"type": "null"}]}},
             "additionalProperties": False, "minProperties": 1}
    return {
        "type": "object",
        "description": "metric -> {min|max|max_regression|max_drop: number, accept_unknown: bool, judged_by: metric}; null removes a default guard; 'probe.name' guards a custom probe's number",
        "propertyNames": {"anyOf": [{"enum": sorted(ALL_METRICS)}, {"pattern": r"^[A-Za-z_]\w*\.\w+$"}]},
        "additionalProperties": {"anyOf": [guard, {"type": "null"}]},
    }


def _targets_schema() -> dict[str, Any]:
    from .policy import ALL_METRICS

    return {
        "type": "object",
        "description": "the numbers wanted: metric -> a positive number (at least it when higher is better, at most it otherwise)",
        "propertyNames": {"enum": sorted(ALL_METRICS)},
        "additionalProperties": {"type": "number", "exclusiveMinimum": 0},
    }


def _passes_schema() -> dict[str, Any]:
    from ..layers import passes_by_layer
    from ..search.search_pass import SEARCHES

    layers: dict[str, Any] = {}
    for layer, registered in passes_by_layer().items():
        classes = [*registered, *([SEARCHES[layer]] if layer in SEARCHES else [])]  # `search`: a layer's generated candidates
        entries: list[dict[str, Any]] = [{"enum": sorted(c.name for c in classes), "description": "a pass with its default parameters"}]
        for cls in sorted(classes, key=lambda c: c.name):
            params = section_schema(cls, description=cls.summary())
            entries.append({"type": "object", "properties": {cls.name: _nullable(params)}, "required": [cls.name], "additionalProperties": False,
                            "description": cls.summary()})
        layers[layer.section] = _nullable({"type": "array", "items": {"anyOf": entries}})
    return {"type": "object", "description": "layer -> the passes to try, in order; each entry {name: {param: value}} or a bare name",
            "properties": layers, "additionalProperties": False}


def recipe_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) a recipe file satisfies."""
    from ..core.machine import MachinePrice
    from ..quality.probes import QualityConfig
    from ..weights import models
    from ..workloads.workload import LoadProfile, Workload
    from .policy import Policy
    from .recipe import RECIPE_VERSION, TOP_LEVEL

    load = _nullable(section_schema(LoadProfile, description="how requests arrive: measure every plan through a server under this load"))
    known: dict[str, Any] = {
        "version": {"type": "integer", "minimum": 1, "maximum": RECIPE_VERSION, "description": f"the recipe format; this fractal_opt reads up to {RECIPE_VERSION}"},
        "name": {"type": "string"},
        "model": {"anyOf": [
            {"type": "string", "description": "an embedded model name, a model folder, a .gguf file or a hub id (org/name) in the local cache",
             "examples": sorted(models.EMBEDDED)},
            {"type": "object", "additionalProperties": False, "required": ["source"], "properties": {
                "source": {"type": "string", "description": "an embedded model name, a model folder, a .gguf file or a cached hub id"},
                "chat_template": {"anyOf": [{"type": "string"}, {"type": "boolean", "const": False}],
                                  "description": "auto (the model's own; plain text without one), none, a .jinja file, or a Jinja template"},
                "trust_remote_code": {"type": "boolean", "description": "run the model folder's own Python code (config.json's auto_map)"}}},
        ]},
        "workload": _nullable(section_schema(Workload, overrides={"load": load}, description="what each measurement runs")),
        "policy": _nullable(section_schema(Policy, overrides={"guards": _guards_schema()}, description="how a step is judged")),
        "quality": _nullable(section_schema(QualityConfig, description="quality probes against the baseline")),
        "targets": _targets_schema(),
        "machine": _nullable(section_schema(MachinePrice, description="what the machine costs: the cost per token in dollars")),
        "passes": _nullable(_passes_schema()),
    }
    return {
        "$schema": DIALECT,
        "title": "fractal-opt recipe",
        "description": "A recipe for fractal-opt: the model, what to measure, how to judge, and the passes to try (`fractal-opt check` validates a file fully).",
        "type": "object",
        "required": ["model"],
        "properties": {key: known.get(key, {}) for key in TOP_LEVEL},
        "additionalProperties": False,
    }
