"""Recipes: YAML <-> Recipe, validated strictly before any model is loaded.

```yaml
version: 1                            # the recipe format (optional; a newer one than this fractal_opt reads is refused)
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
field, the value, what is allowed and the closest valid name; every problem of a file is reported
at once (:class:`fractal_opt.core.validate.RecipeProblems`). Validation reads no weights but checks all
it can without them: the model's files and headers, the suite and eval set, and that every prompt
fits the model's positions and the recipe's context cap.

``dump_recipe`` writes only what differs from the defaults, in block style, with ``version:`` on
top: the file users check into their repositories, so a diff shows a real change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import ModelSourceError, RecipeError, closest
from ..core.machine import MachinePrice
from ..core.validate import MAX_RECIPE_BYTES, Problems, build, parse_yaml, plain, read_text, yaml_problem
from ..layers import get_pass, registry
from ..quality.probes import QualityConfig
from ..tower.passes import Layer, Pass
from ..tower.plan import ApplicationPlan, ModelPlan, Plan
from ..weights import models
from ..weights.heads import tensor_parallel_problem
from ..workloads.workload import Request, Workload
from .model_spec import ModelSpec, architecture_problems, parse_model
from .policy import Policy
from .targets import Targets, parse_targets

__all__ = ["RECIPE_VERSION", "Recipe", "dump_recipe", "load_recipe"]

# The recipe format this fractal_opt reads and writes. Bump it when a field changes meaning, so an
# older fractal_opt refuses a newer recipe instead of misreading it.
RECIPE_VERSION = 1

TOP_LEVEL = ("version", "name", "model", "workload", "policy", "quality", "targets", "machine", "passes")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A validated recipe: the model, what to measure, how to judge, and the passes to try."""

    model: str  # the source: an embedded name, a folder, a .gguf file or a hub id
    workload: Workload = field(default_factory=Workload)
    policy: Policy = field(default_factory=Policy)
    quality: QualityConfig = field(default_factory=QualityConfig)
    passes: tuple[Pass, ...] = ()  # in tower order (by layer, then recipe order)
    name: str | None = None
    targets: Targets = field(default_factory=Targets)  # the numbers wanted (pipeline/targets.py)
    machine: MachinePrice = field(default_factory=MachinePrice)  # what the machine costs (the cost per token in dollars)
    spec: ModelSpec | None = None  # model: as a mapping (chat_template, trust_remote_code); None = the plain source

    def base_plan(self) -> Plan:
        """The baseline: the model as plain transformers would run it (rendered and trusted as ``model:`` says)."""
        spec = self.spec or ModelSpec(source=self.model)
        return Plan(source=self.model, model=ModelPlan(trust_remote_code=spec.trust_remote_code),
                    application=ApplicationPlan(chat_template=spec.chat_template))

    def plan(self) -> Plan:
        """The plan with every pass applied in order (a tuned recipe's passes are the kept ones)."""
        plan = self.base_plan()
        for p in self.passes:
            plan = p.apply(plan).with_applied(p.name)
        return plan

    def code(self) -> list[str]:
        """The Python code this recipe imports and runs (``quality.probes``), as ``module:function``."""
        return list(self.quality.probes)

    def to_dict(self, *, defaults: bool = True) -> dict[str, Any]:
        """The recipe as plain data; ``defaults=False`` leaves out every value that is the default
        (a pass with default parameters becomes its bare name)."""

        def section(obj: Any) -> dict[str, Any]:
            return {k: plain(v) for k, v in _fields(obj) if defaults or v != _default(type(obj), k)}

        grouped: dict[str, list] = {}
        for p in self.passes:
            params = {k: plain(v) for k, v in _fields(p) if defaults or v != _default(type(p), k)}
            grouped.setdefault(p.layer.section, []).append({p.name: params} if params or defaults else p.name)
        out: dict[str, Any] = {"version": RECIPE_VERSION}
        if self.name:
            out["name"] = self.name
        out["model"] = (self.spec or ModelSpec(source=self.model)).to_data()
        for key, obj in (("workload", self.workload), ("policy", self.policy), ("quality", self.quality)):
            values = section(obj)
            if values or defaults:
                out[key] = values
        if self.targets:
            out["targets"] = self.targets.to_dict()
        if self.machine.price_per_hour is not None:
            out["machine"] = {"price_per_hour": self.machine.price_per_hour}
        if grouped or defaults:
            out["passes"] = grouped
        return out


def _fields(obj: Any) -> list[tuple[str, Any]]:
    import dataclasses

    return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]


def _default(cls: type, name: str) -> Any:
    import dataclasses

    f = cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


class _BlockDumper(yaml.SafeDumper):
    """Block style with list items indented under their key, as yamllint and most editors expect."""

    def increase_indent(self, flow: bool = False, indentless: bool = False):
        return super().increase_indent(flow, False)


def dump_recipe(recipe: Recipe, path: str | Path | None = None, *, header: str = "") -> str:
    """Recipe -> YAML text, only what differs from the defaults, block style, ``version:`` on top
    (written to ``path`` when given)."""
    data = recipe.to_dict(defaults=False)
    text = header + yaml.dump(data, Dumper=_BlockDumper, sort_keys=False, default_flow_style=False, width=110, allow_unicode=True)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def load_recipe(source: Recipe | Mapping[str, Any] | str | Path, *, check_model: bool = True, complete_model: bool = False) -> Recipe:
    """Load and validate a recipe from a path, YAML text, a dict, or a Recipe (returned as is).

    ``check_model`` resolves the model and checks the files it has (config, headers) and that the
    prompts fit it; ``complete_model`` also requires weights and a tokenizer in a model folder
    (``fractal-opt check`` asks for it; see ``models.check_files``).

    Raises:
        RecipeError: anything invalid, before any model is loaded.
    """
    if isinstance(source, Recipe):
        return source
    where = "recipe"
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and (source.endswith((".yaml", ".yml")) or ":" not in source)):
        path = Path(source)
        where = str(path)
        source = read_text(path, what="recipe file", max_bytes=MAX_RECIPE_BYTES)
    if isinstance(source, str):
        try:
            data = parse_yaml(source, where=where)  # C loader; caps on size, values (aliases expanded) and depth
        except yaml.YAMLError as e:
            raise RecipeError(f"{where}: not valid YAML{yaml_problem(e)}.") from None
    else:
        data = source
    if not isinstance(data, Mapping):
        raise RecipeError(f"{where}: expected a mapping with keys {list(TOP_LEVEL)}, got {type(data).__name__}.")
    return parse_recipe(data, where=where, check_model=check_model, complete_model=complete_model)


def parse_recipe(data: Mapping[str, Any], *, where: str = "recipe", check_model: bool = True, complete_model: bool = False) -> Recipe:
    """Validate a recipe mapping; every problem found is reported at once (RecipeProblems)."""
    found = Problems()
    for key in data:
        if key not in TOP_LEVEL:
            found.add(f"{where}: unknown key {key!r}. Valid keys are: {list(TOP_LEVEL)}.{closest(str(key), TOP_LEVEL)}")
    with found.collect(f"{where}: "):
        _check_version(data.get("version"), where=where)
    spec = None
    if "model" not in data:
        found.add(f"{where}: missing key 'model' (an embedded name such as {min(models.EMBEDDED)!r}, a local directory, a .gguf file or a hub id).")
    else:
        with found.collect(f"{where}: "):
            spec = parse_model(data["model"], where=where)
    model = spec.source if spec is not None else data.get("model")
    source = _model_source(spec, found, where=where, check_model=check_model, complete_model=complete_model)
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        found.add(f"{where}, key 'name': got {name!r}, expected a string.")
    workload = policy = quality = None
    requests: list[Request] = []
    with found.collect(f"{where}: "):
        workload = build(Workload, data.get("workload"), where=f"{where}: workload")
    if workload is not None:
        with found.collect(f"{where}: "):
            requests = workload.requests()  # validates the suite now, not after the model has loaded
    with found.collect(f"{where}: "):
        policy = build(Policy, data.get("policy"), where=f"{where}: policy")
    guards = data["policy"].get("guards") if isinstance(data.get("policy"), Mapping) else None
    for path, value in _non_finite(guards, "policy.guards"):  # a NaN limit would never trip (the rest is bounded by build)
        found.add(f"{where}: {path}: got {value!r}, expected a finite number.")
    with found.collect(f"{where}: "):
        quality = build(QualityConfig, data.get("quality"), where=f"{where}: quality")
    eval_requests = _eval_requests(quality, model, found, where=where, chat_template=spec.chat_template if spec is not None else None)
    passes = _parse_passes(data.get("passes"), where=f"{where}: passes", found=found)
    targets = None
    with found.collect(f"{where}: "):
        targets = parse_targets(data.get("targets"), where=f"{where}: targets")
    if source is not None and workload is not None:
        with found.collect(f"{where}: "):
            _check_prompts(source, requests, workload.max_new_tokens, passes, where=f"{where}: workload suite {workload.suite!r}")
            if quality is not None:
                _check_prompts(source, eval_requests, quality.eval_max_new_tokens, passes, where=f"{where}: quality eval {quality.eval!r}")
    if source is not None:
        for problem in split_problems(str(model), passes):  # a tensor-parallel degree the model's heads refuse, from its files alone
            found.add(f"{where}: passes: {problem}")
    if workload is not None and policy is not None and targets is not None:
        with found.collect(f"{where}: "):
            workload.check_wanted({policy.objective, *policy.guards, *targets.to_dict()})
    price = MachinePrice()
    with found.collect(f"{where}: "):
        price = MachinePrice.from_data(data.get("machine"))
    if source is not None and complete_model and not found.items:
        for problem in architecture_problems(source, passes):
            found.add(f"{where}: {problem}")
    found.raise_if_any()
    assert isinstance(model, str) and workload and policy and quality and targets is not None
    plain_spec = spec is None or spec == ModelSpec(source=spec.source)
    return Recipe(model=model, workload=workload, policy=policy, quality=quality, passes=passes, name=name, targets=targets, machine=price,
                  spec=None if plain_spec else spec)


def _model_source(spec: ModelSpec | None, found: Problems, *, where: str, check_model: bool, complete_model: bool) -> models.ModelSource | None:
    """The recipe's model, resolved and its files checked (None when it cannot be, with the problem added to ``found``)."""
    if spec is None:  # missing or refused: found says why
        return None
    model = spec.source
    if check_model:
        try:
            source = models.resolve(model)
            models.check_files(source, complete=complete_model, trust_remote_code=spec.trust_remote_code)
            return source
        except ModelSourceError as e:
            found.add(f"{where}: {e}")
        except OSError as e:  # a name the OS refuses as a path (too long, a loop of links)
            found.add(f"{where}, key 'model': {model[:60]!r}{'...' if len(model) > 60 else ''} ({len(model)} characters) cannot be used as a path: "
                      f"{e.strerror or e}. Give an embedded name, a local folder, a .gguf file or a hub id.")
    return None

def _eval_requests(quality: QualityConfig | None, model: Any, found: Problems, *, where: str, chat_template: str | None = None) -> list[Request]:
    """The eval set's requests, loaded (and so validated) before any model loads; ``auto`` is
    resolved here (the chat or the completion-form set, by the form the model's prompts take)."""
    if quality is None or not isinstance(model, str):
        return []
    from ..quality.evals import AUTO, eval_set_name, fitting, load_eval_set

    if not (eval_set := eval_set_name(quality.eval, model, chat_template)):
        return []
    with found.collect(f"{where}: "):
        items = load_eval_set(eval_set)
        if quality.eval == AUTO:  # a packaged set: only its questions that fit the model (pipeline/step_quality.py does the same)
            items = fitting(items, model, quality.eval_max_new_tokens)
        return [item.request for item in items]
    return []  # the set was refused: found holds why


def _non_finite(value: Any, path: str):
    """(path, value) for every infinite or NaN number in nested YAML data."""
    if isinstance(value, float) and not math.isfinite(value):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _non_finite(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _non_finite(v, f"{path}[{i}]")


def _check_version(version: Any, *, where: str) -> None:
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise RecipeError(f"{where}, key 'version': got {version!r}, expected a recipe format number (this fractal_opt writes {RECIPE_VERSION}).")
    if version > RECIPE_VERSION:
        import importlib.metadata  # the installed version, without importing the package face from below

        try:
            installed = importlib.metadata.version("fractal-opt")
        except importlib.metadata.PackageNotFoundError:
            installed = "(not installed)"
        raise RecipeError(
            f"{where}, key 'version': this recipe is format {version}, newer than fractal_opt {installed} reads (up to {RECIPE_VERSION}). "
            "Upgrade fractal-opt (pip install -U fractal-opt) to run it."
        )


def _check_prompts(source: models.ModelSource, requests: list[Request], max_new_tokens: int, passes: tuple[Pass, ...], *, where: str) -> None:
    """Refuse a request whose prompt plus ``max_new_tokens`` cannot fit the model's positions or
    the recipe's context cap: counted from the tokenizer file (exact) or the GGUF vocabulary (a
    lower bound), without loading the model. The chat template adds a few tokens on top."""
    caps = [p.params()["tokens"] for p in passes if p.name == "context_cap"]
    limits = [(n, "the model's positions") for n in [models.positions(source)] if n]
    limits += [(min(caps), "the context_cap pass's cap")] if caps else []
    counter = models.token_counter(source) if requests and limits else None
    if counter is None:
        return
    count, exact = counter
    found = Problems()
    for r in requests:
        n = sum(count(content) for _, content in r.messages)
        for limit, what in limits:
            if n + max_new_tokens > limit:
                found.add(
                    f"{where}, request {r.id!r}: the prompt has {'' if exact else 'at least '}{n} tokens, "
                    f"plus max_new_tokens {max_new_tokens} is {n + max_new_tokens}, over {what} ({limit}). "
                    "Shorten the prompt or lower max_new_tokens" + (" (or raise context_cap tokens)." if "cap" in what else ".")
                )
                break
    found.raise_if_any()


def split_problems(model: str, passes: tuple[Pass, ...]) -> list[str]:
    """Each pass whose tensor-parallel degree the model's attention heads refuse (read from its files), with why."""
    base = Plan(source=model)
    out = []
    for p in passes:
        degree = p.apply(base).hardware.tensor_parallel
        if degree > 1 and (why := tensor_parallel_problem(model, degree)):
            out.append(f"pass {p.describe()}: {why}")
    return out


def _parse_passes(data: Any, *, where: str, found: Problems) -> tuple[Pass, ...]:
    if data is None:
        return ()
    layers = [layer.section for layer in Layer]
    if not isinstance(data, Mapping):
        found.add(f"{where}: expected a mapping of layer -> list of passes, with layers {layers}; got {data!r}.")
        return ()
    by_layer: dict[Layer, list[Pass]] = {}
    for layer_name, entries in data.items():
        try:
            layer = Layer.from_name(layer_name)  # raises with the valid layers
        except RecipeError as e:
            found.add(f"{where}: {e}")
            continue
        if entries is None:
            continue
        if not isinstance(entries, list):
            found.add(f"{where}.{layer_name}: expected a list of passes like [{{name: {{param: value}}}}], got {entries!r}.")
            continue
        for i, entry in enumerate(entries):
            with found.collect():  # every bad pass of the file, not the first
                by_layer.setdefault(layer, []).append(_parse_entry(entry, layer, where=f"{where}.{layer_name}[{i}]"))
    seen: set[Pass] = set()
    ordered = []
    for layer in Layer:
        for p in by_layer.get(layer, []):
            if p in seen:
                found.add(f"{where}: pass {p.describe()} is listed twice.")
                continue
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
    if name == "search":  # a layer's generated candidates: one search class a layer (fractal_opt.search)
        from ..search.search_pass import search_for

        return search_for(layer).from_params(params, where=f"{where} (search)")
    cls = get_pass(str(name)) if name in registry() else _unknown(str(name), layer, where)
    if cls.layer is not layer:
        raise RecipeError(f"{where}: pass {name!r} belongs to layer {cls.layer.section!r}, not {layer.section!r}. Move it under passes.{cls.layer.section}.")
    return cls.from_params(params, where=f"{where} ({name})")


def _unknown(name: str, layer: Layer, where: str):
    same_layer = sorted(n for n, c in registry().items() if c.layer is layer)
    everything = sorted(registry())
    msg = f"{where}: unknown pass {name!r}. Passes of layer {layer.section!r} are: {same_layer}.{closest(name, everything)}"
    raise RecipeError(msg)
