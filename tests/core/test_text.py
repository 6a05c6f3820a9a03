"""One number formatter and one clipper: a value reads the same in a verdict, a table and a report."""

from __future__ import annotations

import math

from fractal_opt.core.text import clip, fmt


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
