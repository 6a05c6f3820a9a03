"""What one user gets from a plan: the wait for the first token, how fast the answer streams, the whole answer.

Scheduling passes are judged on throughput (all output tokens/s of a round) with TTFT and ITL p90
guards. A batching that doubles throughput can still make each user wait longer for the first
token and watch the answer arrive more slowly; this line puts the three numbers one interactive
user feels next to each other, previous plan -> candidate, so such a trade shows at a glance:

- ``TTFT``: ``ttft_ms_p50``, the median over requests and rounds of submission -> first token
  (tokenization, queueing and batching wait included);
- ``streams``: ``decode_tokens_per_s``, the median request's own tokens/s after its first token;
- ``answer``: ``e2e_ms_p50``, the median of submission -> last token, printed in seconds.

They are the step's stored medians (trace.json ``metrics``), nothing measured anew. Under a load
profile every sample is a request as its caller saw it, so they are what one user got under that
load. The previous plan's numbers are its medians from the step's own rounds when the step stores
them (``metrics.previous``), else the kept plan's medians as its own step (or, for the baseline,
the A/A calibration) measured them: another measurement, minutes earlier, and the text names it.
Each percentage is computed from the two numbers printed next to it, as printed; it is not the
paired estimate a verdict uses (report.md's tables give that).

Example:
    >>> line({"ttft_ms_p50": 455.0, "decode_tokens_per_s": 18.0, "e2e_ms_p50": 2140.0},
    ...      {"ttft_ms_p50": 612.0, "decode_tokens_per_s": 33.1, "e2e_ms_p50": 1430.0})
    'one user: TTFT 455 -> 612 ms (+35%), streams 18.0 -> 33.1 tok/s (+84%), answer 2.14 -> 1.43 s (-33%)'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .labels import pass_label
from .svg import fmt_num, is_num

__all__ = ["FIGURES", "Figure", "Previous", "figures", "line", "previous_plans", "summary", "under"]

# (trace.json metric, name in the text, unit, scale from the stored unit to the printed one).
FIGURES: tuple[tuple[str, str, str, float], ...] = (
    ("ttft_ms_p50", "TTFT", "ms", 1.0),
    ("decode_tokens_per_s", "streams", "tok/s", 1.0),
    ("e2e_ms_p50", "answer", "s", 1e-3),  # stored in ms; a whole answer takes seconds
)
# Steps that measured nothing (or one screening round, which the tower shows), so no line of what one user got.
_UNMEASURED = ("skipped", "failed", "screened_out")


@dataclass(frozen=True)
class Figure:
    """One number of the line: the previous plan's and the candidate's value, as stored and as printed."""

    metric: str
    name: str
    unit: str
    scale: float
    before: float | None  # as stored (trace.json units); None when the previous plan has none
    after: float | None
    before_text: str  # 3 significant digits in the printed unit; "–" when missing
    after_text: str

    @property
    def change(self) -> float | None:
        """The candidate's printed number over the previous plan's, minus 1 (None without both)."""
        b, a = _parsed(self.before_text), _parsed(self.after_text)
        return a / b - 1 if a is not None and b else None

    def text(self, *, arrow: str = "->") -> str:
        """``TTFT 455 -> 612 ms (+35%)``; only the candidate's number when there is no previous one."""
        if self.before is None:
            return f"{self.name} {self.after_text} {self.unit}"
        change = self.change
        return f"{self.name} {self.before_text} {arrow} {self.after_text} {self.unit}" + (f" ({change:+.0%})" if change is not None else "")


@dataclass(frozen=True)
class Previous:
    """The plan a step was judged against, and where its one-user numbers are stored in trace.json."""

    metrics: Mapping[str, Any]
    step: str  # trace.json's step key: "0" the baseline, "1".. the steps in order
    path: str  # "metrics" (the kept plan's own step) or "metrics.previous" (this step's rounds)
    label: str  # the previous plan's pass label ("baseline" for the baseline)

    @property
    def same_rounds(self) -> bool:
        return self.path == "metrics.previous"

    def source(self) -> str:
        """Where the previous plan's numbers come from, for the text."""
        if self.same_rounds:
            return "previous plan in the same rounds"
        return f"previous plan: {self.label} as {'the A/A calibration' if self.step == '0' else 'its own step'} measured it"


def figures(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> list[Figure]:
    """The one-user figures of ``after`` against ``before`` (two metrics dicts); a figure neither has is left out."""
    out = []
    for metric, name, unit, scale in FIGURES:
        b, a = _number((before or {}).get(metric)), _number(after.get(metric))
        if a is None and b is None:
            continue
        out.append(Figure(metric=metric, name=name, unit=unit, scale=scale, before=b, after=a,
                          before_text=_printed(b, scale), after_text=_printed(a, scale)))
    return out


def summary(before: Mapping[str, Any] | None, after: Mapping[str, Any], *, arrow: str = "->") -> str:
    """``TTFT 455 -> 612 ms (+35%), streams ...``; "" when ``after`` holds none of the numbers.
    ``before`` None: the candidate's numbers alone (the baseline has no previous plan)."""
    return ", ".join(f.text(arrow=arrow) for f in figures(before, after) if f.after is not None)


def line(before: Mapping[str, Any] | None, after: Mapping[str, Any], *, arrow: str = "->") -> str:
    """``one user: TTFT 455 -> 612 ms (+35%), ...``: the compact form a terminal line can append
    (for example to the runner's verdict line, with the previous plan's medians of the step's
    rounds as ``before``); "" when there is nothing to show."""
    text = summary(before, after, arrow=arrow)
    return f"one user: {text}" if text else ""


def previous_plans(baseline: Any, steps: Sequence[Any]) -> list[Previous | None]:
    """Per step (trace order), the plan it was judged against; None for a step that measured
    nothing (skipped, failed) or when no earlier plan has numbers.

    The previous plan is the last kept step before it, or the baseline; a step that stores the
    previous plan's medians from its own rounds (``metrics.previous``) is paired with those.
    """
    kept = Previous(metrics=baseline.metrics, step="0", path="metrics", label="baseline") if baseline is not None and baseline.metrics else None
    out: list[Previous | None] = []
    for i, s in enumerate(steps, start=1):
        own = s.metrics.get("previous") if s.metrics else None
        if s.status in _UNMEASURED or not s.metrics:
            out.append(None)
        elif isinstance(own, dict):
            out.append(Previous(metrics=own, step=str(i), path="metrics.previous", label=kept.label if kept else "previous plan"))
        else:
            out.append(kept)
        if s.status == "kept" and s.metrics:
            kept = Previous(metrics=s.metrics, step=str(i), path="metrics", label=f"{s.layer}/{pass_label(s.pass_name, s.params, s.status)}")
    return out


def under(steps: Sequence[Any]) -> str:
    """How the numbers were served, for a heading: under the workload's load profile, or the suite as the plan serves it."""
    load = next((s.metrics["load"] for s in steps if s is not None and s.metrics and isinstance(s.metrics.get("load"), dict)), None)
    if load:
        rate = f", {load.get('rate')}/s" if load.get("mode") == "poisson" else ""
        return f"under this workload's load profile ({load.get('mode')}{rate}: TTFT includes queueing)"
    return "under this workload (the suite as the plan serves it: TTFT from submission, batching wait included)"


def _number(v: Any) -> float | None:
    return float(v) if is_num(v) else None  # None, NaN and infinity alike: nothing to print


def _printed(v: float | None, scale: float) -> str:
    return fmt_num(v * scale) if v is not None else "–"


def _parsed(text: str) -> float | None:
    """The number a printed text shows ("1,234" -> 1234.0), None for "–"."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None
