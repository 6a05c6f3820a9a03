"""The recipe's ``model:`` key: a name or path, or a mapping that also says how prompts are
rendered and whether the model's own Python code may run.

```yaml
model: ./my-base-model                # an embedded name, a folder, a .gguf file or a cached hub id
# or
model:
  source: ./my-base-model
  chat_template: none                 # auto (the model's own; plain text without one) | none | a .jinja file | a template
  trust_remote_code: false            # true runs the model folder's own Python code (said loudly at every run)
```

``chat_template`` becomes the plan's ``application.chat_template`` (:mod:`fractal_opt.weights.prompts`),
read here from its file so the plan carries the template itself; ``trust_remote_code`` becomes
``model.trust_remote_code``. Both hold for the baseline and every step alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import RecipeError, closest
from ..weights.prompts import NO_TEMPLATE

__all__ = ["KEYS", "ModelSpec", "architecture_problems", "parse_model"]

KEYS = ("source", "chat_template", "trust_remote_code")
_MAX_TEMPLATE_BYTES = 256 * 1024  # the largest chat templates shipped with models are ~20 KB


@dataclass(frozen=True)
class ModelSpec:
    """The model a recipe names and how it is run."""

    source: str
    chat_template: str | None = None  # None: the model's own (plain text without one); "none"; a template's text
    template_file: str | None = None  # where chat_template was read from (written back by to_data)
    trust_remote_code: bool = False

    def to_data(self) -> str | dict[str, Any]:
        """The recipe's ``model:`` value: the plain source when nothing else is set."""
        if self.chat_template is None and not self.trust_remote_code:
            return self.source
        out: dict[str, Any] = {"source": self.source}
        if self.chat_template is not None:
            out["chat_template"] = self.template_file or self.chat_template
        if self.trust_remote_code:
            out["trust_remote_code"] = True
        return out


def parse_model(value: Any, *, where: str) -> ModelSpec:
    """``model:`` as a :class:`ModelSpec`.

    Raises:
        RecipeError: naming the key, the value and what is allowed.
    """
    if isinstance(value, str):
        return ModelSpec(source=value)
    if not isinstance(value, Mapping):
        raise RecipeError(f"{where}, key 'model': got {value!r}, expected a name or path, or a mapping with keys {list(KEYS)}.")
    for key in value:
        if key not in KEYS:
            raise RecipeError(f"{where}, key 'model': unknown key {key!r}. Valid keys are: {list(KEYS)}.{closest(str(key), KEYS)}")
    source = value.get("source")
    if not isinstance(source, str) or not source.strip():
        raise RecipeError(f"{where}, key 'model.source': got {source!r}, expected an embedded name, a folder, a .gguf file or a hub id.")
    trust = value.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise RecipeError(f"{where}, key 'model.trust_remote_code': got {trust!r}, expected true or false.")
    template, file = _template(value.get("chat_template", "auto"), where=where)
    if template not in (None, NO_TEMPLATE):
        from ..core.errors import ModelSourceError
        from ..weights.checks import check_template

        try:
            check_template(template, where=f"{where}, key 'model.chat_template'")
        except ModelSourceError as e:
            raise RecipeError(str(e)) from None
    return ModelSpec(source=source, chat_template=template, template_file=file, trust_remote_code=trust)


def architecture_problems(source: Any, passes: Any) -> list[str]:
    """What llama.cpp cannot do with a model folder, known from config.json before any weight
    loads: a pass moves the plan to a runtime that serves GGUF files, and llama.cpp's converter
    does not know the folder's architecture (or is not installed)."""
    folder = getattr(source, "folder", None)
    if folder is None:
        return []
    from ..core.errors import ModelSourceError
    from ..engine.registry import capabilities_of
    from ..tower.plan import Plan
    from ..weights.convert import conversion_problem

    gguf_steps = [p for p in passes if p.name == "runtime" and capabilities_of(p.apply(Plan(source=str(folder)))).weights == "gguf"]
    if not gguf_steps:
        return []
    try:
        problem = conversion_problem(folder)
    except ModelSourceError as e:
        problem = str(e)
    return [f"model: {str(folder)!r}: the recipe's runtime: {gguf_steps[0].backend} pass serves GGUF files, and {problem}"] if problem else []


def _template(value: Any, *, where: str) -> tuple[str | None, str | None]:
    """(the template, the file it came from) for a ``chat_template`` value."""
    if value in ("auto", None):
        return None, None
    if value is False or value == NO_TEMPLATE:  # YAML 1.1 reads an unquoted "no" / "off" as false
        return NO_TEMPLATE, None
    if not isinstance(value, str) or not value.strip():
        raise RecipeError(f"{where}, key 'model.chat_template': got {value!r}, expected auto, none, a .jinja file or a Jinja template.")
    if "{{" in value or "{%" in value:
        return value, None
    path = Path(value).expanduser()
    if path.suffix not in (".jinja", ".j2", ".txt") or not path.is_file():
        raise RecipeError(f"{where}, key 'model.chat_template': {value!r} is not auto, none, an existing .jinja file or a Jinja template "
                          "(a template holds {{ ... }} or {% ... %}).")
    if path.stat().st_size > _MAX_TEMPLATE_BYTES:
        raise RecipeError(f"{where}, key 'model.chat_template': {value!r} is {path.stat().st_size} bytes; a chat template is at most {_MAX_TEMPLATE_BYTES}.")
    try:
        return path.read_text(encoding="utf-8"), value
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{where}, key 'model.chat_template': {value!r} cannot be read as UTF-8 text: {e}.") from None
