"""A step's quality numbers: model-level probes against the baseline's reference, agreement with
the baseline's greedy answers, the eval set, the recipe's custom probes.

Model-level probes (KL, flips, perplexity) are computed once per ``Plan.numerics_key()``: a pass
that cannot change next-token distributions (scheduling, decoding) reuses them. The eval set's
answers are served once per :func:`eval_key` (the plan, with the token cap as the eval sees it): a
pass that changes nothing they depend on (a ``max_new_tokens`` cap at or above
``quality.eval_max_new_tokens``) reuses them, and they are scored against the baseline's again. The
custom probes run on every scored step. A step is served the eval's required questions first (those
the baseline answered right), before the probes: when it loses more of them than the guard
``eval_required_lost`` allows, that guard trips whatever the other numbers say, so the probes and
the other questions are not run (``eval_stopped`` says so) and the step is rolled back on the
required answers alone. Agreement with the baseline's greedy answers and the
answers' text come from the step's measured outputs (:meth:`StepQuality.measured`): no model call.
The eval set and the probes are loaded when this is made, so a bad eval set or probe fails before
any model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from ..core.threads import in_own_thread
from ..engine.protocol import Engine
from ..language.recipe import Recipe
from ..measure.metrics import Measurement
from ..quality.evals import AUTO, eval_choice, fitting, load_eval_set, matches, score_answers
from ..quality.probes import agreement, build_reference, model_probes
from ..tower.passes import Layer
from ..tower.plan import Plan
from ..workloads.workload import Request

__all__ = ["StepQuality", "eval_key"]


class StepQuality:
    """Quality against the baseline for one run (its reference is scored on the baseline's engine)."""

    def __init__(self, recipe: Recipe, *, progress: Callable[[str], None]):
        self.config = recipe.quality
        self.progress = progress
        # "auto": the packaged chat set for a model with a chat template, the completion-form set for one without
        self.eval_set, self.eval_why = eval_choice(recipe.quality.eval, recipe.model, recipe.base_plan().application.chat_template)
        self.eval_items = load_eval_set(self.eval_set) if self.eval_set else []
        if recipe.quality.eval == AUTO and self.eval_items:  # a packaged set's questions that fit the model's context
            every = len(self.eval_items)
            self.eval_items = fitting(self.eval_items, recipe.model, recipe.quality.eval_max_new_tokens)
            if len(self.eval_items) < every:
                self.eval_why += f"; {len(self.eval_items)} of its {every} questions fit the model's context"
            if not self.eval_items:
                self.eval_set = None
        self.probes = recipe.quality.load_probes()
        # The most required questions a step may lose (the guard eval_required_lost's max; None: no such guard).
        self.required_max = next((g.max for g in recipe.policy.guards_for(Layer.MODEL) if g.metric == "eval_required_lost"), None)
        self.reference: Any = None  # the baseline's reference logits and outputs
        self.reference_outputs: dict[str, list[int]] | None = None  # a resumed baseline's outputs, until the reference is scored again
        self._model_probes: dict[tuple, dict[str, float]] = {}  # by Plan.numerics_key()
        self._eval_answers: dict[str, tuple[str, list[Any]]] = {}  # by eval_key(plan): the step that served them, its generations

    def score_reference(self, engine: Engine, outputs: dict[str, list[int]] | None = None) -> None:
        """Score the reference text on the baseline's ``engine`` (``outputs``: its greedy answers, when known).
        On a thread of its own, as every scoring here (:func:`~fractal_opt.core.threads.in_own_thread`):
        the step's thread outlives it, and OpenMP workers it left would slow the rounds after."""
        self.reference = in_own_thread(build_reference, engine, {}, self.config, name="fractal-opt quality")
        if outputs is not None:
            self.reference.outputs = outputs

    def needs_reference(self) -> bool:
        """Resuming: the baseline came from the journal, and its reference logits must be scored again."""
        return self.reference is None and self.reference_outputs is not None

    def score(self, engine: Engine, m: Measurement, label: str, *, requests: Sequence[Request], baseline_eval: Any = None,
              is_baseline: bool = False) -> dict[str, Any]:
        """The quality of ``engine`` (its measurement ``m``) against the baseline, scored on a
        thread of its own that ends with it (see :meth:`score_reference`)."""
        return in_own_thread(lambda: self._score(engine, m, label, requests=requests, baseline_eval=baseline_eval, is_baseline=is_baseline),
                             name="fractal-opt quality")

    def _score(self, engine: Engine, m: Measurement, label: str, *, requests: Sequence[Request], baseline_eval: Any,
               is_baseline: bool) -> dict[str, Any]:
        if not is_baseline and self.eval_items and (stopped := self._required_first(engine, label, baseline_eval)) is not None:
            return {**self.measured(engine, m), **stopped, "eval_set": self.eval_set}
        key = engine.plan.numerics_key()
        if key not in self._model_probes:
            self.progress(f"{label}: KL / perplexity on the reference text")
            self._model_probes[key] = model_probes(self.reference, engine)
        if is_baseline:  # its tokenizer decodes the answers of runtimes that keep only ids (llama.cpp: the same vocabulary)
            self._decode = _decoder(engine)
        out: dict[str, Any] = {**self._model_probes[key], **self.measured(engine, m)}
        if is_baseline:
            out["prompts"] = {r.id: r.messages[-1][1] for r in requests}
            out["eval_why"] = self.eval_why  # which eval guards the run, and why (the reports' "answers kept" line)
            out["prompt_format"] = getattr(getattr(engine, "prompt_format", None), "origin", None) or _format_origin(engine)
        if self.eval_items:
            out.update(self._eval(engine, label, baseline_eval=None if is_baseline else baseline_eval), eval_set=self.eval_set)
        out.update(self._custom(engine))
        return out

    def measured(self, engine: Engine, m: Measurement) -> dict[str, Any]:
        """What the step's measured outputs say without a model call: greedy agreement with the
        baseline's answers, and the answers as text (the side-by-side answers, report/answers.py).
        A step whose quality cannot decide its verdict records only these."""
        out = agreement(self.reference, m.outputs, cap=engine.plan.application.max_new_tokens)
        return {**out, **_answers(engine, m.outputs, getattr(self, "_decode", None))}

    def _eval(self, engine: Engine, label: str, *, baseline_eval: Any) -> dict[str, Any]:
        """The eval set's score: its answers served by ``engine``, or those of an earlier plan that
        gives the same ones (:func:`eval_key`), scored against the baseline's either way."""
        budget = self.config.eval_max_new_tokens
        key = eval_key(engine.plan, budget)
        if (earlier := self._eval_answers.get(key)) is not None:
            first, gens = earlier
            self.progress(f"{label}: eval set: reused from {first} (this pass changes nothing the eval depends on)")
            return {**score_answers(self.eval_items, gens, baseline=baseline_eval), "eval_reused_from": first}
        self.progress(f"{label}: eval set ({len(self.eval_items)} questions)")
        gens = engine.serve([item.request for item in self.eval_items], max_new_tokens=budget)
        self._eval_answers[key] = (label, gens)
        return score_answers(self.eval_items, gens, baseline=baseline_eval)

    def _required_first(self, engine: Engine, label: str, baseline_eval: Any) -> dict[str, Any] | None:
        """Serve the required questions the baseline answered right before the rest; when the step
        loses more than ``required_max`` of them, the guard trips whatever the others answer: the
        partial score (the required questions' numbers, ``eval_stopped``). None: the whole set is
        served as usual (in one call, so batching meets the questions as it always does)."""
        if self.required_max is None or baseline_eval is None or len(baseline_eval) != len(self.eval_items):
            return None
        if eval_key(engine.plan, self.config.eval_max_new_tokens) in self._eval_answers:
            return None  # the whole set's answers are known already: scored as they are
        required = [(item, b) for item, b in zip(self.eval_items, baseline_eval, strict=True) if item.required and b["passed"]]
        if not required:
            return None
        self.progress(f"{label}: eval set, its {len(required)} required question(s) first")
        gens = engine.serve([item.request for item, _ in required], max_new_tokens=self.config.eval_max_new_tokens)
        lost = [item.request.id for (item, _), g in zip(required, gens, strict=True) if not matches(g.text, item.answer, item.match)]
        if len(lost) <= self.required_max:
            return None
        rest = len(self.eval_items) - len(required)
        return {"eval_required_lost": len(lost), "eval_required_lost_ids": lost,
                "eval_required_answers": {item.request.id: g.text for (item, _), g in zip(required, gens, strict=True)},
                "eval_stopped": (f"after its {len(required)} required question(s): {', '.join(lost)} answered wrong (the baseline right), "
                                 f"so the guard eval_required_lost max {self.required_max:g} trips whatever the other {rest} answer; "
                                 "they and the KL / perplexity probes were not run")}

    def _custom(self, engine: Engine) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, probe in self.probes.items():
            try:
                values = probe(engine)
            except (Exception, SystemExit) as e:  # named here: the traceback alone points at the user's module
                code = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
                raise RuntimeError(f"custom probe {name!r} {code}") from e
            if not isinstance(values, dict):
                raise TypeError(f"custom probe {name!r} must return a dict of named numbers, got {type(values).__name__}")
            out.update({f"{name}.{k}": float(v) for k, v in values.items()})
        return out


def eval_key(plan: Plan, budget: int) -> str:
    """What the eval set's answers depend on: the whole plan but the passes' names (``applied``),
    its token cap as the eval meets it (``min(cap, budget)``: the eval asks for ``budget`` tokens,
    :meth:`Engine.budget` caps them by the plan), so a cap at or above the eval's budget gives the
    same answers as no cap."""
    data = plan.to_dict()
    data.pop("applied")
    cap = plan.application.max_new_tokens
    data["application"]["max_new_tokens"] = min(cap, budget) if cap else budget
    return json.dumps(data, sort_keys=True, default=str)


def _format_origin(engine: Engine) -> str | None:
    """How the baseline's prompts are rendered (weights/prompts.py), where its engine says."""
    from ..weights.prompts import prompt_format

    tokenizer = getattr(engine, "tokenizer", None)
    return prompt_format(tokenizer, engine.plan.application.chat_template).origin if tokenizer is not None else None


def _decoder(engine: Engine) -> Any:
    """The baseline's own detokenizer, kept past the engine's close (None when it has none to lend)."""
    tokenizer = getattr(engine, "tokenizer", None)
    return (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None


def _answers(engine: Engine, outputs: dict[str, list[int]], fallback: Any = None) -> dict[str, Any]:
    """The workload's greedy answers as text, for the reports: the engine's decode, else the
    baseline's tokenizer; none when neither can."""
    try:
        return {"answers": {rid: engine.decode(ids) for rid, ids in outputs.items()}}
    except NotImplementedError:
        if fallback is None:
            return {}
        return {"answers": {rid: fallback(ids).strip() for rid, ids in outputs.items()}}
