"""What a run records about itself besides its numbers: versions, start and end times, the model's fingerprint."""

from __future__ import annotations

import json

from conftest import small_recipe_dict

from fractal_opt.pipeline.run_info import model_fingerprint, run_info
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.testing import FakeEngine, cpu_machine


def test_run_info_records_versions_the_start_and_how_the_model_was_hashed():
    """fractal_opt / torch / transformers versions (the machine probe's win), the start time, and a hub id left unhashed."""
    info = run_info({"model": "org/not-local"}, {"packages": {"torch": "2.13.0+cpu", "transformers": "5.24.0"}})
    assert info["versions"]["torch"] == "2.13.0+cpu" and info["versions"]["transformers"] == "5.24.0" and info["versions"]["fractal_opt"]
    assert info["started_at"] and info["ended_at"] is None
    assert info["model"]["status"].startswith("not hashed")  # a hub id: nothing downloaded to hash


def test_a_run_stamps_its_end_in_trace_json(tiny_dir, tmp_path):
    """The runner records the run's start and, with every save, its end so far: the finished trace.json holds both."""
    recipe = small_recipe_dict(tiny_dir, limit=1, max_new_tokens=4, repeats=2, warmup=0, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}]})
    Pipeline(recipe, out_dir=tmp_path, progress=False, machine=cpu_machine(), build=FakeEngine.factory(), refuse=FakeEngine.refuse).run()
    run = json.loads((tmp_path / "trace.json").read_text())["run"]
    assert run["started_at"] <= run["ended_at"] and run["model"]["sha256"]


def test_model_fingerprint_changes_with_the_files(tmp_path):
    """The fingerprint hashes names, sizes and (small) contents: a changed file changes it, the same files give the same one."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    one, two = model_fingerprint(str(tmp_path)), model_fingerprint(str(tmp_path))
    assert one == two and one["files"] == 2 and one["bytes"] == 123 and "50 MiB" in one["method"]
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 100)
    assert model_fingerprint(str(tmp_path))["sha256"] != one["sha256"]
