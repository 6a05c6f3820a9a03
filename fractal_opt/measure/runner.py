"""The measurement: one runner, every timing rule in one place.

Rules: warm-up requests are run and excluded; the device is synchronized before every clock read
(the engine's ``clock_sync``); clocks are ``time.perf_counter`` (monotonic); each measurement
repeats the whole suite and reports medians with their spread; comparisons are paired per request
and round. The metrics are defined in :mod:`fractal_opt.measure.metrics`.

:class:`Runner` measures one engine, one timed round at a time (``warm_up`` / ``round`` /
``result``). What a round serves comes from one of two sources (:mod:`fractal_opt.measure.rounds`):
``SuiteRounds`` serves the workload's suite synchronously through ``Engine.serve``; with a
``load`` profile, ``LoadRounds`` sends that load through a server. The runner wraps either in the
same memory, GPU and CPU windows and computes the same per-repeat readings. During each round the
run's other child servers are stopped and the CPU time of everything else is accounted
(:mod:`fractal_opt.measure.isolation`); a round the run's other processes disturbed is served again.

Each warm-up and round is served on a thread of its own that ends with it (:func:`~fractal_opt.core.threads.in_own_thread`).
torch and llama.cpp load the same OpenMP runtime (libgomp; torch ships a ``libgomp.so.1`` and the
xllamacpp wheel links one, and the process loads one copy), and libgomp keeps the worker threads of
every live thread that ran a parallel region. Once those outnumber the cores it cuts every
thread's spin-wait between kernels to almost nothing: llama.cpp then decodes at well under half its
speed (measured: 80.6 tokens/s, then 32.4 after 20 torch matmuls on the main thread, 86.1 when the
same matmuls ran on a thread that had ended). A round on a thread that ends releases its workers,
so the transformers rounds of a comparison do not slow the llama.cpp rounds next to them.

Example:
    >>> m = measure(engine, Workload(repeats=3))                 # doctest: +SKIP
    >>> m.summary()["decode_tokens_per_s"]                       # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..core.threads import in_own_thread
from .cost import RaplWindow, cost_readings
from .isolation import CpuAccount, contended, others_quiet
from .memory import GpuMonitor, MemoryWindow
from .metrics import METRICS, PER_REPEAT, Measurement, Sample, capacity_mb, round_readings
from .rounds import LoadRounds, Round, Rounds, SuiteRounds

if TYPE_CHECKING:
    from ..engine.protocol import Engine
    from ..workloads.workload import Request, Workload

__all__ = ["MAX_RERUNS", "Runner", "measure", "measure_pair", "paired_changes"]

# At most this many re-runs of a round the run's other processes disturbed (then it is kept,
# flagged ``contended``): a process that cannot be stopped keeps disturbing, and a round costs time.
MAX_RERUNS = 2


class Runner:
    """Measures one engine, one timed round at a time: ``warm_up()``, ``round()``, ``result()``.

    Each round starts with an empty response cache (hits come from repeats within the round), runs
    the source inside the memory, GPU and CPU windows, and appends one per-repeat row (aggregate
    tokens/s, memory, CPU utilization, headroom, percentiles, the source's own readings).

    Raises (from ``round``):
        EngineError: the source's requests failed, or a load round left too little memory free.
    """

    def __init__(self, engine: Engine, workload: Workload, requests: Sequence[Request], *, clients: int | None = None):
        self.engine = engine
        self.workload = workload
        self.source: Rounds = rounds_for(engine, workload, requests, clients=clients)  # clients: the offered load (None: the plan's own)
        self.device = engine.device
        self.threads = engine.threads
        self.capacity_mb = capacity_mb(engine.machine, self.device)
        self.samples: list[Sample] = []
        self.repeats: list[dict[str, Any]] = []
        self.outputs: dict[str, list[int]] = {}
        self.texts: dict[str, str] = {}
        self.warmup_s = 0.0
        self.activate_s = 0.0  # seconds engine.activate() took before warm-up and rounds (reloads)
        self.memory_source = "rss"
        self.gpu: dict[str, Any] = {}
        self.price_per_hour = getattr(engine.machine, "price_per_hour", None)  # the recipe's machine: {price_per_hour}
        self.energy_source = "not measured"

    def warm_up(self) -> None:
        self.activate_s += self.engine.activate()
        t0 = time.perf_counter()
        for _ in range(self.workload.warmup):
            in_own_thread(self.source.warm_up)
        self.warmup_s += time.perf_counter() - t0

    def round(self) -> None:
        """One timed round, recorded as one row. Every other child server of the run is stopped
        while it runs (:func:`~.isolation.others_quiet`); the row's ``contention`` says who else used
        the CPU (:class:`~.isolation.CpuAccount`). When the run's other processes used more than 5% of
        the engine's CPU time, the round is served again, at most :data:`MAX_RERUNS` times (the row
        then has ``reruns`` and the discarded tries' accounts, and ``contended: true`` if the last try
        was disturbed too). CPU time used outside this run (other users of the machine) is recorded,
        never re-run: the calibration's busy warning covers it."""
        r = len(self.repeats)
        served, row = self._timed_round(r)
        reruns, discarded = 0, []
        while contended(row["contention"]) and reruns < MAX_RERUNS:
            reruns += 1
            discarded.append(row["contention"])
            self.source.forget_round()  # a source keeping per-round state drops the discarded try's
            served, row = self._timed_round(r)
        if reruns:
            row["reruns"], row["rerun_contention"] = reruns, discarded  # what the discarded tries saw
        if contended(row["contention"]):
            row["contended"] = True
        self.repeats.append(row)
        self.samples.extend(served.samples)
        if r == 0:
            self.outputs, self.texts = served.outputs, served.texts

    def _timed_round(self, r: int) -> tuple[Round, dict[str, Any]]:
        """Serve round ``r`` once inside the memory, GPU, energy and CPU windows; its served work and row."""
        self.activate_s += self.engine.activate()  # before the clock: e.g. llama.cpp reloads its server if another plan's was resident
        self.engine.reset_response_cache()  # every round starts cold: hits come from repeats within the round
        pids = self.engine.server_pids()  # a child server's memory and CPU time are the engine's too
        with others_quiet(pids), CpuAccount(pids) as account, MemoryWindow(self.device, pids=pids) as mem, \
                GpuMonitor(self.device) as gpu, RaplWindow() as rapl:
            served = in_own_thread(self.source.serve, r)
        self.source.check_memory(mem.peak_mb, self.capacity_mb)
        contention = account.result()
        cpu_s = float(contention["engine_cpu_s"] or 0.0)
        row = round_readings(output_tokens=served.output_tokens, wall_s=served.wall_s, cpu_s=cpu_s, threads=self.threads,
                             peak_mb=mem.peak_mb, capacity=self.capacity_mb)
        row.update(served.readings)
        if mem.cuda_reserved_mb is not None:
            row["cuda_max_reserved_mb"] = mem.cuda_reserved_mb
        row.update(cost_readings(output_tokens=served.output_tokens, wall_s=served.wall_s, cpu_s=cpu_s, energy_j=self._energy(gpu, rapl, served),
                                 price_per_hour=self.price_per_hour))
        row["contention"] = contention
        self.memory_source = mem.source
        return served, row

    def _energy(self, gpu: GpuMonitor, rapl: RaplWindow, served: Round) -> float | None:
        """The round's joules: NVML's (the GPU board) when it read, else RAPL's; sets the source's name."""
        g = gpu.result()
        if g["energy_j"] is not None and served.output_tokens:
            g["energy_j_per_token"] = g["energy_j"] / served.output_tokens
        self.gpu = g
        energy_j, self.energy_source = (g["energy_j"], "NVML (the GPU board)") if g["energy_j"] is not None else (rapl.energy_j, "RAPL (the CPU packages, other processes included)")
        if energy_j is None:
            self.energy_source = g["status"] if g["status"] != "ok" and self.device.startswith("cuda") else rapl.status
        return energy_j

    def result(self) -> Measurement:
        extra: dict[str, Any] = {"gpu": self.gpu or {"status": "unavailable: not measured"}, **self.source.extra()}
        reserved = [r["cuda_max_reserved_mb"] for r in self.repeats if "cuda_max_reserved_mb" in r]
        if reserved:
            extra["cuda_max_reserved_mb"] = max(reserved)
        if self.capacity_mb:
            extra["capacity_mb"] = round(self.capacity_mb, 1)
        if self.activate_s:
            extra["activate_s"] = round(self.activate_s, 2)
        extra["cost"] = {"energy": self.energy_source,
                         "price": f"{self.price_per_hour:g} $/hour (the recipe's machine.price_per_hour)" if self.price_per_hour is not None
                         else "no price: the recipe states none (machine: {price_per_hour: ...})"}
        return Measurement(samples=self.samples, repeats=self.repeats, outputs=self.outputs, texts=self.texts, warmup_s=self.warmup_s,
                           memory_source=self.memory_source, extra=extra)


def measure(
    engine: Engine,
    workload: Workload,
    *,
    requests: Sequence[Request] | None = None,
    progress: Callable[[str], None] | None = None,
    clients: int | None = None,
) -> Measurement:
    """Warm up, then serve the suite ``workload.repeats`` times and collect every sample
    (``clients``: a load profile's offered load, default the plan's own, :func:`.rounds.offered_clients`)."""
    runner = Runner(engine, workload, requests if requests is not None else workload.requests(), clients=clients)
    runner.warm_up()
    for r in range(workload.repeats):
        if progress:
            progress(f"repeat {r + 1}/{workload.repeats}")
        runner.round()
    return runner.result()


def measure_pair(
    previous: Engine,
    candidate: Engine,
    workload: Workload,
    *,
    requests: Sequence[Request] | None = None,
    objective: str = "decode_tokens_per_s",
    min_effect: float = 0.03,
    warm_previous: bool = True,
    progress: Callable[[str], None] | None = None,
    clients: int | None = None,
    min_repeats: int | None = None,
    screen: Callable[[Measurement, Measurement], bool] | None = None,
) -> tuple[Measurement, Measurement]:
    """Measure two engines interleaved, round by round, so drift hits both alike.

    Rounds alternate the order A B, B A, A B, ... (each round serves the whole suite once per
    engine; alternating cancels a linear drift within a pair as well as between pairs). After
    ``workload.repeats`` rounds, rounds are added two at a time (one A B / B A pair, so the order
    stays balanced) while the t interval of ``objective`` is not
    :func:`~fractal_opt.measure.noise.settled`, up to ``workload.max_repeats``. ``previous`` may be
    the same engine as ``candidate`` (the A/A calibration). ``clients`` offers both the same load
    under a load profile (default: each its plan's own, :func:`.rounds.offered_clients`).
    ``min_repeats`` (below ``workload.repeats``): a comparison that judges ``objective`` alone may
    stop after that many rounds (one A B / B A pair) when its interval is already settled there.
    ``screen(before, after)``: asked after the first round (:mod:`.screen`); False stops the
    comparison there (the candidate was screened out), and the one round is returned.
    """
    from .noise import settled

    reqs = list(requests if requests is not None else workload.requests())
    a, b = Runner(previous, workload, reqs, clients=clients), Runner(candidate, workload, reqs, clients=clients)
    if warm_previous:
        a.warm_up()
    b.warm_up()
    budget = max(workload.repeats, getattr(workload, "max_repeats", None) or workload.repeats)
    early = min(min_repeats or workload.repeats, workload.repeats)
    for r in range(budget):
        if r == 1 and screen is not None and not screen(a.result(), b.result()):
            break
        if r == early < workload.repeats or (r >= workload.repeats and (r - workload.repeats) % 2 == 0):
            interval = paired_changes(a.result(), b.result(), [objective]).get(objective)
            if settled(interval, min_effect=min_effect):
                break
        if progress:
            progress(f"round {r + 1}/{budget} (extended from {workload.repeats}: the interval is not settled yet)" if r >= workload.repeats else f"round {r + 1}/{workload.repeats}")
        for runner in ((a, b) if r % 2 == 0 else (b, a)):
            runner.round()
    return a.result(), b.result()


def paired_changes(before: Measurement, after: Measurement, metrics: Sequence[str] | None = None) -> dict[str, Any]:
    """Per metric, the paired change and its t interval over rounds (:class:`~fractal_opt.measure.noise.Interval`).

    Per-request metrics pair (request, round) samples, grouped by round; per-repeat metrics pair
    rounds. Pairs with a missing or non-positive value on either side are left out; a metric
    without pairs is absent.
    """
    from .noise import paired_interval

    out: dict[str, Any] = {}
    for metric in metrics or list(METRICS):
        logs: dict[int, list[float]] = {}
        if metric in PER_REPEAT:
            for r, (ra, rb) in enumerate(zip(before.repeats, after.repeats)):
                va, vb = ra.get(metric), rb.get(metric)
                if va is not None and vb is not None and va > 0 and vb > 0:
                    logs[r] = [math.log(vb / va)]
        else:
            first = {(s.request_id, s.repeat): getattr(s, metric) for s in before.samples}
            for s in after.samples:
                va, vb = first.get((s.request_id, s.repeat)), getattr(s, metric)
                if va is not None and vb is not None and va > 0 and vb > 0:
                    logs.setdefault(s.repeat, []).append(math.log(vb / va))
        interval = paired_interval(logs)
        if interval is not None:
            out[metric] = interval
    return out


def rounds_for(engine: Engine, workload: Workload, requests: Sequence[Request], *, clients: int | None = None) -> Rounds:
    """The source a workload asks for: its ``load`` profile through a server (the capacity search,
    conversations replayed turn by turn, or single requests), else the suite. Here, above every
    round source, so that none of them imports another's module. ``clients`` sets a closed load's
    offered clients (poisson arrivals keep their rate; the conversations' users and the capacity
    search's levels are the profile's own, whatever the plan)."""
    if getattr(workload, "load", None):
        if workload.load_profile().capacity:
            from .capacity_rounds import CapacityRounds

            return CapacityRounds(engine, workload, requests)
        if workload.load_profile().mode == "conversations":
            from .conversation_rounds import ConversationRounds

            return ConversationRounds(engine, workload, requests)
        return LoadRounds(engine, workload, requests, clients=clients)
    return SuiteRounds(engine, workload, requests)
