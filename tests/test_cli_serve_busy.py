"""`fractal-opt serve RUN_DIR` compares the machine's load now with the load its run's calibration recorded."""

from __future__ import annotations

import json

from fractal_opt.cli import serve as serve_cli
from fractal_opt.measure import busy
from fractal_opt.tower.plan import Plan


def _run_dir(tmp_path, others: float):
    (tmp_path / "trace.json").write_text(json.dumps({"schema_version": 2, "recipe": {}, "steps": [],
                                                     "calibration": {"busy": {"others_cores": others, "cores": 2}}}))
    return tmp_path


def test_serve_warns_from_the_run_folders_recorded_load(tmp_path, monkeypatch):
    """A run measured with others on 0.05 cores, served while others use 1.2: the warning names both and the plan's 2 threads."""
    monkeypatch.setattr(busy, "snapshot", lambda interval_s=1.0: busy.BusySnapshot(load_average=(2.5, 1.0, 0.5), cores=2, others_cores=1.2))
    plan = Plan(source="m").replace_section("hardware", threads=2)
    text = serve_cli._busier_than_run(str(_run_dir(tmp_path, 0.05)), plan)
    assert text is not None and "1.2 cores now against 0.1" in text and "2 compute threads" in text


def test_serve_is_silent_for_a_recipe_file_or_an_equally_quiet_machine(tmp_path, monkeypatch):
    """A plain recipe has no recorded load; a run folder served on a machine as quiet as its run gets no warning."""
    monkeypatch.setattr(busy, "snapshot", lambda interval_s=1.0: busy.BusySnapshot(load_average=(0.3, 0.2, 0.1), cores=2, others_cores=0.1))
    assert serve_cli._busier_than_run(str(tmp_path / "recipe.yaml"), Plan(source="m")) is None
    assert serve_cli._busier_than_run(str(_run_dir(tmp_path, 0.05)), Plan(source="m")) is None
