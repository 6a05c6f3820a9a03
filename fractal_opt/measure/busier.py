"""Is the machine busier now than when the plan was measured? The warning ``serve`` prints.

A tuned plan's numbers hold for the load it was measured under: the run's A/A calibration records
the other processes' CPU use when it started (:func:`fractal_opt.measure.busy.snapshot`, in the
trace's ``calibration.busy``). A plan whose compute threads take every core shares them with any
other work that starts beside it, and llama.cpp's spinning threads give up the most: a second
process beside it takes cores the threads wait on at every token. So ``fractal-opt serve`` samples
the load once before it listens and says, with the numbers, when others now use noticeably more
CPU than during the run; the report states the load its numbers were measured under
(:func:`measured_under`).

Example:
    >>> from fractal_opt.measure.busy import BusySnapshot
    >>> now = BusySnapshot(load_average=(2.9, 1.0, 0.5), cores=2, others_cores=1.0)
    >>> busier_than_run({"others_cores": 0.05, "cores": 2}, now, threads=2) is not None
    True
"""

from __future__ import annotations

from typing import Any

from .busy import BusySnapshot

__all__ = ["MORE_CORES", "busier_than_run", "measured_under"]

# Others' CPU use may grow by this many cores over the run's before serve warns: half a core is
# one busy process at half time, already enough to take one of two llama.cpp threads' cores half
# the time; smaller rises (a shell, an editor: under a tenth of a core) are the run's own noise.
MORE_CORES = 0.5


def busier_than_run(then: dict[str, Any] | None, now: BusySnapshot, *, threads: int | None) -> str | None:
    """The warning when ``now`` has others using at least :data:`MORE_CORES` more cores than
    ``then`` (a trace's ``calibration.busy``), else None; None too when the run recorded no load.

    Args:
        then: the load the run's calibration saw (``BusySnapshot.to_dict()``), or None.
        now: the load sampled now.
        threads: the plan's compute threads (the count it ran with), to say what they share.
    """
    if not then or not isinstance(then.get("others_cores"), int | float):
        return None
    before = float(then["others_cores"])
    if now.others_cores < before + MORE_CORES:
        return None
    load = " / ".join(f"{v:.2f}" for v in now.load_average) if now.load_average else "unknown"
    who = ", ".join(f"{p['name']} (pid {p['pid']}, {p['cpu']:.0%})" for p in now.processes)
    text = (f"this machine is busier than during the run: other processes use {now.others_cores:.1f} cores now "
            f"against {before:.1f} when the plan was measured (load average now {load} on {now.cores} cores"
            + (f"; {who}" if who else "") + ")")
    if threads is not None and threads + now.others_cores > now.cores:
        text += f"; the plan's {threads} compute threads share the {now.cores} cores with that work"
    return text + ": expect slower answers than the report's, or re-run the tuning beside that work."


def measured_under(then: dict[str, Any] | None, *, threads: int | None) -> str | None:
    """One sentence for the report: the load the numbers were measured under and the plan's
    threads, with the rule ``serve`` applies; None when the run recorded no load."""
    if not then or not isinstance(then.get("others_cores"), int | float):
        return None
    load = then.get("load_average")
    avg = " / ".join(f"{v:.2f}" for v in load) if isinstance(load, list | tuple) and load else "unknown"
    cores = then.get("cores")
    ran = f"The plan runs {threads} compute threads on {cores} cores; " if threads is not None and cores else ""
    return (f"Measured with other processes using {float(then['others_cores']):.1f} cores (load average {avg} when the calibration started). "
            f"{ran}work beside it takes cores its threads wait on, so the numbers hold on a machine this quiet: "
            f"`fractal-opt serve` warns when others use {MORE_CORES} cores more than this.")
