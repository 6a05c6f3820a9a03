"""How the project writes a number or a piece of text for a reader: one formatter, one clipper,
one rule for an interval.

Verdicts, reasons, target gaps, the terminal's tables and the reports all quote numbers and cut
long text the same way, so a value reads the same wherever it appears ("17.4 -> 18.7" in a
guard's reason, the progress line and report.md alike). A paired change's 95% interval is printed
as numbers only when it bounds the change: one wider than 10 times its estimate (two rounds of a
noisy metric: "+15.3% [95%: -64.0%, +269.1%]") says nothing a reader can use, so it is written
as ``too few rounds to bound`` (:func:`interval_text`).

Example:
    >>> from fractal_opt.core.text import clip, fmt
    >>> fmt(7.912), fmt(513.14), fmt(30.0), fmt(30.0, whole=True), fmt(None)
    ('7.912', '513.1', '30.0', '30', 'n/a')
    >>> clip("a  long\\nanswer", 8)
    'a long …'
    >>> interval_text(0.10, -0.01, 0.21), interval_text(0.153, -0.64, 2.691)
    ('[95%: -1.0%, +21.0%]', 'too few rounds to bound')
"""

from __future__ import annotations

import math
import textwrap

__all__ = ["UNBOUNDED", "bounded", "clip", "fmt", "interval_text"]

# An interval at most this many times as wide as its estimate is printed as numbers.
BOUND_RATIO = 10.0
UNBOUNDED = "too few rounds to bound"


def fmt(v: object, *, missing: str = "n/a", whole: bool = False) -> str:
    """A number as verdicts quote it: an integer as itself, a float with 4 significant digits
    below 10 and one decimal above (a measured 513.0 MB stays "513.0": it was measured, not
    counted); ``missing`` for anything that is not a number (None, a bool, a string), and
    ``repr`` for NaN and the infinities, so they are seen for what they are. ``whole``: a float
    with no fraction as a person wrote it (a target of 30, not 30.0)."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return missing
    if isinstance(v, int) or (whole and math.isfinite(v) and v == int(v) and abs(v) >= 1):
        return str(int(v))
    if not math.isfinite(v):
        return repr(v)
    return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"


def clip(text: str, width: int, *, tail: str = "…", words: bool = False) -> str:
    """``text`` on one line (white space folded) in at most ``width`` characters, ending with
    ``tail`` when it was cut; ``words`` cuts at a word boundary (``textwrap.shorten``) rather than
    mid-word, for prose such as a verdict's reason.

    Example:
        >>> clip("rolled back: decode -12.3% beyond noise", 30, tail=" … [report.md]", words=True)
        'rolled back: … [report.md]'
    """
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    if words:
        return textwrap.shorten(flat, width, placeholder=tail)
    return flat[: max(0, width - len(tail))] + tail


def bounded(change: float, low: float, high: float) -> bool:
    """Whether a change's interval ``[low, high]`` is narrow enough to print: at most
    :data:`BOUND_RATIO` times as wide as the estimate (its distance from no change)."""
    return math.isfinite(high - low) and (high - low) <= BOUND_RATIO * abs(change)


def interval_text(change: float, low: float, high: float, *, ratio: bool = False) -> str:
    """``[95%: -8.6%, -3.0%]`` (``ratio``: ``[95%: 5.20x, 6.41x]``), or :data:`UNBOUNDED` when
    the interval does not bound the change (:func:`bounded`)."""
    if not bounded(change, low, high):
        return UNBOUNDED
    if ratio:
        return f"[95%: {1 + low:.2f}x, {1 + high:.2f}x]"
    return f"[95%: {low:+.1%}, {high:+.1%}]"
