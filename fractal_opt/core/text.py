"""How the project writes a number or a piece of text for a reader: one formatter, one clipper.

Verdicts, reasons, target gaps, the terminal's tables and the reports all quote numbers and cut
long text the same way, so a value reads the same wherever it appears ("17.4 -> 18.7" in a
guard's reason, the progress line and report.md alike).

Example:
    >>> from fractal_opt.core.text import clip, fmt
    >>> fmt(7.912), fmt(513.14), fmt(30.0), fmt(30.0, whole=True), fmt(None)
    ('7.912', '513.1', '30.0', '30', 'n/a')
    >>> clip("a  long\\nanswer", 8)
    'a long …'
"""

from __future__ import annotations

import math
import textwrap

__all__ = ["clip", "fmt"]


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
