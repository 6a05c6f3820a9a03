"""The ``search`` pass: a layer's candidates generated, screened, then judged, within the time budget.

A recipe writes ``search`` (or ``{search: {...}}``) in a layer's list; the layer's search
proposes one candidate at a time (:meth:`Search.next_step`) from what the runtimes, the model, the
machine and the load offer the kept plan now (:func:`.candidates.generate`), most promising first
by the roofline's prediction. The runner measures each like any step, one change at a time against
the last kept plan: a kept candidate changes the plan, and the next candidates are generated for
the new one (on llama.cpp its own knobs; after BF16 weights the ladder below them). Each candidate
first gets a short paired screen (:meth:`Search.screens`, :mod:`fractal_opt.measure.screen`), and
only one whose screen interval can still beat the kept plan by ``min_effect`` gets the full rounds
and the quality gate.

The time budget (``workload.budget_s``, ``run --budget``): the runner says how much of it this
search may spend (:class:`~fractal_opt.tower.passes.SearchContext`), and the search proposes a
candidate only while the time a candidate has taken so far fits in what is left; the trace's
answer names what it did not try.

Example:
    >>> from fractal_opt.tower.passes import Layer
    >>> search_for(Layer.MODEL)(screen=False).describe()
    'search(screen=False)'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.errors import RecipeError, closest
from ..layers import passes_by_layer
from ..tower.passes import Layer, Pass, SearchContext, StepResult
from ..tower.plan import Plan
from .candidates import Candidate, generate, plan_weight_bits, source_bits, weight_type

__all__ = ["SEARCHES", "HardwareSearch", "ModelSearch", "SchedulingSearch", "Search", "search_for"]

# A candidate the roofline predicts slower than the kept plan by more than this share is not tried
# (switching back to float32 from BF16 weights, say): its bytes alone cost more than min_effect.
SLOWER = 0.95
# What a candidate is guessed to cost before one of its kind has been measured in this run
# (seconds): only the budget's check reads it. A screen of a llama.cpp knob took about 10 s on the
# embedded model here and a judged step 57-76 s (2-core Intel Xeon, 2026-12-05): the guess lets the
# first screen in and a first judged step only where half a minute is left.
FIRST_GUESS_S = 30.0


@dataclass(frozen=True, kw_only=True)
class Search(Pass):
    """Try what the runtimes, the model, the machine and the load offer this layer, most promising first.

    ``screen``: each candidate first gets one short paired round against the kept plan, and only
    a candidate whose screen interval can still beat it by min_effect gets the full rounds and the
    quality gate (false: every candidate judged in full, as benchmarks/search.py compares).
    ``only``: the passes to draw candidates from (empty: all), e.g. ``[runtime, quantize]``.
    ``max_candidates``: at most this many candidates measured.
    """

    name: ClassVar[str] = "search"
    layer: ClassVar[Layer]

    screen: bool = True
    only: tuple[str, ...] = ()
    max_candidates: int = 16

    def __post_init__(self) -> None:
        if self.max_candidates < 1:
            raise RecipeError(f"pass 'search', parameter 'max_candidates': got {self.max_candidates}, expected an integer >= 1.")
        mine = sorted(cls.name for cls in passes_by_layer()[self.layer])
        for name in self.only:
            if name not in mine:
                raise RecipeError(f"pass 'search' under {self.layer.section}, parameter 'only': {name!r} is not a pass of this layer; "
                                  f"its passes are {mine}.{closest(name, mine)}")

    def apply(self, plan: Plan) -> Plan:
        return plan  # never applied itself: its steps are the candidates it proposes

    def screens(self) -> bool:
        return self.screen

    def candidates(self, context: SearchContext, history: Sequence[StepResult] = ()) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
        """The candidates still open on ``context``'s kept plan, and those left out with why.

        Left out: a candidate tried already, one the gate would skip, one the roofline predicts
        slower, one with the same weights as a plan whose answers a quality guard refused. The
        weight ladder is walked down one rung at a time, as an expert and fituna do ("8 bits first,
        then 4"): of the candidates that move the weights to fewer bits a weight (a runtime on a
        16-bit copy, the GGUF's own type, a gguf quantization), only those with the most bits are
        open, and once a rung's answers trip a quality guard, the rungs below it on that runtime
        are not tried.
        """
        tried = {r.step for r in history}
        refusals = _refusals(context, history)
        generated = [c for c in generate(self.layer, context) if c.p not in tried and (not self.only or c.p.name in self.only)]
        viable, left = [], []
        for c in generated:
            why = self._left_out(c, context, history, refusals)
            (left.append((c, why)) if why is not None else viable.append(c))
        open_ = []
        for c in viable:
            above = [x for x in viable if x.rung and x.bits > c.bits]
            if c.rung and above:
                left.append((c, f"the weight ladder is walked down one rung at a time: after {min(above, key=lambda x: x.bits).p.describe()}"))
            else:
                open_.append(c)
        return open_, left

    def _left_out(self, c: Candidate, context: SearchContext, history: Sequence[StepResult], refusals: Sequence[tuple[str, Plan, tuple[str, ...]]]) -> str | None:
        """Why candidate ``c`` is not tried at all on the kept plan now, or None (see :meth:`candidates`)."""
        plan = context.plan
        after = c.p.apply(plan)
        # A refused plan that computes what the kept plan computes was refused for something else
        # (a scheduling step's batched answers, say): its numbers are not the reason, so they rule nothing out.
        if same := next((r for r in refusals if _same_answers(after, r[1]) and not _same_answers(plan, r[1])), None):
            return (f"the same weights in the same types as {same[0]}, whose answers tripped {', '.join(same[2])}: "
                    "another build of the runtime rounds alike up to the order of its sums, so it is not judged again")
        if c.rung:
            own = source_bits(plan.source)
            for label, refused, tripped in refusals:
                if refused.hardware.runtime == after.hardware.runtime and plan_weight_bits(refused, own, context) > c.bits:
                    return f"below {label} on the weight ladder ({c.bits:g} bits a weight), whose answers tripped {', '.join(tripped)}: fewer bits are not tried"
        if any(r.status == "kept" and r.step.name == "runtime" for r in history) and c.p.name == "runtime" and after.hardware.runtime != plan.hardware.runtime:
            return f"the search moved to {plan.hardware.runtime} because it beat the runtime before it"
        if c.predicted < SLOWER:
            return f"the roofline predicts it {c.predicted:.2f}x the kept plan's decode"
        if context.skip is not None and (why := context.skip(c.p, plan)) is not None:
            return why.removeprefix("check: ")
        return None

    def next_step(self, history: Sequence[StepResult], *, context: SearchContext | None = None) -> Pass | None:
        """The most promising open candidate whose expected time fits in the budget left, while fewer
        than ``max_candidates`` were measured (None: done)."""
        if context is None or len(history) >= self.max_candidates:
            return None
        open_, _ = self.candidates(context, history)
        # The most promising candidate that fits what is left: a screen may fit where a full judgement does not.
        return next((c.p for c in open_ if _fits(context, self.screen, c)), None)

    def conclusion(self, history: Sequence[StepResult], *, guards: Sequence[Any] = (), context: SearchContext | None = None) -> dict[str, Any]:
        """What the search tried and found: every candidate's status, the kept ones, and what it
        did not try (with why: the budget, max_candidates, a skip, the roofline)."""
        counts = {s: sum(r.status == s for r in history) for s in ("screened_out", "kept", "rolled_back", "failed", "skipped", "unchanged")}
        considered = counts["screened_out"] + counts["kept"] + counts["rolled_back"]
        kept = [r.step.describe() for r in history if r.status == "kept"]
        not_tried: list[dict[str, str]] = []
        if context is not None:
            open_, left = self.candidates(context, history)
            stop = "max_candidates reached" if len(history) >= self.max_candidates else "the time budget left no room for it"
            not_tried = [{"pass": c.p.describe(), "why": stop} for c in open_] + [{"pass": c.p.describe(), "why": why} for c, why in left]
        answer = (f"{considered} candidates considered ({counts['screened_out']} screened out, {counts['kept'] + counts['rolled_back']} judged in full, "
                  f"{counts['kept']} kept): " + (", ".join(kept) if kept else "none kept"))
        rungs = [r for r in history if r.status == "rolled_back" and r.plan and context is not None and _fewer_bits(r, context)]
        if context is not None:
            answer += f"; weights: {weight_type(context.plan)}"
            answer += "".join(f"; {r.step.describe()} (fewer bits) rolled back by {', '.join(r.quality_tripped) or r.outcome}" for r in rungs)
        budget_left = [t["pass"] for t in not_tried if t["why"] in ("the time budget left no room for it", "max_candidates reached")]
        if budget_left:
            answer += f"; not tried ({not_tried[0]['why']}): " + ", ".join(budget_left)
        return {"pass": self.name, "layer": self.layer.section, "answer": answer, "considered": considered, **counts,
                "candidates": [{"pass": r.step.describe(), "status": r.status, "outcome": r.outcome, "reason": r.reason} for r in history],
                "not_tried": not_tried, "summary": _summary(history)}


def _fewer_bits(r: StepResult, context: SearchContext) -> bool:
    """Whether step ``r`` measured weights with fewer bits a weight than the kept plan's now (a faster type)."""
    own = source_bits(context.plan.source)
    return plan_weight_bits(Plan.from_dict(r.plan), own, context) < plan_weight_bits(context.plan, own, context)


def _refusals(context: SearchContext, history: Sequence[StepResult]) -> list[tuple[str, Plan, tuple[str, ...]]]:
    """The plans whose answers a quality guard refused in this run (the context's, every layer's
    search and pass) and in this search's history: (label, plan, the quality guards that tripped)."""
    out = [(label, Plan.from_dict(plan), tuple(tripped)) for label, plan, tripped in context.refused]
    out += [(r.step.describe(), Plan.from_dict(r.plan), r.quality_tripped) for r in history if r.quality_tripped and r.plan]
    return out


def _same_answers(a: Plan, b: Plan) -> bool:
    """Whether two plans compute the same next-token distributions up to a runtime's build: the
    same weights in the same types on the same runtime (``numerics_key``), whichever executable
    (``runtime_path``) serves them."""
    def bare(plan: Plan) -> Plan:
        return plan.replace_section("hardware", runtime_path=None, runtime_url=None)

    return bare(a).numerics_key() == bare(b).numerics_key()


def _fits(context: SearchContext, screen: bool, candidate: Candidate) -> bool:
    """Whether ``candidate`` fits in the budget left: its expected time is a screened candidate's
    when it is screened and the roofline predicts no gain (most such stop at the screen), else a
    fully judged one's (one predicted faster will pass its screen)."""
    if context.remaining_s is None:
        return True
    steps = context.step_s or {}
    stops = screen and candidate.predicted <= 1.0
    expected = (steps.get("screened_out") or FIRST_GUESS_S) if stops else (steps.get("judged") or FIRST_GUESS_S)
    return context.remaining_s >= expected


def _summary(history: Sequence[StepResult]) -> str:
    """``runtime(...) rolled back (guard); quantize(...) screened out; ...``."""
    words = {"screened_out": "screened out", "rolled_back": "rolled back", "unchanged": "changes nothing"}
    return "; ".join(f"{r.step.describe()} {words.get(r.status, r.status)}" + (f" ({r.outcome})" if r.outcome and r.status == "rolled_back" else "")
                     for r in history) or "no candidate"


@dataclass(frozen=True, kw_only=True)
class HardwareSearch(Search):
    """The hardware layer's search: runtimes, their builds and knobs, threads, bfloat16."""

    layer = Layer.HARDWARE


@dataclass(frozen=True, kw_only=True)
class ModelSearch(Search):
    """The model layer's search: the weight ladder on a GGUF runtime, the runtime's KV and weight knobs."""

    layer = Layer.MODEL


@dataclass(frozen=True, kw_only=True)
class SchedulingSearch(Search):
    """The scheduling layer's search: continuous batching and slots sized from the load."""

    layer = Layer.SCHEDULING


SEARCHES: dict[Layer, type[Search]] = {Layer.HARDWARE: HardwareSearch, Layer.MODEL: ModelSearch, Layer.SCHEDULING: SchedulingSearch}


def search_for(layer: Layer) -> type[Search]:
    """The ``search`` pass of ``layer`` (one class a layer, since a pass's layer is its class's).

    Raises:
        RecipeError: a layer whose candidates are not generated (application).
    """
    if layer not in SEARCHES:
        valid = [x.section for x in SEARCHES]
        raise RecipeError(f"pass 'search' generates candidates for the layers {valid}, not {layer.section!r}: list that layer's passes by hand.")
    return SEARCHES[layer]

