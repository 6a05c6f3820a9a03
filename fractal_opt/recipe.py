"""Recipes: YAML <-> Recipe, validated strictly before any model is loaded.

```yaml
model: smollm2-135m-instruct          # embedded name, local dir, .gguf file or hub id
workload: {suite: default, max_new_tokens: 32, repeats: 3}
policy:
  objective: auto                     # each layer's natural objective
  guards: {kl_mean: {max: 0.05}}
quality: {reference_tokens: 512}
passes:
  hardware:    [{threads: {count: auto}}, {dtype: {dtype: bfloat16}}]
  model:       [{quantize: {bits: 8}}]
  scheduling:  [{batching: {mode: static, batch_size: 8}}]
  application: [{max_new_tokens: {limit: 24}}]
```

A pass entry is ``{name: {param: value}}`` or a bare ``name`` for its defaults. Errors name the
field, the value, what is allowed and the closest valid name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import models
from .errors import ModelSourceError, RecipeError, closest
from .layers import get_pass, registry
from .passes import Layer, Pass
from .plan import Plan
from .policy import Policy
from .quality.probes import QualityConfig
from .validate import build
from .workload import Workload

__all__ = ["Recipe", "dump_recipe", "load_recipe"]

TOP_LEVEL = ("name", "model", "workload", "policy", "quality", "passes")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A validated recipe: the model, what to measure, how to judge, and the passes to try."""

    model: str
    workload: Workload = field(default_factory=Workload)
    policy: Policy = field(default_factory=Policy)
    quality: QualityConfig = field(default_factory=QualityConfig)
    passes: tuple[Pass, ...] = ()  # in tower order (by layer, then recipe order)
    name: str | None = None

    def base_plan(self) -> Plan:
        """The baseline: the model as plain transformers would run it."""
        return Plan(source=self.model)

    def plan(self) -> Plan:
        """The plan with every pass applied in order (a tuned recipe's passes are the kept ones)."""
        plan = self.base_plan()
        for p in self.passes:
            plan = p.apply(plan).with_applied(p.name)
        return plan

    def to_dict(self) -> dict[str, Any]:
        from .validate import plain

        def section(obj: Any) -> dict[str, Any]:
            import dataclasses

            return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}

        grouped: dict[str, list] = {}
        for p in self.passes:
            grouped.setdefault(p.layer.section, []).append({p.name: p.params()})
        out: dict[str, Any] = {}
        if self.name:
            out["name"] = self.name
        out.update(model=self.model, workload=section(self.workload), policy=section(self.policy), quality=section(self.quality), passes=grouped)
        return out


def dump_recipe(recipe: Recipe, path: str | Path | None = None, *, header: str = "") -> str:
    """Recipe -> YAML text (written to ``path`` when given)."""
    text = header + yaml.safe_dump(recipe.to_dict(), sort_keys=False, default_flow_style=None, width=110)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def load_recipe(source: Recipe | Mapping[str, Any] | str | Path, *, check_model: bool = True) -> Recipe:
    """Load and validate a recipe from a path, YAML text, a dict, or a Recipe (returned as is).

    Raises:
        RecipeError: anything invalid, before any model is loaded.
    """
    if isinstance(source, Recipe):
        return source
    where = "recipe"
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml"))):
        path = Path(source)
        if not path.is_file():
            raise RecipeError(f"recipe file {str(path)!r} does not exist.")
        where = str(path)
        source = path.read_text(encoding="utf-8")
    if isinstance(source, str):
        try:
            data = yaml.safe_load(source)
        except yaml.YAMLError as e:
            raise RecipeError(f"{where}: not valid YAML: {e}") from None
    else:
        data = source
    if not isinstance(data, Mapping):
        raise RecipeError(f"{where}: expected a mapping with keys {list(TOP_LEVEL)}, got {type(data).__name__}.")
    return parse_recipe(data, where=where, check_model=check_model)


def parse_recipe(data: Mapping[str, Any], *, where: str = "recipe", check_model: bool = True) -> Recipe:
    for key in data:
        if key not in TOP_LEVEL:
            raise RecipeError(f"{where}: unknown key {key!r}. Valid keys are: {list(TOP_LEVEL)}.{closest(str(key), TOP_LEVEL)}")
    if "model" not in data:
        raise RecipeError(f"{where}: missing key 'model' (an embedded name such as {sorted(models.EMBEDDED)[0]!r}, a local directory, a .gguf file or a hub id).")
    model = data["model"]
    if not isinstance(model, str):
        raise RecipeError(f"{where}, key 'model': got {model!r}, expected a string.")
    if check_model:
        try:
            models.resolve(model)
        except ModelSourceError as e:
            raise RecipeError(f"{where}: {e}") from None
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise RecipeError(f"{where}, key 'name': got {name!r}, expected a string.")
    workload = build(Workload, data.get("workload"), where=f"{where}: workload")
    workload.requests()  # validates the suite now, not after the model has loaded
    policy = build(Policy, data.get("policy"), where=f"{where}: policy")
    quality = build(QualityConfig, data.get("quality"), where=f"{where}: quality")
    if quality.eval:
        from .quality.evals import load_eval_set

        load_eval_set(quality.eval)  # validates the eval set before any model loads
    passes = _parse_passes(data.get("passes"), where=f"{where}: passes")
    return Recipe(model=model, workload=workload, policy=policy, quality=quality, passes=passes, name=name)


def _parse_passes(data: Any, *, where: str) -> tuple[Pass, ...]:
    if data is None:
        return ()
    layers = [layer.section for layer in Layer]
    if not isinstance(data, Mapping):
        raise RecipeError(f"{where}: expected a mapping of layer -> list of passes, with layers {layers}; got {data!r}.")
    by_layer: dict[Layer, list[Pass]] = {}
    for layer_name, entries in data.items():
        layer = Layer.from_name(layer_name)  # raises with the valid layers
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise RecipeError(f"{where}.{layer_name}: expected a list of passes like [{{name: {{param: value}}}}], got {entries!r}.")
        for i, entry in enumerate(entries):
            by_layer.setdefault(layer, []).append(_parse_entry(entry, layer, where=f"{where}.{layer_name}[{i}]"))
    seen: set[Pass] = set()
    ordered = []
    for layer in Layer:
        for p in by_layer.get(layer, []):
            if p in seen:
                raise RecipeError(f"{where}: pass {p.describe()} is listed twice.")
            seen.add(p)
            ordered.append(p)
    return tuple(ordered)


def _parse_entry(entry: Any, layer: Layer, *, where: str) -> Pass:
    if isinstance(entry, str):
        name, params = entry, {}
    elif isinstance(entry, Mapping) and len(entry) == 1:
        ((name, params),) = entry.items()
    else:
        raise RecipeError(f"{where}: a pass is written as {{name: {{param: value}}}} or a bare name, got {entry!r}.")
    cls = get_pass(str(name)) if name in registry() else _unknown(str(name), layer, where)
    if cls.layer is not layer:
        raise RecipeError(f"{where}: pass {name!r} belongs to layer {cls.layer.section!r}, not {layer.section!r}. Move it under passes.{cls.layer.section}.")
    return cls.from_params(params, where=f"{where} ({name})")


def _unknown(name: str, layer: Layer, where: str):
    same_layer = sorted(n for n, c in registry().items() if c.layer is layer)
    everything = sorted(registry())
    msg = f"{where}: unknown pass {name!r}. Passes of layer {layer.section!r} are: {same_layer}.{closest(name, everything)}"
    raise RecipeError(msg)
