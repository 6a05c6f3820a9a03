"""The answers side by side: what the baseline said and what the final plan says, changed ones first.

A quality number (KL, agreement, accuracy) says how far a plan moved; only the answers say whether
it moved somewhere wrong. For every prompt of the workload, and every eval question whose answer
changed, report.md, report.html and the terminal show the baseline's answer next to the final
plan's. The texts come from the trace: each step's quality holds the workload's greedy answers
(``answers``) and the eval set's (``eval_items``); the baseline's quality holds the prompts.

Example:
    >>> pairs = answer_pairs({"prompts": {"a": "Hi?"}, "answers": {"a": "Hello."}}, {"answers": {"a": "Hello."}})
    >>> [(p.kind, p.changed) for p in pairs]
    [('workload', False)]
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.text import clip
from ..measure.load import request_id
from .reader import Reader

__all__ = ["AnswerPair", "AnswersKept", "answer_pairs", "answers_html", "answers_kept", "answers_lines", "answers_text"]

_CLIP = 160  # characters of an answer shown in report.md / report.html tables (the trace has them whole)


@dataclass(frozen=True)
class AnswerPair:
    """One prompt's two answers; ``passed`` is (baseline, final) for an eval question, else None."""

    kind: str  # "workload" | "eval"
    id: str
    prompt: str
    baseline: str
    final: str
    passed: tuple[bool, bool] | None = None

    @property
    def changed(self) -> bool:
        return self.baseline.strip() != self.final.strip()


def answer_pairs(baseline: Mapping[str, Any], final: Mapping[str, Any]) -> list[AnswerPair]:
    """Workload answers (all of them) and eval answers (those that changed): eval questions whose
    verdict changed first, then changed workload answers, reworded eval answers, unchanged ones."""
    prompts = baseline.get("prompts") or {}
    base_answers, final_answers = baseline.get("answers") or {}, final.get("answers") or {}
    pairs = [AnswerPair("workload", rid, _prompt(prompts, rid), text, final_answers.get(rid, ""))
             for rid, text in base_answers.items() if rid in final_answers]
    finals = {item["id"]: item for item in final.get("eval_items") or []}
    for item in baseline.get("eval_items") or []:
        after = finals.get(item["id"])
        if after is not None and item["answer"].strip() != after["answer"].strip():
            pairs.append(AnswerPair("eval", item["id"], item.get("question", ""), item["answer"], after["answer"], (item["passed"], after["passed"])))
    return sorted(pairs, key=lambda p: (not p.changed, p.passed is None or p.passed[0] == p.passed[1], p.kind != "workload"))


def _prompt(prompts: Mapping[str, str], rid: str) -> str:
    """The prompt of answer ``rid``: under a load profile an answer's id is its load item's
    (:func:`~fractal_opt.measure.load.item_id`), the prompts are the suite requests'."""
    return prompts.get(rid) or prompts.get(request_id(rid), "")


def _verdict(p: AnswerPair) -> str:
    if p.passed is None:
        return "changed" if p.changed else "same"
    return {(True, False): "lost (was right)", (False, True): "gained (now right)"}.get(p.passed, "reworded, " + ("right" if p.passed[0] else "wrong"))


def _pairs_of(trace: Any) -> list[AnswerPair]:
    if getattr(trace, "baseline", None) is None:
        return []
    reader = Reader(trace)
    return answer_pairs(reader.baseline_quality(), reader.final_quality())


@dataclass(frozen=True)
class AnswersKept:
    """The first screen's "answers kept": the eval's questions lost and gained, and the workload's answers that differ."""

    eval_name: str | None  # the eval set that guarded the run; None without one
    passed: int | None  # the final plan's right answers
    total: int | None
    baseline_passed: int | None
    lost: int | None  # None when the final plan is the baseline (nothing to pair)
    gained: int | None
    differ: int  # workload answers that differ from the baseline's
    answers: int  # workload answers compared
    why: str = ""  # why that eval guarded the run, when the trace says

    def text(self) -> str:
        parts = []
        if self.total is not None:
            moved = f"lost {self.lost}, gained {self.gained}" if self.lost is not None else "the baseline's own answers"
            parts.append(f"eval{' ' + self.eval_name if self.eval_name else ''}: {self.passed} of {self.total} right "
                         f"(baseline {self.baseline_passed if self.baseline_passed is not None else '–'}), {moved}")
        if self.answers:
            parts.append(f"{self.differ} of {self.answers} workload answers differ from the baseline's")
        return "Answers kept: " + "; ".join(parts)


def answers_kept(reader: Reader) -> AnswersKept | None:
    """What the first screen says about the answers; None when the trace holds no eval and no answers."""
    quality, base = reader.final_quality(), reader.baseline_quality()
    work = [p for p in answer_pairs(base, quality) if p.kind == "workload"]
    if "eval_total" not in quality and not work:
        return None
    has_eval = "eval_total" in quality
    guard = reader.eval_guard()
    return AnswersKept(eval_name=guard.get("name") if has_eval else None, passed=quality.get("eval_passed"),
                       total=quality.get("eval_total") if has_eval else None, baseline_passed=base.get("eval_passed"), lost=quality.get("eval_lost"), gained=quality.get("eval_gained"),
                       differ=sum(p.changed for p in work), answers=len(work), why=str(guard.get("why") or ""))


def _summary(pairs: list[AnswerPair], quality: Mapping[str, Any]) -> str:
    work = [p for p in pairs if p.kind == "workload"]
    text = f"{sum(p.changed for p in work)} of {len(work)} workload answers differ from the baseline's"
    if "eval_total" in quality:
        text += (f"; eval: {quality.get('eval_passed')} of {quality.get('eval_total')} right "
                 f"(baseline's answers lost {quality.get('eval_lost', 0)}, gained {quality.get('eval_gained', 0)}, reworded "
                 f"{quality.get('eval_changed', 0) - quality.get('eval_lost', 0) - quality.get('eval_gained', 0)})")
    return text


def answers_lines(trace: Any) -> list[str]:
    """report.md's section: a table of prompt, baseline answer, final answer, verdict."""
    pairs = _pairs_of(trace)
    if not pairs:
        return []
    cell = lambda t: clip(t, _CLIP).replace("|", "\\|")  # noqa: E731
    out = ["", "## Answers: baseline and final plan side by side", "",
           f"Greedy answers, the changed ones first ({_summary(pairs, Reader(trace).final_quality())}).", "",
           "| prompt | baseline | final plan | |", "|---|---|---|---|"]
    out += [f"| {cell(p.prompt)} | {cell(p.baseline)} | {cell(p.final)} | {_verdict(p)} |" for p in pairs]
    return out + [""]


def answers_html(trace: Any) -> str:
    """report.html's section, the same table."""
    pairs = _pairs_of(trace)
    if not pairs:
        return ""
    esc = lambda t: html.escape(clip(t, _CLIP))  # noqa: E731
    rows = "".join(f"<tr class='{'changed' if p.changed else 'same'}'><td>{esc(p.prompt)}</td><td>{esc(p.baseline)}</td>"
                   f"<td>{esc(p.final)}</td><td>{html.escape(_verdict(p))}</td></tr>" for p in pairs)
    return ("<section id='answers'><h2>Answers: baseline and final plan side by side</h2>"
            f"<p>Greedy answers, the changed ones first ({html.escape(_summary(pairs, Reader(trace).final_quality()))}).</p>"
            "<table class='answers'><thead><tr><th>prompt</th><th>baseline</th><th>final plan</th><th></th></tr></thead>"
            f"<tbody>{rows}</tbody></table></section>")


def answers_text(trace: Any, *, limit: int = 6, width: int = 100) -> list[str]:
    """The terminal's lines: the summary and up to ``limit`` pairs, changed first."""
    pairs = _pairs_of(trace)
    if not pairs:
        return []
    out = [f"Answers ({_summary(pairs, Reader(trace).final_quality())}); report.md has them all:"]
    for p in pairs[:limit]:
        out += [f"  Q: {clip(p.prompt, width - 5)}", f"     baseline: {clip(p.baseline, width - 15)}",
                f"     final:    {clip(p.final, width - 15)}  [{_verdict(p)}]"]
    return out
