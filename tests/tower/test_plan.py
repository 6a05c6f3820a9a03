"""Plan: every field says what it affects, and the cache keys are derived from those tags."""

from __future__ import annotations

import dataclasses

import pytest

from fractal_opt.tower.plan import AFFECTS, SECTIONS, HardwarePlan, Plan, fields_affecting


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_plan_field_is_tagged_with_what_it_affects(section):
    """A new plan field without an ``affects`` tag fails here: an untagged field would be missing
    from the engine cache key and serve a stale model."""
    untagged = [f.name for f in dataclasses.fields(SECTIONS[section]) if f.metadata.get("affects") not in AFFECTS]
    assert not untagged, f"{section} fields without field(metadata={{'affects': ...}}) (one of {AFFECTS}): {untagged}"


def test_weights_key_follows_the_weights_tags():
    """Changing a field tagged weights changes weights_key; a runtime field changes neither key."""
    plan = Plan(source="x")
    for section, name in fields_affecting("weights"):
        changed = plan.replace_section(section, **{name: "changed"})
        assert changed.weights_key() != plan.weights_key(), f"{section}.{name}"
    for section, name in fields_affecting("numerics"):
        changed = plan.replace_section(section, **{name: "changed"})
        assert changed.weights_key() == plan.weights_key() and changed.numerics_key() != plan.numerics_key(), f"{section}.{name}"
    for section, name in fields_affecting("runtime"):
        changed = plan.replace_section(section, **{name: "changed"})
        assert changed.numerics_key() == plan.numerics_key(), f"{section}.{name}"
    assert Plan(source="y").weights_key() != plan.weights_key()


def test_the_runtime_a_plan_names_decides_its_weights():
    """hardware.runtime is part of the weights key: two runtimes never share a loaded model."""
    assert ("hardware", "runtime") in fields_affecting("weights")
    other = Plan(source="x", hardware=HardwarePlan(runtime="llama_cpp"))
    assert other.weights_key() != Plan(source="x").weights_key()
