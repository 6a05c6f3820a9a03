"""The answers side by side: every workload prompt, the eval questions that changed, changed first, in every report."""

from __future__ import annotations

from types import SimpleNamespace

from fractal_opt.report.answers import answer_pairs, answers_html, answers_lines, answers_text

BASE = {
    "prompts": {"w1": "What is the capital of France?", "w2": "Say hi."},
    "answers": {"w1": "The capital of France is Paris.", "w2": "Hi!"},
    "eval_items": [{"id": "e1", "question": "2+2?", "answer": "4", "passed": True},
                   {"id": "e2", "question": "Sky colour?", "answer": "Blue.", "passed": True},
                   {"id": "e3", "question": "Largest ocean?", "answer": "Pacific", "passed": True}],
}
FINAL = {
    "answers": {"w1": "L'Étoile, la Marseillaise, la femme", "w2": "Hi!"},
    "eval_items": [{"id": "e1", "question": "2+2?", "answer": "4", "passed": True},
                   {"id": "e2", "question": "Sky colour?", "answer": "Green.", "passed": False},
                   {"id": "e3", "question": "Largest ocean?", "answer": "The Pacific", "passed": True}],
    "eval_passed": 2, "eval_total": 3, "eval_lost": 1, "eval_gained": 0, "eval_changed": 2,
}


def _trace():
    baseline = SimpleNamespace(metrics={"quality": BASE})
    return SimpleNamespace(recipe={}, baseline=baseline, final={"metrics": {"quality": FINAL}})


def test_changed_answers_come_first_and_unchanged_eval_answers_are_left_out():
    """Order: the lost eval answer, the changed workload answer, the reworded eval answer, the unchanged workload answer; e1 is left out."""
    pairs = answer_pairs(BASE, FINAL)
    assert [(p.kind, p.id) for p in pairs] == [("eval", "e2"), ("workload", "w1"), ("eval", "e3"), ("workload", "w2")]
    assert pairs[0].passed == (True, False) and not pairs[3].changed


def test_report_md_html_and_terminal_show_both_answers():
    """report.md, report.html and the terminal each show the baseline's and the final plan's answer to the README question."""
    md, page, text = "\n".join(answers_lines(_trace())), answers_html(_trace()), "\n".join(answers_text(_trace()))
    for out in (md, page, text):
        assert "The capital of France is Paris." in out and "la Marseillaise" in out
    assert "lost (was right)" in md and "1 of 2 workload answers differ" in md and "lost 1, gained 0, reworded 1" in md
    assert "L&#x27;Étoile" in page  # escaped in HTML


def test_no_baseline_no_section():
    """A trace without a baseline (a run that failed early) has no answers section."""
    empty = SimpleNamespace(recipe={}, baseline=None, final={})
    assert answers_lines(empty) == [] and answers_html(empty) == ""


def test_answers_served_under_a_load_profile_show_their_suite_prompt():
    """Under a load profile an answer's id is its load item's (``short-1#0``): the side-by-side row still shows the suite's prompt."""
    base = {"prompts": {"short-1": "What is photosynthesis?"}, "answers": {"short-1#0": "A process."}}
    pairs = answer_pairs(base, {"answers": {"short-1#0": "A plant process."}})
    assert [p.prompt for p in pairs] == ["What is photosynthesis?"]
