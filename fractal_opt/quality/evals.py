"""Task accuracy: a user eval set scored on the candidate engine.

An eval set is YAML (``name``, ``items``) or JSONL (one item per line). Each item has a ``prompt``
(one user turn) or ``messages`` (a chat), an ``answer``, and ``match``:

- ``exact``: the stripped output equals the answer (case-insensitive);
- ``contains``: the answer appears in the output (case-insensitive);
- ``regex``: the answer is a regular expression searched in the output;
- ``choice``: the first letter/word of the output equals the answer (multiple choice, case-insensitive).

An item may say ``required: true``: a question that must stay right (the README's example in the
packaged sets). A plan that loses one the baseline got right is rolled back whatever the sign test
says (the default guard ``eval_required_lost: {max: 0}``): a lost README answer is a defect a user
sees, however few other questions changed.

The packaged set ``basics`` (45 short factual, instruction and reading questions, the README's
example first) is the default for a model with a chat template (``quality.eval: auto``; the
embedded model's float32 baseline answers 35 of 45, benchmarks/quality_gate.py prints it), and
``basics-completion`` (the same knowledge as texts to continue) the default for a model without
one (:func:`eval_choice`).

Example:
    >>> from fractal_opt.evals import load_eval_set, matches
    >>> [item.match for item in load_eval_set("basics")][:1]
    ['contains']
    >>> matches("The capital is Paris.", "paris", "contains")
    True
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..core.errors import RecipeError, closest
from ..core.validate import load_data, parse_each
from ..workloads.workload import Request

if TYPE_CHECKING:
    from ..engine.protocol import Engine, Generation

__all__ = ["AUTO", "CHAT_SET", "COMPLETION_SET", "EvalItem", "eval_choice", "eval_set_name", "fitting", "load_eval_set", "matches", "packaged_eval_sets", "score", "score_answers", "sign_test_worse", "wilson"]

MATCH_KINDS = ("exact", "contains", "regex", "choice")
AUTO = "auto"  # quality.eval's default: see eval_set_name


@dataclass(frozen=True)
class EvalItem:
    request: Request
    answer: str
    match: str
    required: bool = False  # a question that must stay right: a plan that loses it is rolled back whatever the sign test says


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
    items = parse_each(raw, lambda item, i: _item(item, i, where=where))
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
    required = item.get("required", False)
    if not isinstance(required, bool):
        raise RecipeError(f"{where}: item {i}: 'required' must be true or false, got {required!r}.")
    request = Request.from_data({k: v for k, v in item.items() if k in ("id", "prompt", "messages")} | {"id": item.get("id", f"eval-{i + 1}")}, index=i, where=where)
    return EvalItem(request=request, answer=str(item["answer"]), match=match, required=required)


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


CHAT_SET, COMPLETION_SET = "basics", "basics-completion"


def eval_set_name(eval_field: str | None, model: str, chat_template: str | None = None) -> str | None:
    """The eval set a recipe's ``quality.eval`` names (:func:`eval_choice` says why)."""
    return eval_choice(eval_field, model, chat_template)[0]


def eval_choice(eval_field: str | None, model: str, chat_template: str | None = None) -> tuple[str | None, str]:
    """(the eval set, why it guards the run) for ``quality.eval``. ``"auto"`` (the default) picks a
    packaged set for every model by the form its prompts take (``chat_template``: the plan's
    ``application.chat_template``): the chat set ``basics`` for a model with a chat template,
    ``basics-completion`` for one without (a base model, served plain text). Each is judged paired
    against that model's own baseline (questions lost against gained), so it guards any model
    that answers them; its absolute accuracy is reported, not guarded."""
    if eval_field != AUTO:
        return eval_field, ("the recipe's quality.eval" if eval_field else "none: the recipe's quality.eval is null")
    from ..weights.models import resolve
    from ..weights.prompts import NO_TEMPLATE, has_chat_template

    try:
        chat = chat_template != NO_TEMPLATE and (chat_template is not None or has_chat_template(resolve(model)))
    except Exception:  # noqa: BLE001 (a model that cannot be read: its own check names why; the common form stands)
        chat = True
    if chat:
        return CHAT_SET, f"quality.eval auto: the packaged chat set {CHAT_SET!r}, as the model's prompts go through a chat template"
    return COMPLETION_SET, f"quality.eval auto: the packaged completion-form set {COMPLETION_SET!r}, as the model has no chat template (its prompts are plain text)"


def fitting(items: list[EvalItem], model: str, max_new_tokens: int) -> list[EvalItem]:
    """The items whose prompt plus ``max_new_tokens`` fits the model's positions, counted from its
    files without loading it (the tokenizer's exact count, or a GGUF's lower bound). ``auto``
    uses it: a packaged set's long reading questions do not fit a model with a short context,
    and a recipe that asked for no eval set must not be refused for them."""
    from ..weights import models

    try:
        source = models.resolve(model)
        limit = models.positions(source)
        counter = models.token_counter(source) if limit else None
    except Exception:  # noqa: BLE001 (a model that cannot be read: its own check says why)
        return items
    if counter is None or limit is None:
        return items
    count = counter[0]
    return [item for item in items if sum(count(content) for _, content in item.request.messages) + max_new_tokens <= limit]


def score(engine: Engine, items: list[EvalItem], *, max_new_tokens: int, baseline: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Serve every item through the engine (as its plan schedules them) and score the answers.

    Returns ``accuracy`` with its 95% Wilson interval (``accuracy_low`` / ``accuracy_high``), the
    counts, and ``eval_items`` (per item: id, the answer given, passed). Given the baseline's
    ``eval_items``, also the paired comparison: ``eval_lost`` (items the baseline answered right
    and this engine wrong), ``eval_gained`` (the reverse), ``eval_changed`` (items whose answer
    text differs) and ``eval_worse_p``, the one-sided sign-test p-value that this engine answers
    fewer items right than the baseline (:func:`sign_test_worse`): the accuracy guard's notion of
    "worse beyond noise".
    """
    return score_answers(items, engine.serve([item.request for item in items], max_new_tokens=max_new_tokens), baseline=baseline)


def score_answers(items: list[EvalItem], gens: Sequence[Generation], *, baseline: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """:func:`score` of answers already served (``gens``, one per item, in order): a plan whose
    answers are known to be another's is scored without serving them again."""
    passed = [matches(g.text, item.answer, item.match) for g, item in zip(gens, items, strict=True)]
    low, high = wilson(sum(passed), len(items))
    out: dict[str, Any] = {"accuracy": round(sum(passed) / len(items), 4), "accuracy_low": low, "accuracy_high": high,
                           "eval_passed": sum(passed), "eval_total": len(items),
                           "eval_items": [{"id": item.request.id, "question": item.request.messages[-1][1], "answer": g.text, "passed": ok} for item, g, ok in zip(items, gens, passed, strict=True)]}
    if baseline is not None and len(baseline) == len(items):
        lost = sum(1 for b, ok in zip(baseline, passed, strict=True) if b["passed"] and not ok)
        gained = sum(1 for b, ok in zip(baseline, passed, strict=True) if ok and not b["passed"])
        changed = sum(1 for b, g in zip(baseline, gens, strict=True) if b["answer"].strip() != g.text.strip())
        out.update(eval_lost=lost, eval_gained=gained, eval_changed=changed, eval_worse_p=sign_test_worse(lost, gained))
        lost_required = [item.request.id for item, b, ok in zip(items, baseline, passed, strict=True) if item.required and b["passed"] and not ok]
        out.update(eval_required_lost=len(lost_required), eval_required_lost_ids=lost_required)
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a share ``k / n`` (sound at 0 and n, unlike k/n +- 2 s.e.)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)


def sign_test_worse(lost: int, gained: int) -> float:
    """One-sided exact sign test on the items that changed verdict: the chance of at least ``lost``
    losses among ``lost + gained`` changes if losing and gaining were equally likely (McNemar's
    exact test). 1.0 when nothing changed. Small means the step answers fewer right beyond noise."""
    n = lost + gained
    if n == 0:
        return 1.0
    return round(sum(math.comb(n, i) for i in range(lost, n + 1)) / 2**n, 4)
