"""Conversation rounds: the conversations load measured by the one runner, turns paired by id."""

from __future__ import annotations

from fractal_opt.measure.runner import measure
from fractal_opt.runtimes import Engine
from fractal_opt.tower.plan import Plan, SchedulingPlan
from fractal_opt.workloads.workload import Workload


def test_measure_under_conversations_reports_turns_per_round(tiny_dir):
    """Measuring under the conversations load pairs turns by id across rounds and keeps the per-turn table."""
    engine = Engine.build(Plan(source=str(tiny_dir), scheduling=SchedulingPlan(batching="continuous", max_concurrency=4)), progress=lambda m: None)
    wl = Workload(suite="conversations", max_new_tokens=2, repeats=2, warmup=1, limit=2,
                  load={"mode": "conversations", "users": 2, "turns": 2, "ignore_eos": True})
    m = measure(engine, wl)
    assert [r["load"]["done"] for r in m.repeats] == [4, 4]
    assert [row["turn"] for row in m.repeats[0]["turns"]] == [1, 2]
    assert sorted({s.request_id for s in m.samples}) == ["battery/u1/t1", "battery/u1/t2", "heat-pump-noise/u2/t1", "heat-pump-noise/u2/t2"]
    assert m.extra["load"]["by_turn"][1]["done"] == 4 and m.summary()["throughput_tokens_per_s"] > 0
