"""The warning ``serve`` prints when the machine is busier than when the plan was measured, and the report's load line."""

from __future__ import annotations

from fractal_opt.measure.busier import busier_than_run, measured_under
from fractal_opt.measure.busy import BusySnapshot

THEN = {"others_cores": 0.05, "cores": 2, "load_average": [0.4, 0.3, 0.2]}


def _now(others: float) -> BusySnapshot:
    return BusySnapshot(load_average=(1.9, 1.2, 0.8), cores=2, others_cores=others, processes=[{"pid": 4121, "name": "python", "cpu": others}])


def test_serve_warns_when_others_use_half_a_core_more_than_during_the_run():
    """One busy process beside a 2-thread plan on 2 cores: the warning names the load then and now, the process and the shared cores."""
    text = busier_than_run(THEN, _now(1.0), threads=2)
    assert text is not None and "1.0 cores now against 0.1" in text and "python (pid 4121" in text and "2 compute threads share the 2 cores" in text


def test_serve_says_nothing_when_the_machine_is_as_quiet_as_during_the_run():
    """A shell's tenth of a core over the run's load is no warning; neither is a trace without a recorded load."""
    assert busier_than_run(THEN, _now(0.15), threads=2) is None
    assert busier_than_run({}, _now(1.5), threads=2) is None


def test_the_report_states_the_load_and_threads_its_numbers_were_measured_under():
    """The report's line names the others' cores, the load average and the plan's thread count."""
    text = measured_under(THEN, threads=2)
    assert text is not None and "0.1 cores" in text and "0.40 / 0.30 / 0.20" in text and "2 compute threads on 2 cores" in text
    assert measured_under(None, threads=2) is None
