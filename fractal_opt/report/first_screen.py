"""The first screen: the answer to the recipe's question, before any table.

A recipe asks each layer for its objective: the hardware and model layers for one stream's decode
speed, the scheduling layer for throughput at the offered load, the application layer for the
answer time. The first screen says what the final plan gives, in the units a user thinks in and
only from the final confirmation (:mod:`.reader`): one user (one request at a time: decode
tokens/s per stream, TTFT, answer time), the offered load (throughput, TTFT and ITL p90 against
their SLOs, capacity where a capacity search measured it), the cost per 1,000 tokens, and the
answers kept (the eval's questions lost and gained). Each figure carries its interval and a status
(:meth:`.figures.Figure.status`); an objective a later step traded away gets a line under its
figure saying what it became and for what, rather than the headline. The terminal summary,
report.md and report.html draw this same :class:`FirstScreen`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .answers import AnswersKept, answers_kept
from .confirmation import final_lines
from .figures import Figure, name_of
from .reader import Load, Objective, Reader

__all__ = ["FirstScreen", "Group", "Item", "Line", "first_screen", "markdown_lines", "searched", "text_lines"]

# The figures one user feels, and those of a load shared by several requests (after the objectives).
ONE_USER = ("decode_tokens_per_s", "ttft_ms", "e2e_ms")
AT_LOAD = ("throughput_tokens_per_s", "ttft_ms_p90", "itl_ms_p90", "capacity", "goodput_tokens_per_s")
COST = ("cpu_s_per_1k_tokens", "usd_per_m_tokens")


@dataclass(frozen=True)
class Item:
    """One figure on the first screen, with the objective it answers and its SLO."""

    figure: Figure
    role: str = ""  # "hardware objective"; "" for a figure no kept layer was judged on
    slo: str = ""  # "within its SLO of 100 ms"

    def text(self) -> str:
        out = self.figure.text(objective=bool(self.role))
        return out + (f" ({self.role})" if self.role else "") + (f"; {self.slo}" if self.slo else "")


@dataclass(frozen=True)
class Line:
    """Figures shown together, and the lines under them (what a later step traded them for)."""

    items: tuple[Item, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Group:
    title: str  # "One user: one request at a time (2 rounds)"
    lines: tuple[Line, ...]
    load: Load | None = None


@dataclass(frozen=True)
class FirstScreen:
    title: str
    kept: str
    groups: tuple[Group, ...] = ()  # one per offered load: one user first, then the final plan's load
    cost: Group | None = None  # the cost per 1,000 tokens at the final plan's load
    answers: AnswersKept | None = None
    plain: tuple[str, ...] = field(default=())  # nothing measured against the baseline: what is known, in sentences


MEASURED = ("kept", "rolled_back", "screened_out")  # a candidate considered: screened or judged


def searched(trace: object) -> str:
    """``. Searched: hardware 9 candidates (6 screened out, 3 judged in full), model 2 (...)``: what
    the layers' searches considered, after the kept steps (nothing when no layer searched); with the
    recipe's listed steps beside them, ``; 13 candidates in all, 2 of them listed in the recipe``."""
    searches = [s for s in getattr(trace, "searches", []) if "considered" in s]
    parts = [f"{s['layer']} {s['considered']} candidate{'' if s['considered'] == 1 else 's'} ({s['screened_out']} screened out, "
             f"{s['kept'] + s['rolled_back']} judged in full)" for s in searches]
    if not parts:
        return ""
    total = sum(step.status in MEASURED for step in getattr(trace, "steps", []))
    listed = total - sum(s["considered"] for s in searches)
    return f". Searched: {', '.join(parts)}" + (f"; {total} candidates in all, {listed} of them listed in the recipe" if listed > 0 else "")


def first_screen(trace: object) -> FirstScreen:
    """What the run answers (see the module docstring)."""
    reader = Reader(trace)
    kept = ", ".join(reader.kept_labels()) or "nothing (the final plan is the baseline)"
    kept += searched(trace)
    answers = answers_kept(reader)
    if not reader.measured:
        sentences = final_lines(reader.final, markdown=False) if reader.final else ["No step has finished yet."]
        return FirstScreen(title="The answer: " + sentences[0], kept=f"Kept: {kept}", answers=answers, plain=tuple(sentences[1:2]))
    why = reader.confirmation.get("not_confirmed", "an objective did not improve beyond noise")
    status = "confirmed" if reader.status == "confirmed" else f"not confirmed ({why})"
    title = f"The answer: final plan vs baseline, measured again in the same rounds after the last step: {status}"
    objectives = reader.objectives()
    shown = [load for load in sorted(reader.loads(), key=lambda x: (not x.alone, not x.headline)) if load.alone or load.headline]
    groups = [_group(reader, load, objectives, single=len(shown) == 1) for load in shown]
    costs = [Item(f) for m in COST if (f := reader.figure(m)) is not None]
    cost = Group(title=f"Cost per 1,000 tokens, {reader.headline().label}", lines=(Line(tuple(costs)),)) if costs else None
    return FirstScreen(title=title, kept=f"Kept: {kept}", groups=tuple(g for g in groups if g.lines), cost=cost, answers=answers)


def _group(reader: Reader, load: Load, objectives: list[Objective], *, single: bool) -> Group:
    rounds = reader.confirmation["at_loads"][load.index].get("rounds") if load.index is not None else reader.confirmation.get("rounds")
    title = (f"One user, {load.label}" if load.alone else f"At the offered load, {load.label}" if load.clients else load.label.capitalize())
    title += f" ({rounds} rounds)" if rounds else ""
    here = [o for o in objectives if o.load == load]
    lines = [Line((Item(fig, role=o.role(), slo=_slo(reader, fig)),), notes=_trade_notes(reader, o, load))
             for o in here if (fig := reader.figure(o.metric, load)) is not None]
    wanted = (ONE_USER if load.alone or single else ()) + (AT_LOAD if not load.alone else ())
    rest = [Item(fig, slo=_slo(reader, fig)) for m in wanted if m not in {o.metric for o in here} and (fig := reader.figure(m, load)) is not None]
    lines += [Line(tuple(rest[i:i + 2])) for i in range(0, len(rest), 2)]  # two figures a line
    return Group(title=title, lines=tuple(lines), load=load)


def _slo(reader: Reader, fig: Figure) -> str:
    """``within its SLO of 100 ms`` for a figure an absolute guard bounds; "" otherwise."""
    limit = reader.guard_max(fig.metric)
    if limit is None or fig.final is None:
        return ""
    return f"{'within' if fig.final <= limit else 'over'} its SLO of {limit:g} {name_of(fig.metric)[1]}"


def _trade_notes(reader: Reader, objective: Objective, load: Load) -> tuple[str, ...]:
    """The line under a traded objective: what it is at the headline load, and what traded it for what."""
    t = objective.traded
    if not t:
        return ()
    why = f"traded by {t['by']} for {name_of(t['for'])[0]} ({t['change']:+.1%} in that step)"
    head = reader.headline()
    if load != head and (fig := reader.figure(objective.metric, head)) is not None:
        return (f"{head.label}: {fig.values()}, {fig.change_words()}, {fig.status()}: {why}",)
    return (why[0].upper() + why[1:] + ", a cost no guard forbids",)


def text_lines(screen: FirstScreen) -> list[str]:
    """The first screen for a terminal: a title, the kept passes, each group's figures indented."""
    out = [screen.title, screen.kept, *screen.plain]
    for group in (*screen.groups, *([screen.cost] if screen.cost else [])):
        out.append(group.title + ":")
        for line in group.lines:
            out.append("  " + "; ".join(item.text() for item in line.items))
            out += [f"    {note}" for note in line.notes]
    if screen.answers:
        out += [screen.answers.text(), *([f"  {screen.answers.why}"] if screen.answers.why else [])]
    return out


def markdown_lines(screen: FirstScreen) -> list[str]:
    """The first screen for report.md: the same lines, objectives in bold."""
    out = ["## The answer", "", screen.title.removeprefix("The answer: ").capitalize() + ".", "", screen.kept + ".", ""]
    out += [*screen.plain, ""] if screen.plain else []
    for group in (*screen.groups, *([screen.cost] if screen.cost else [])):
        out.append(f"{group.title}:")
        out.append("")
        for line in group.lines:
            out.append("- " + "; ".join(f"**{item.text()}**" if item.role else item.text() for item in line.items))
            out += [f"  - {note}" for note in line.notes]
        out.append("")
    if screen.answers:
        out += [f"**{screen.answers.text()}**" + (f" ({screen.answers.why})" if screen.answers.why else ""), ""]
    return out
