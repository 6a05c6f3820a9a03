"""One number formatter, one clipper, one rule for an interval: a value reads the same in a verdict, a table and a report."""

from __future__ import annotations

import math

from fractal_opt.core.text import bounded, clip, fmt, interval_text


def test_numbers_read_as_a_person_writes_them():
    """Four significant digits below 10, one decimal above; an integer (a count) as itself."""
    assert [fmt(7.91234), fmt(0.05), fmt(513.14), fmt(513.0), fmt(4096), fmt(0.0)] == ["7.912", "0.05", "513.1", "513.0", "4096", "0"]


def test_a_missing_number_is_said_not_faked():
    """None, a bool or a string is "n/a" (or the caller's dash); NaN and inf show as themselves."""
    assert [fmt(None), fmt(True), fmt("12"), fmt(None, missing="–")] == ["n/a", "n/a", "n/a", "–"]
    assert [fmt(math.nan), fmt(-math.inf)] == ["nan", "-inf"]


def test_short_text_is_folded_onto_one_line_and_kept_whole():
    """Text that fits comes back whole, its line breaks and runs of spaces folded to one space."""
    assert clip("Paris\n\n  is the  capital", 40) == "Paris is the capital"


def test_long_text_is_cut_to_the_width_with_a_visible_tail():
    """Cut text is exactly ``width`` characters and ends with the tail, so a reader sees it was cut."""
    out = clip("x" * 100, 17)
    assert len(out) == 17 and out.endswith("…") and out.startswith("x" * 16)


def test_prose_is_cut_at_a_word_boundary_with_its_own_tail():
    """``words=True`` never splits a word and ends with the caller's tail (the progress line's pointer to report.md)."""
    reason = "rolled back: decode_tokens_per_s -12.3% beyond noise, guard kl_mean tripped"
    out = clip(reason, 40, tail=" … [report.md]", words=True)
    assert out == "rolled back: … [report.md]" and len(out) <= 40


def test_an_interval_is_printed_only_when_it_bounds_its_change():
    """An interval at most 10x as wide as its estimate is printed (as a ratio when asked); a wider one says too few rounds."""
    assert interval_text(-0.321, -0.369, -0.269) == "[95%: -36.9%, -26.9%]"
    assert interval_text(4.78, 4.2, 5.41, ratio=True) == "[95%: 5.20x, 6.41x]"
    assert interval_text(0.82, -0.652, 8.524) == "too few rounds to bound"  # two rounds of TTFT p90 at one client
    assert bounded(0.1, 0.0, 1.0) and not bounded(0.1, 0.0, 1.01) and not bounded(0.0, -0.01, 0.01)
