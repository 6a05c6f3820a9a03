"""Capacity rounds: each measured round searches the plan's capacity, through fresh servers."""

from __future__ import annotations

import pytest

from fractal_opt.measure.runner import measure
from fractal_opt.runtimes import Engine
from fractal_opt.tower.plan import Plan, SchedulingPlan
from fractal_opt.workloads.workload import Workload


@pytest.mark.parametrize("mode", ["closed", "conversations"])
def test_measured_capacity_is_a_per_round_number_with_its_probes(tiny_dir, mode):
    """Measuring with capacity: true gives each round a capacity and keeps every probe for the trace."""
    engine = Engine.build(Plan(source=str(tiny_dir), scheduling=SchedulingPlan(batching="continuous", max_concurrency=4)), progress=lambda m: None)
    load = {"mode": mode, "concurrency": 1, "users": 1, "turns": 1, "capacity": True, "capacity_max": 4, "slo_e2e_ms": 60_000, "ignore_eos": True}
    m = measure(engine, Workload(suite="conversations" if mode == "conversations" else "default", limit=2, max_new_tokens=2, repeats=1, warmup=0, load=load))
    (search,) = m.extra["load"]["capacity"]
    assert m.repeats[0]["capacity"] == 4 and search["status"] == "at least" and [p["load"] for p in search["probes"]] == [1, 2, 4]
