"""report.html's first screen: the answer to the recipe's question (:mod:`.first_screen`) as cards.

One card per figure, grouped by the load it was measured at (one user, one request at a time;
then the offered load), then the cost and the answers kept. A card shows the baseline's and the
final plan's medians, the change (a ratio when large) with its interval when that bounds it, the
status, the objective it answers, and under it what a later step traded it for. Every number is
tied to its place in trace.json (``data-step="final"``, ``data-metric``: the confirmation's entry),
and every card names what it answers (``data-answer``: ``decode_tokens_per_s@1``, the metric at
that many clients; ``answers-kept``), so a browser test can find it on the first screen.
"""

from __future__ import annotations

from .figures import Figure, uses_ratio, change_text, name_of
from .answers import AnswersKept
from .first_screen import Item, first_screen
from .svg import data_attrs, esc, fmt_num, is_num
from .trace import Trace

__all__ = ["CSS", "answer_section"]

CSS = """
.fo-report #answer .lead { font-size: 15px; margin: 6px 0 2px; }
.fo-report #answer h3 { margin: 10px 0 0; }
.fo-report #answer .cards { margin: 6px 0; }
.fo-report #answer .card { max-width: 330px; }
.fo-report #answer .card.objective { border-color: #4c78a8; border-width: 2px; }
.fo-report #answer .card .st { font-size: 12px; font-weight: 600; }
.fo-report #answer .card .st.good { color: #2e7d32; } .fo-report #answer .card .st.bad { color: #c0392b; }
.fo-report #answer .card .trade { font-size: 11px; color: #555; margin-top: 4px; border-top: 1px dotted #ccc; padding-top: 3px; }
.fo-report #answer .card .v small { font-size: 12px; font-weight: normal; color: #555; }
"""


def answer_section(trace: Trace) -> list[str]:
    """The section's HTML pieces (the page's first section after its header)."""
    screen = first_screen(trace)
    out = ['<section id="answer">', "<h2>The answer</h2>", f'<p class="lead">{esc(_sentence(screen.title))}</p>',
           f'<p class="note">{esc(screen.kept)}.</p>', *(f"<p>{esc(s)}</p>" for s in screen.plain)]
    for group in screen.groups:
        out.append(f'<h3>{esc(group.title)}</h3><div class="cards">{"".join(_cards(group.lines))}</div>')
    tail = _cards(screen.cost.lines) if screen.cost else []
    tail += [_answers_card(screen.answers)] if screen.answers else []
    if tail:
        title = screen.cost.title if screen.cost else ""
        title = (f"{title}, and the answers kept" if screen.answers else title) if title else "The answers kept"
        out.append(f'<h3>{esc(title)}</h3><div class="cards">{"".join(tail)}</div>')
    return [*out, "</section>"]


def _cards(lines: tuple) -> list[str]:
    """One card per figure; a line's notes (what a later step traded it for) go under its last card."""
    return [_card(item, notes=line.notes if n == len(line.items) - 1 else ()) for line in lines for n, item in enumerate(line.items)]


def _answers_card(answers: AnswersKept) -> str:
    """The eval's questions lost and gained against the baseline, and the workload answers that differ."""
    rows = []
    if answers.total is not None:
        moved = f"lost {answers.lost}, gained {answers.gained}" if answers.lost is not None else "the baseline's own answers"
        right = f"{answers.passed} of {answers.total} right (baseline {answers.baseline_passed})"
        rows += [f'<div class="v">{esc(moved)}</div>', f'<div class="k">{esc(right)}</div>']
    if answers.answers:
        rows.append(f'<div class="k">{answers.differ} of {answers.answers} workload answers differ from the baseline\'s</div>')
    why = f'<div class="trade">{esc(answers.why)}</div>' if answers.why else ""
    name = f"eval {answers.eval_name}" if answers.eval_name else "the workload's answers"
    return f'<div class="card objective" data-answer="answers-kept"><div class="k">answers kept · {esc(name)}</div>{"".join(rows)}{why}</div>'


def _sentence(title: str) -> str:
    text = title.removeprefix("The answer: ")
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _card(item: Item, *, notes: tuple[str, ...]) -> str:
    f = item.figure
    name, _ = name_of(f.metric)
    b, a, unit = f.scaled()
    scale = (a / f.final) if is_num(a) and is_num(f.final) and f.final else 1.0
    which = ("baseline", "final") if f.census else ("baseline_median", "final_median")
    values = (f'<span{data_attrs("final", f"{f.path}.{which[0]}", f.baseline, scale)}>{esc(fmt_num(b))}</span> → '
              f'<span{data_attrs("final", f"{f.path}.{which[1]}", f.final, scale)}>{esc(fmt_num(a))}</span> <small>{esc(unit)}</small>')
    status = f.status(objective=bool(item.role))
    tone = "good" if status in ("confirmed", "better beyond noise") else "bad" if status == "worse beyond noise" else ""
    role = f" · {item.role}" if item.role else ""
    under = "".join(f'<div class="trade">{esc(n)}</div>' for n in notes)
    slo = f'<div class="k">{esc(item.slo)}</div>' if item.slo else ""
    key = f"{f.metric}@{f.clients if f.clients is not None else 'suite'}"
    return (f'<div class="card{" objective" if item.role else ""}" data-answer="{esc(key)}">'
            f'<div class="k">{esc(name)}{esc(role)}</div><div class="v">{values}</div>'
            f'<div>{_change(f)}</div><div class="st {tone}">{esc("census, exact" if f.census else status)}</div>{slo}{under}</div>')


def _change(f: Figure) -> str:
    """The change (a ratio when large, tied to trace.json's paired estimate) and its interval when it bounds it."""
    if not is_num(f.change):
        return ""
    ratio = uses_ratio(f.change)
    attrs = data_attrs("final", f"{f.path}.change", f.change) + (' data-form="ratio"' if ratio else "")
    words = f.change_words()
    rest = words.removeprefix(change_text(f.change)).strip()
    return f'<b{attrs}>{esc(change_text(f.change))}</b> <small>{esc(rest)}</small>'
