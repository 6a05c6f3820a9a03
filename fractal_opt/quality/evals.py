"""Task accuracy: a user eval set scored on the candidate engine.

An eval set is YAML (``name``, ``items``) or JSONL (one item per line). Each item has a ``prompt``
(one user turn) or ``messages`` (a chat), an ``answer``, and ``match``:

- ``exact``: the stripped output equals the answer (case-insensitive);
- ``contains``: the answer appears in the output (case-insensitive);
- ``regex``: the answer is a regular expression searched in the output;
- ``choice``: the first letter/word of the output equals the answer (multiple choice, case-insensitive).

The packaged set ``basics`` holds easy questions SmolLM2-135M-Instruct mostly answers right.

Example:
    >>> from fractal_opt.evals import load_eval_set, matches
    >>> [item.match for item in load_eval_set("basics")][:1]
    ['contains']
    >>> matches("The capital is Paris.", "paris", "contains")
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..errors import RecipeError, closest
from ..validate import Problems, load_data
from ..workload import Request

if TYPE_CHECKING:
    from ..engine.protocol import Engine

__all__ = ["EvalItem", "load_eval_set", "matches", "packaged_eval_sets", "score"]

MATCH_KINDS = ("exact", "contains", "regex", "choice")


@dataclass(frozen=True)
class EvalItem:
    request: Request
    answer: str
    match: str


def packaged_eval_sets() -> list[str]:
    folder = resources.files("fractal_opt") / "data" / "evals"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_eval_set(name: str) -> list[EvalItem]:
    """Load and validate a packaged eval set by name, or a ``.yaml`` / ``.jsonl`` file."""
    where = f"quality, key 'eval': {name!r}"
    path = Path(name).expanduser()
    if path.suffix in (".yaml", ".yml", ".jsonl", ".json"):
        data: Any = load_data(path, what="quality, key 'eval': file")
    else:
        names = packaged_eval_sets()
        if name not in names:
            raise RecipeError(f"{where}: unknown eval set. Packaged sets are: {names}, or give a path to a .yaml/.jsonl file.{closest(name, names)}")
        data = yaml.safe_load((resources.files("fractal_opt") / "data" / "evals" / f"{name}.yaml").read_text(encoding="utf-8"))
    raw = data.get("items") if isinstance(data, dict) else data
    if not isinstance(raw, list) or not raw:
        raise RecipeError(f"{where}: expected a non-empty list of items.")
    found = Problems()  # every bad item of the file, not the first
    items = []
    for i, item in enumerate(raw):
        with found.collect():
            items.append(_item(item, i, where=where))
    found.raise_if_any()
    return items


def _item(item: Any, i: int, *, where: str) -> EvalItem:
    if not isinstance(item, dict) or "answer" not in item:
        raise RecipeError(f"{where}: item {i} needs 'prompt' or 'messages', and 'answer'.")
    if isinstance(item["answer"], bool) or not isinstance(item["answer"], str | int | float):
        raise RecipeError(f"{where}: item {i}: 'answer' must be a string (or a number), got {item['answer']!r}.")
    match = item.get("match", "contains")
    if match not in MATCH_KINDS:
        raise RecipeError(f"{where}: item {i}: unknown match {match!r}. Valid kinds are: {list(MATCH_KINDS)}.{closest(str(match), MATCH_KINDS)}")
    if match == "regex":
        try:
            re.compile(str(item["answer"]))
        except re.error as e:
            raise RecipeError(f"{where}: item {i}: answer {item['answer']!r} is not a valid regex: {e}.") from None
    request = Request.from_data({k: v for k, v in item.items() if k in ("id", "prompt", "messages")} | {"id": item.get("id", f"eval-{i + 1}")}, index=i, where=where)
    return EvalItem(request=request, answer=str(item["answer"]), match=match)


def matches(output: str, answer: str, match: str) -> bool:
    """Whether ``output`` answers ``answer`` under the ``match`` rule."""
    out = output.strip()
    if match == "exact":
        return out.lower().rstrip(".") == answer.strip().lower()
    if match == "contains":
        return answer.strip().lower() in out.lower()
    if match == "regex":
        return re.search(answer, out) is not None
    if match == "choice":
        first = re.match(r"\W*(\w+)", out)
        return bool(first) and first.group(1).lower() == answer.strip().lower()
    raise ValueError(f"unknown match kind {match!r}")


def score(engine: Engine, items: list[EvalItem], *, max_new_tokens: int) -> dict[str, Any]:
    """Serve every item through the engine (as its plan schedules them) and score the answers."""
    gens = engine.serve([item.request for item in items], max_new_tokens=max_new_tokens)
    passed = [matches(g.text, item.answer, item.match) for g, item in zip(gens, items)]
    return {"accuracy": round(sum(passed) / len(items), 4), "eval_passed": sum(passed), "eval_total": len(items)}
