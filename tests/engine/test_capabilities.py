"""A runtime's capabilities table: refusal rows give their reasons in order, and dotted names resolve on use."""

from __future__ import annotations

from fractal_opt.engine.capabilities import Capabilities, Refusal, refusals, resolve
from fractal_opt.tower.plan import Plan

ROWS = (
    Refusal("application.num_beams", lambda p: p.application.num_beams > 1, "no beam search here"),
    Refusal("hardware.threads", lambda p: p.hardware.threads == 3, lambda p: "hardware.threads=3: three is the one count it refuses"),
)


def test_refusal_rows_give_field_value_and_why_in_the_table_s_order():
    """A row with a sentence says field=value: why; a row with a function writes its own reason; both in order."""
    plan = Plan(source="m").replace_section("application", num_beams=2).replace_section("hardware", threads=3)
    assert refusals(ROWS, plan) == ["application.num_beams=2: no beam search here", "hardware.threads=3: three is the one count it refuses"]
    assert refusals(ROWS, Plan(source="m")) == []


def test_refused_fields_and_dotted_names_come_from_the_table():
    """refused_fields lists each field once; a "module:attribute" string is imported only when used."""
    caps = Capabilities(name="mine", summary="mine", engine="fractal_opt.testing:FakeEngine", refuses=ROWS + ROWS[:1])
    assert caps.refused_fields() == ["application.num_beams", "hardware.threads"]
    from fractal_opt.testing import FakeEngine

    assert resolve(caps.engine) is FakeEngine
    assert Capabilities(name="llama", summary="", engine="x:y", refuses="fractal_opt.runtimes.llama_cpp.settings:REFUSALS").refusal_rows()
