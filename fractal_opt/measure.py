"""The performance budget: every timing rule lives here and nowhere else.

Rules: warm-up requests are run and excluded; the device is synchronized before every clock read
(``sync``); clocks are ``time.perf_counter`` (monotonic); each measurement repeats the whole suite
and reports medians with their spread; comparisons are paired per request.

Definitions (docs/metrics.md has the long form):
- ``prefill_ms``: from generate() handing the prompt to the streamer to the first new token.
- ``ttft_ms``: from the request being submitted to the engine to the first new token
  (tokenization, batching wait and prefill included).
- ``decode_tokens_per_s``: (n - 1) / (t_last - t_first) for n generated tokens; the first token
  is excluded because it belongs to prefill. ``decode_ms_per_token`` is its inverse.
- ``e2e_ms``: submit to the last token.
- ``throughput_tokens_per_s``: all output tokens of a pass over the suite / its wall time, served
  as the plan schedules them (one by one, or in batches).
- ``peak_memory_mb``: peak resident set size during the measured work (Linux VmHWM, reset before
  the work), or CUDA max allocated on a GPU.
- ``cpu_utilization``: process CPU time / wall time / torch threads (1.0 = every thread busy).
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine, Generation
    from .workload import Request, Workload

__all__ = ["METRICS", "Measurement", "Sample", "TokenClock", "compare", "measure"]

# metric -> True when higher is better. The order is the report's column order.
METRICS: dict[str, bool] = {
    "decode_tokens_per_s": True,
    "ttft_ms": False,
    "prefill_ms": False,
    "e2e_ms": False,
    "throughput_tokens_per_s": True,
    "decode_ms_per_token": False,
    "peak_memory_mb": False,
    "new_tokens": False,
    "cpu_utilization": True,
}
# Metrics that describe work done rather than speed; they are reported, never an objective by default.
PER_REQUEST = ("decode_tokens_per_s", "ttft_ms", "prefill_ms", "e2e_ms", "decode_ms_per_token", "new_tokens")
PER_REPEAT = ("throughput_tokens_per_s", "peak_memory_mb", "cpu_utilization")


class TokenClock:
    """A generate() streamer that only reads the clock: once for the prompt, once per new token.

    transformers calls ``put`` with the prompt ids first, then with each step's new token(s)
    (one per batch row), and ``end`` when done. ``sync`` (e.g. ``torch.cuda.synchronize``) runs
    before every reading so that asynchronous devices are timed when the work is really done.
    """

    def __init__(self, *, sync: Callable[[], None] | None = None):
        self.sync = sync
        self.prompt_time: float | None = None
        self.token_times: list[float] = []

    def put(self, value: Any) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        if self.prompt_time is None:
            self.prompt_time = now
        else:
            self.token_times.append(now)

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class Sample:
    """One request served once."""

    request_id: str
    prompt_tokens: int
    new_tokens: int
    ttft_ms: float
    prefill_ms: float
    e2e_ms: float
    decode_tokens_per_s: float | None  # None when fewer than 2 tokens were generated
    hit_cap: bool

    @property
    def decode_ms_per_token(self) -> float | None:
        return 1000.0 / self.decode_tokens_per_s if self.decode_tokens_per_s else None

    @classmethod
    def from_generation(cls, g: Generation) -> Sample:
        first = g.token_times[0] if g.token_times else g.t_prefill_start
        last = g.token_times[-1] if g.token_times else first
        n = len(g.token_times)
        decode = (n - 1) / (last - first) if n >= 2 and last > first else None
        return cls(
            request_id=g.request_id,
            prompt_tokens=g.prompt_tokens,
            new_tokens=g.new_tokens,
            ttft_ms=(first - g.t_submit) * 1000,
            prefill_ms=(first - g.t_prefill_start) * 1000,
            e2e_ms=(last - g.t_submit) * 1000,
            decode_tokens_per_s=decode,
            hit_cap=g.hit_cap,
        )


@dataclass
class Measurement:
    """All samples of one measurement of one plan, plus per-repeat machine readings."""

    samples: list[Sample]
    repeats: list[dict[str, float]]  # per repeat: throughput_tokens_per_s, peak_memory_mb, cpu_utilization, wall_s
    outputs: dict[str, list[int]]  # request id -> generated token ids (first repeat), for agreement
    texts: dict[str, str]
    warmup_s: float = 0.0  # untimed warm-up (compile, caches), shown but excluded
    memory_source: str = "rss"
    extra: dict[str, Any] = field(default_factory=dict)

    def per_request(self, metric: str) -> dict[str, float]:
        """Median over repeats of ``metric`` for every request (requests with no value left out)."""
        values: dict[str, list[float]] = {}
        for s in self.samples:
            v = getattr(s, metric)
            if v is not None:
                values.setdefault(s.request_id, []).append(float(v))
        return {rid: statistics.median(vs) for rid, vs in values.items()}

    def values(self, metric: str) -> list[float]:
        """The raw readings behind a metric (per sample, or per repeat)."""
        if metric in PER_REPEAT:
            return [r[metric] for r in self.repeats if r.get(metric) is not None]
        return [float(getattr(s, metric)) for s in self.samples if getattr(s, metric) is not None]

    def median(self, metric: str) -> float | None:
        if metric in PER_REPEAT:
            vals = self.values(metric)
        else:
            vals = list(self.per_request(metric).values())
        return statistics.median(vals) if vals else None

    def spread(self, metric: str) -> float:
        """Relative within-measurement noise of a metric: the median over requests (or repeats)
        of half the range across repeats divided by the median. 0 with a single repeat."""
        if metric in PER_REPEAT:
            vals = self.values(metric)
            return _half_range(vals)
        by_req: dict[str, list[float]] = {}
        for s in self.samples:
            v = getattr(s, metric)
            if v is not None:
                by_req.setdefault(s.request_id, []).append(float(v))
        spreads = [_half_range(vs) for vs in by_req.values()]
        return statistics.median(spreads) if spreads else 0.0

    def summary(self) -> dict[str, float | None]:
        """Median of every metric, as trace.json stores it."""
        out: dict[str, float | None] = {m: _round(self.median(m)) for m in METRICS}
        out["hit_cap"] = sum(1 for s in self.samples if s.hit_cap) / max(1, len(self.samples))
        return out

    def spreads(self) -> dict[str, float]:
        return {m: round(self.spread(m), 4) for m in METRICS}


def _half_range(vals: Sequence[float]) -> float:
    if len(vals) < 2:
        return 0.0
    mid = statistics.median(vals)
    return (max(vals) - min(vals)) / 2 / abs(mid) if mid else 0.0


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def compare(before: Measurement, after: Measurement, metric: str) -> float | None:
    """Relative change of ``metric`` from ``before`` to ``after`` (+0.10 = 10% larger).

    Per-request metrics are compared pairwise: the geometric mean over requests of
    after/before, so a short and a long prompt weigh the same. Per-repeat metrics compare medians.
    """
    if metric in PER_REPEAT:
        b, a = before.median(metric), after.median(metric)
        if not b or a is None:
            return None
        return a / b - 1
    b_req, a_req = before.per_request(metric), after.per_request(metric)
    logs = [math.log(a_req[r] / b_req[r]) for r in b_req if r in a_req and b_req[r] > 0 and a_req[r] > 0]
    if not logs:
        return None
    return math.exp(statistics.fmean(logs)) - 1


# --------------------------------------------------------------------------- memory / CPU


class _MemoryWindow:
    """Peak memory during a block: CUDA max allocated, else Linux VmHWM reset at entry, else
    ru_maxrss (which cannot be reset: then the peak is since process start)."""

    def __init__(self, device: str):
        self.device = device
        self.peak_mb: float | None = None
        self.source = "rss"

    def __enter__(self) -> _MemoryWindow:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats()
            self.source = "cuda_max_allocated"
        else:
            self.source = "vmhwm" if _reset_hwm() else "ru_maxrss"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.startswith("cuda"):
            import torch

            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20
        elif self.source == "vmhwm":
            self.peak_mb = _read_hwm_kb() / 1024
        else:
            self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_hwm() -> bool:
    # Writing 5 to clear_refs resets the peak-RSS counter (VmHWM) of this process (Linux >= 4.0).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _read_hwm_kb() > 0
    except OSError:
        return False


def _read_hwm_kb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return float(line.split()[1])
    return 0.0


# --------------------------------------------------------------------------- the measurement


def measure(
    engine: Engine,
    workload: Workload,
    *,
    requests: Sequence[Request] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Measurement:
    """Warm up, then serve the suite ``workload.repeats`` times and collect every sample."""
    import torch

    requests = list(requests if requests is not None else workload.requests())
    device = str(engine.model.device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    t0 = time.perf_counter()
    # Warm-up: the whole suite with a short budget, so every prompt shape has been through the
    # kernels (oneDNN primitive caches, allocator growth, torch.compile) before the clock runs.
    for _ in range(workload.warmup):
        engine.serve(requests, max_new_tokens=min(8, workload.max_new_tokens), seed=workload.seed, sync=sync)
    warmup_s = time.perf_counter() - t0
    samples: list[Sample] = []
    repeats: list[dict[str, float]] = []
    outputs: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    for r in range(workload.repeats):
        if progress:
            progress(f"repeat {r + 1}/{workload.repeats}")
        cpu0 = os.times()
        with _MemoryWindow(device) as mem:
            w0 = time.perf_counter()
            gens = engine.serve(requests, max_new_tokens=workload.max_new_tokens, seed=workload.seed, sync=sync)
            wall = time.perf_counter() - w0
        cpu1 = os.times()
        n_threads = _plan_threads(engine)
        cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        repeats.append(
            {
                "throughput_tokens_per_s": sum(g.new_tokens for g in gens) / wall,
                "peak_memory_mb": mem.peak_mb,
                "cpu_utilization": cpu_s / wall / n_threads,
                "wall_s": wall,
            }
        )
        samples.extend(Sample.from_generation(g) for g in gens)
        if r == 0:
            outputs = {g.request_id: g.token_ids for g in gens}
            texts = {g.request_id: g.text for g in gens}
    return Measurement(samples=samples, repeats=repeats, outputs=outputs, texts=texts, warmup_s=warmup_s, memory_source=mem.source)


def _plan_threads(engine: Engine) -> int:
    """The intra-op threads the plan ran with (what cpu_utilization divides by)."""
    import torch

    threads = engine.plan.hardware.threads
    if isinstance(threads, int):
        return threads
    if threads == "auto" and engine.machine is not None:
        return engine.machine.physical_cores
    return max(1, torch.get_num_threads())


def noise_bands(before: Measurement, after: Measurement, calibration: dict[str, float], *, min_effect: float) -> dict[str, float]:
    """The relative change each metric must exceed to count as a change.

    band = max(min_effect, 2 × |A/A change| of the calibration, spread(before) + spread(after)),
    where spread is the half-range across repeats relative to the median (see
    :meth:`Measurement.spread`). The A/A term catches drift between measurements; the spread term
    catches noise within them.
    """
    return {m: round(max(min_effect, 2 * abs(calibration.get(m) or 0.0), before.spread(m) + after.spread(m)), 4) for m in METRICS}
