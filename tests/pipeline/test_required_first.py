"""The eval's required questions first: a step that loses one is rolled back without the rest of
the quality gate (the probes and the other questions), and one that keeps them is scored in full."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import fractal_opt
from fractal_opt.language.guards import Evidence
from fractal_opt.language.policy import Policy
from fractal_opt.pipeline import step_quality
from fractal_opt.pipeline.step_quality import StepQuality
from fractal_opt.tower.passes import Layer
from fractal_opt.tower.plan import Plan


class _Answering:
    """An engine stand-in: answers each question from a table (the right answer unless told), and
    keeps the ids of every ``serve`` call."""

    def __init__(self, items, wrong=(), dtype="float32"):
        self.plan = Plan(source="fake").replace_section("hardware", dtype=dtype)  # the eval's answers are kept per plan
        self.texts = {i.request.id: ("no idea" if i.request.id in wrong else i.answer) for i in items}
        self.calls: list[list[str]] = []

    def serve(self, requests, *, max_new_tokens):
        self.calls.append([r.id for r in requests])
        return [SimpleNamespace(text=self.texts[r.id]) for r in requests]


@pytest.fixture
def quality(monkeypatch):
    """A StepQuality on the packaged chat set, its probes and free numbers counted, not computed."""
    recipe = fractal_opt.load_recipe({"model": "x/y", "quality": {"eval": "basics"}}, check_model=False)
    q = StepQuality(recipe, progress=lambda _: None)
    probed: list[str] = []
    monkeypatch.setattr(step_quality, "model_probes", lambda reference, engine: probed.append("kl") or {"kl_mean": 0.001})
    monkeypatch.setattr(StepQuality, "measured", lambda self, engine, m: {"agreement": 1.0})
    q.probed = probed
    return q


def _baseline(q):
    right = _Answering(q.eval_items)
    return q._eval(right, "baseline", baseline_eval=None)["eval_items"]


def test_a_lost_required_question_ends_the_quality_gate_there(quality):
    """The README's question answered wrong: only the required questions were served, no probe ran,
    and the default guard trips on the one question, naming it."""
    base = _baseline(quality)
    engine = _Answering(quality.eval_items, wrong={"readme-france"}, dtype="bfloat16")
    out = quality.score(engine, None, "step", requests=[], baseline_eval=base)
    required = [i.request.id for i in quality.eval_items if i.required]
    assert engine.calls == [required] and quality.probed == []
    assert out["eval_required_lost"] == 1 and out["eval_required_lost_ids"] == ["readme-france"]
    assert out["eval_required_answers"] == {"readme-france": "no idea"}  # what it answered, for the trace's reader
    assert "accuracy" not in out and f"the other {len(quality.eval_items) - len(required)} answer" in out["eval_stopped"]
    [guard] = [g for g in Policy().guards_for(Layer.MODEL) if g.metric == "eval_required_lost"]
    assert "readme-france answered wrong" in guard.check(Evidence(after=out)).trips[0]


def test_required_questions_kept_the_whole_gate_runs(quality):
    """Another question lost, the required ones kept: the probes run and the whole set is served in
    one call after the required ones, and scored as before (lost 1, none required)."""
    base = _baseline(quality)
    other = next(i.request.id for i in quality.eval_items if not i.required)
    engine = _Answering(quality.eval_items, wrong={other}, dtype="bfloat16")
    out = quality.score(engine, None, "step", requests=[], baseline_eval=base)
    assert len(engine.calls) == 2 and engine.calls[1] == [i.request.id for i in quality.eval_items]
    assert quality.probed == ["kl"] and out["eval_lost"] == 1 and out["eval_required_lost"] == 0 and "eval_stopped" not in out


def test_without_the_guard_the_required_questions_are_not_served_apart(monkeypatch):
    """A recipe that removes the guard (eval_required_lost: null): the set is served once, whole."""
    recipe = fractal_opt.load_recipe({"model": "x/y", "quality": {"eval": "basics"}, "policy": {"guards": {"eval_required_lost": None}}},
                                     check_model=False)
    q = StepQuality(recipe, progress=lambda _: None)
    monkeypatch.setattr(step_quality, "model_probes", lambda reference, engine: {})
    monkeypatch.setattr(StepQuality, "measured", lambda self, engine, m: {})
    base = _baseline(q)
    engine = _Answering(q.eval_items, wrong={"readme-france"}, dtype="bfloat16")
    out = q.score(engine, None, "step", requests=[], baseline_eval=base)
    assert q.required_max is None and len(engine.calls) == 1 and out["eval_required_lost"] == 1


def test_the_gate_runs_on_a_thread_that_ends(quality, monkeypatch):
    """The probes and the eval run on a thread of their own that has ended when the score returns:
    torch's OpenMP workers left on the step's thread, which lives on, would throttle every round
    after (docs/runtimes.md, "torch shares that OpenMP runtime")."""
    import threading

    ran_on: list[threading.Thread] = []
    monkeypatch.setattr(step_quality, "model_probes", lambda reference, engine: ran_on.append(threading.current_thread()) or {})
    base = _baseline(quality)
    quality.score(_Answering(quality.eval_items, dtype="bfloat16"), None, "step", requests=[], baseline_eval=base)
    assert ran_on and ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()
