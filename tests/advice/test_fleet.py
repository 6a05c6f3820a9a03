"""fractal-opt fleet: replicas and machines for a target load from measured capacity and measured scaling."""

from __future__ import annotations

import json

import pytest

from fractal_opt.advice.fleet import Capacity, Scaling, fleet_basis, plan_fleet, scaling_from_benchmark
from fractal_opt.cli import main
from fractal_opt.core.errors import RecipeError


def _step(name: str, status: str, capacity: float | None, *, replicas: int = 1, cores: int | None = None, top: float | None = None, tps: float = 100.0):
    searches = [] if capacity is None else [{"capacity": capacity, "interval": [capacity, top], "unit": "clients", "status": "found"}]
    return {"pass": name, "status": status, "metrics": {"capacity": capacity, "throughput_tokens_per_s": tps, "load": {"capacity": searches}},
            "plan": {"scheduling": {"replicas": replicas, "replica_cores": cores}}}


def _trace(*steps, cores: int = 2):
    return {"machine": {"physical_cores": cores}, "baseline": steps[0], "steps": list(steps[1:]), "recipe": {"machine": {"price_per_hour": 0.5}}}


TRACE = _trace(_step("baseline", "baseline", 4.0, top=5.0), _step("replicas", "kept", 4.0, replicas=1, cores=1, top=5.0),
               _step("replicas", "kept", 7.0, replicas=2, cores=1, top=8.0, tps=180.0))


def test_one_replica_s_capacity_and_the_measured_efficiency_come_from_the_run():
    """The one-replica plan's capacity, and 2 replicas' capacity over twice one's as the efficiency (same cores each)."""
    cap, scaling = fleet_basis(TRACE)
    assert (cap.value, cap.low, cap.high, cap.cores) == (4.0, 4.0, 5.0, 1)
    assert scaling.efficiency == pytest.approx(7.0 / 8.0) and scaling.replicas == 2


def test_a_rolled_back_one_core_replica_still_counts_as_measured():
    """A pinned one-replica step rolled back (slower than the 2-core server) was measured here: the efficiency is against it, not the 2-core plan."""
    trace = _trace(_step("baseline", "baseline", 6.0, top=7.0), _step("replicas", "rolled_back", 4.0, replicas=1, cores=1, top=5.0),
                   _step("replicas", "kept", 7.0, replicas=2, cores=1, top=8.0))
    cap, scaling = fleet_basis(trace)
    assert cap.value == 4.0 and cap.cores == 1 and scaling.efficiency == pytest.approx(7.0 / 8.0)


def test_without_a_replicas_step_the_kept_plan_is_one_replica_and_no_efficiency():
    cap, scaling = fleet_basis(_trace(_step("baseline", "baseline", 6.0, top=7.0)))
    assert cap.value == 6.0 and cap.cores == 2 and scaling is None


def test_replicas_and_machines_for_a_target_with_the_interval():
    """ceil(target / (capacity x efficiency)) replicas; the interval's top gives the fewest; machines hold cores / cores-per-replica."""
    cap = Capacity(4.0, 4.0, 5.0, "clients", 100.0, 1, "step")
    answer = plan_fleet(cap, target=70, option="users", machine_cores=2, scaling=Scaling(0.875, 2, "run"))
    assert answer.replicas == 20 and answer.replicas_interval == (16, 20)  # 70 / 3.5 = 20; 70 / 4.375 = 16
    assert answer.per_machine == 2 and answer.machines == 10
    assert "0.88 measured here" in answer.to_text()


def test_cost_per_thousand_tokens_at_a_stated_price():
    """machines x price per hour over the load's tokens per hour (each replica's rate per unit of load at its capacity)."""
    cap = Capacity(4.0, 4.0, 5.0, "clients", 100.0, 1, "step")
    answer = plan_fleet(cap, target=8, option="users", machine_cores=2, scaling=Scaling(1.0, 2, "run"), price_per_hour=3.6)
    # 2 replicas on 1 machine; 8 clients make 200 tokens/s; $3.6/h = $0.001/s -> $0.005 per 1,000 tokens
    assert answer.machines == 1 and answer.usd_per_1k_tokens == pytest.approx(0.005)


def test_an_unmeasured_efficiency_is_said_never_filled_in():
    answer = plan_fleet(Capacity(4.0, 4.0, None, "clients", None, 2, "step"), target=10, option="users", machine_cores=2)
    assert "NOT MEASURED" in answer.to_text() and answer.to_dict()["scaling_efficiency"] is None


def test_a_run_that_measured_no_capacity_is_refused():
    with pytest.raises(RecipeError, match="measured no capacity"):
        fleet_basis(_trace(_step("baseline", "baseline", None)))


def test_a_target_in_another_unit_is_refused():
    with pytest.raises(RecipeError, match="give --users"):
        plan_fleet(Capacity(4.0, 4.0, 5.0, "clients", None, 1, "s"), target=3, option="rate", machine_cores=2)


def test_the_benchmark_s_json_gives_the_efficiency(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"replicas": {"scaling_efficiency": 0.91, "replicas": 2}}))
    assert scaling_from_benchmark(path).efficiency == 0.91
    path.write_text("{}")
    with pytest.raises(RecipeError, match="scaling_efficiency"):
        scaling_from_benchmark(path)


def test_the_cli_prints_the_fleet_and_refuses_a_run_without_capacity(tmp_path, capsys):
    """fractal-opt fleet prints replicas, machines and the measured efficiency; a run with no capacity exits 2 with the reason."""
    (tmp_path / "trace.json").write_text(json.dumps(TRACE))
    assert main(["fleet", str(tmp_path), "--users", "70", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["replicas"], out["machines"], out["scaling_efficiency"]) == (20, 10, 0.875) and out["usd_per_1k_tokens"] is not None
    (tmp_path / "trace.json").write_text(json.dumps(_trace(_step("baseline", "baseline", None))))
    assert main(["fleet", str(tmp_path), "--users", "70"]) == 2
    assert "measured no capacity" in capsys.readouterr().err
