"""The cost per token: CPU-seconds per 1,000 tokens, dollars at the recipe's machine price, joules
where energy counters are readable, and a line saying why not where they are not."""

from __future__ import annotations

import dataclasses
import time

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.core.machine import Machine, MachinePrice
from fractal_opt.language.policy import Policy
from fractal_opt.language.recipe import parse_recipe
from fractal_opt.measure import cost
from fractal_opt.measure.runner import measure
from fractal_opt.testing import FakeEngine
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Workload


def test_cost_readings_price_the_wall_time_and_count_cpu_seconds():
    """$/M tokens is the hourly price for the wall time per million tokens; CPU-s per 1k from process time."""
    out = cost.cost_readings(output_tokens=2000, wall_s=36.0, cpu_s=4.0, energy_j=500.0, price_per_hour=2.0)
    assert out == {"cpu_s_per_1k_tokens": 2.0, "usd_per_m_tokens": pytest.approx(10.0), "joules_per_token": 0.25}
    assert cost.cost_readings(output_tokens=0, wall_s=1.0, cpu_s=1.0, energy_j=1.0, price_per_hour=1.0)["cpu_s_per_1k_tokens"] is None


def test_rapl_reads_package_zones_across_a_wrap(tmp_path, monkeypatch):
    """Energy is the package counters' difference, a counter that wrapped during the round corrected."""
    zone = tmp_path / "intel-rapl:0"
    (tmp_path / "intel-rapl:0:0").mkdir(parents=True)  # a sub-zone (cores): part of the package, not added again
    zone.mkdir()
    (zone / "max_energy_range_uj").write_text("1000000\n")
    (zone / "energy_uj").write_text("900000\n")
    (tmp_path / "intel-rapl:0:0" / "energy_uj").write_text("5\n")
    monkeypatch.setattr(cost, "POWERCAP", tmp_path)
    with cost.RaplWindow() as w:
        (zone / "energy_uj").write_text("100000\n")  # wrapped: 100,000 after 1,000,000 - 900,000 more
    assert w.status == "ok" and w.energy_j == pytest.approx(0.2)


def test_unreadable_energy_says_why(tmp_path, monkeypatch):
    """Without a powercap folder the energy line names it; joules stay None, never a made-up number."""
    monkeypatch.setattr(cost, "POWERCAP", tmp_path / "absent")
    with cost.RaplWindow() as w:
        pass
    assert w.energy_j is None and "does not exist" in w.status


def test_every_round_reports_its_cost_and_dollars_only_with_a_price():
    """A measurement gives CPU-s per 1k tokens always, $/M tokens only at a stated price, and says which."""


    class Busy(FakeEngine):
        """A fake engine that spends 50 ms of CPU on every serve call (the fake one only sleeps)."""

        def serve(self, requests, **kwargs):
            end = time.process_time() + 0.05
            while time.process_time() < end:
                pass
            return super().serve(requests, **kwargs)

    build = Busy.factory(per_token_ms=2.0)
    wl = Workload(max_new_tokens=4, repeats=2, warmup=0, limit=2)
    plain = measure(build(Plan(source="fake"), machine=Machine()), wl)
    priced = measure(build(Plan(source="fake"), machine=dataclasses.replace(Machine(), price_per_hour=3.6)), wl)
    assert plain.summary()["cpu_s_per_1k_tokens"] >= 0.05 * 1000 / 8 * 0.9  # >= 50 ms of CPU for 8 tokens
    assert plain.summary()["usd_per_m_tokens"] is None
    assert "no price" in plain.extra["cost"]["price"]
    wall = priced.repeats[0]["wall_s"]
    assert priced.repeats[0]["usd_per_m_tokens"] == pytest.approx(3.6 * wall / 3600 * 1e6 / 8)  # 2 requests x 4 tokens


def test_cost_metrics_are_objectives_guards_and_a_recipe_key():
    """The cost metrics may be a policy objective or guard; machine.price_per_hour must be positive."""
    assert Policy(objective="usd_per_m_tokens", guards={"cpu_s_per_1k_tokens": {"max": 5}}).objective == "usd_per_m_tokens"
    recipe = parse_recipe({"model": "smollm2-135m-instruct", "machine": {"price_per_hour": 0.2}})
    assert recipe.machine.on(Machine()).price_per_hour == 0.2
    with pytest.raises(RecipeError, match="price_per_hour"):
        MachinePrice(price_per_hour=0)
