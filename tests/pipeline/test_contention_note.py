"""A step whose rounds were re-run for contention says so in its reason, with the share that caused it."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from fractal_opt.measure.metrics import Measurement
from fractal_opt.pipeline.records import contention_note
from fractal_opt.testing import FakeEngine


def _measurement(*rows: dict) -> Measurement:
    return Measurement(samples=[], repeats=[{"throughput_tokens_per_s": 10.0, **row} for row in rows], outputs={}, texts={})


def _account(share: float | None) -> dict:
    return {"engine_cpu_s": 1.0, "run_others_cpu_s": share or 0.0, "outside_cpu_s": 0.0, "share": share}


def test_quiet_rounds_add_nothing_to_the_reason() -> None:
    """Rounds without re-runs leave the reason as it is."""
    assert contention_note(_measurement({"contention": _account(0.01)}), _measurement({})) == ""


def test_a_rerun_round_is_one_sentence_with_the_discarded_share() -> None:
    """One re-run round: its count and the largest share a discarded try saw (not the kept try's)."""
    m = _measurement({"contention": _account(0.0)}, {"contention": _account(0.01), "reruns": 1, "rerun_contention": [_account(0.12)]})
    assert contention_note(m) == " 1 round re-run: another process of the run used 12% of the measured engine's CPU time."


def test_rounds_still_contended_after_the_last_rerun_are_counted() -> None:
    """Rounds of both measurements count; those still disturbed after the last re-run are named."""
    kept = _measurement({"reruns": 2, "contended": True, "rerun_contention": [_account(0.30), _account(0.41)]})
    previous = _measurement({"reruns": 1, "rerun_contention": [_account(0.07)]})
    assert contention_note(kept, previous) == (" 2 rounds re-run: another process of the run used 41% of the measured engine's CPU time;"
                                               " 1 still contended after 2 re-runs (flagged in its rows).")


class _HelperEngine(FakeEngine):
    """A FakeEngine whose KV-cache-off plan computes and starts a helper process in every round
    (CPU time of the run outside the engine that no registry can stop)."""

    def serve(self, requests, **kwargs):  # type: ignore[override]
        if self.plan.model.kv_cache == "off":
            subprocess.run([sys.executable, "-c", "import time\nuntil = time.process_time() + 0.05\nwhile time.process_time() < until: pass"], check=True)
            until = time.process_time() + 0.1  # the engine computes too (0.1 s): the helper's share is about half of it
            while time.process_time() < until:
                pass
        return super().serve(requests, **kwargs)


def test_a_step_whose_rounds_were_disturbed_says_so_in_its_reason(tmp_path) -> None:
    """A step whose candidate's rounds are all disturbed ends its reason with the re-run line:
    every round re-run twice and still contended."""
    from conftest import small_recipe_dict

    from fractal_opt.language.recipe import load_recipe
    from fractal_opt.measure.machine_limits import MachineLimits
    from fractal_opt.pipeline.runner import Pipeline
    from fractal_opt.testing import cpu_machine

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "fake"}', encoding="utf-8")
    recipe = load_recipe(small_recipe_dict(model, passes={"model": [{"kv_cache": {"implementation": "off"}}]}, limit=1, warmup=0))
    limits = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
    result = Pipeline(recipe, progress=False, machine=cpu_machine(), build=_HelperEngine.factory(), refuse=FakeEngine.refuse, limits=limits).run()
    (step,) = result.trace.steps
    rounds = step.metrics["comparison"]["rounds"]
    note = re.search(r" (\d+) rounds? re-run: another process of the run used (\d+)% of the measured engine's CPU time;"
                     r" (\d+) still contended after 2 re-runs \(flagged in its rows\)\.$", step.reason)
    assert note is not None, step.reason
    assert int(note[1]) == rounds and int(note[3]) == rounds and int(note[2]) > 5  # every candidate round, each try disturbed
