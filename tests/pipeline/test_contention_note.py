"""A step whose rounds were re-run for contention says so in its reason, with the share that caused it."""

from __future__ import annotations

from fractal_opt.measure.metrics import Measurement
from fractal_opt.pipeline.records import contention_note


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
