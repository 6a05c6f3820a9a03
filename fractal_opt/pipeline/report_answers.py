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

__all__ = ["AnswerPair", "answer_pairs", "answers_html", "answers_lines", "answers_text", "final_quality"]

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


def final_quality(trace: Any) -> Mapping[str, Any]:
    """The quality numbers of the final plan: the kept step's (``trace.final``), else the baseline's."""
    metrics = (getattr(trace, "final", None) or {}).get("metrics") or {}
    if metrics.get("quality"):
        return metrics["quality"]
    return (trace.baseline.metrics.get("quality") or {}) if getattr(trace, "baseline", None) else {}


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
    return answer_pairs(trace.baseline.metrics.get("quality") or {}, final_quality(trace))


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
           f"Greedy answers, the changed ones first ({_summary(pairs, final_quality(trace))}).", "",
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
            f"<p>Greedy answers, the changed ones first ({html.escape(_summary(pairs, final_quality(trace)))}).</p>"
            "<table class='answers'><thead><tr><th>prompt</th><th>baseline</th><th>final plan</th><th></th></tr></thead>"
            f"<tbody>{rows}</tbody></table></section>")


def answers_text(trace: Any, *, limit: int = 6, width: int = 100) -> list[str]:
    """The terminal's lines: the summary and up to ``limit`` pairs, changed first."""
    pairs = _pairs_of(trace)
    if not pairs:
        return []
    out = [f"Answers ({_summary(pairs, final_quality(trace))}); report.md has them all:"]
    for p in pairs[:limit]:
        out += [f"  Q: {clip(p.prompt, width - 5)}", f"     baseline: {clip(p.baseline, width - 15)}",
                f"     final:    {clip(p.final, width - 15)}  [{_verdict(p)}]"]
    return out
