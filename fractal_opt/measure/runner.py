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
- ``itl_ms_p50/p90/p99``: inter-token latency, the gaps between consecutive tokens of a request
  (first token excluded), pooled over all requests; ``ttft_ms_p*`` and ``e2e_ms_p*`` likewise.
- ``prefill_tokens_per_s``: prompt tokens / prefill time, per request.
- ``throughput_tokens_per_s``: all output tokens of a pass over the suite / its wall time, served
  as the plan schedules them (one by one, or in batches).
- ``peak_memory_mb``: peak resident set size during the measured work (Linux VmHWM, reset before
  the work; a sampler elsewhere), or CUDA max allocated on a GPU (:mod:`fractal_opt.memory`).
- ``memory_headroom_mb``: device capacity minus ``peak_memory_mb``.
- ``cpu_utilization``: process CPU time / wall time / torch threads (1.0 = every thread busy).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .memory import GpuMonitor, MemoryWindow

if TYPE_CHECKING:
    from ..engine.protocol import Engine, Generation
    from ..workload import Request, Workload

__all__ = ["METRICS", "Measurement", "Sample", "compare", "measure", "measure_pair", "paired_changes"]

# metric -> True when higher is better. The order is the report's column order.
METRICS: dict[str, bool] = {
    "decode_tokens_per_s": True,
    "ttft_ms": False,
    "prefill_ms": False,
    "e2e_ms": False,
    "throughput_tokens_per_s": True,
    "goodput_tokens_per_s": True,
    "decode_ms_per_token": False,
    "peak_memory_mb": False,
    "new_tokens": False,
    "cpu_utilization": True,
    "prefill_tokens_per_s": True,
    "memory_headroom_mb": True,
    "ttft_ms_p50": False,
    "ttft_ms_p90": False,
    "ttft_ms_p99": False,
    "itl_ms_p50": False,
    "itl_ms_p90": False,
    "itl_ms_p99": False,
    "e2e_ms_p50": False,
    "e2e_ms_p90": False,
    "e2e_ms_p99": False,
}
# Metrics that describe work done rather than speed; they are reported, never an objective by default.
PER_REQUEST = ("decode_tokens_per_s", "ttft_ms", "prefill_ms", "e2e_ms", "decode_ms_per_token", "new_tokens", "prefill_tokens_per_s")
PERCENTILES = (50, 90, 99)
# Percentiles are computed over the tokens/requests of each round (for paired comparisons) and
# pooled over all rounds (for the summary).
PERCENTILE_METRICS = tuple(f"{m}_p{q}" for m in ("ttft_ms", "itl_ms", "e2e_ms") for q in PERCENTILES)
PER_REPEAT = ("throughput_tokens_per_s", "goodput_tokens_per_s", "peak_memory_mb", "cpu_utilization", "memory_headroom_mb", *PERCENTILE_METRICS)


@dataclass(frozen=True)
class Sample:
    """One request served once."""

    request_id: str
    prompt_tokens: int
    new_tokens: int
    ttft_ms: float | None  # None when the tokens could not be clocked (beam search)
    prefill_ms: float | None
    e2e_ms: float
    decode_tokens_per_s: float | None  # None when fewer than 2 tokens were generated, or not clocked
    hit_cap: bool
    repeat: int = 0  # the round (pass over the suite) this sample belongs to
    itl_ms: tuple[float, ...] = ()  # gaps between consecutive tokens (ms), first token excluded
    cache_hit: str | None = None  # "exact" / "semantic" when the response cache answered
    prompt_tokens_saved: int = 0  # prompt tokens removed by the plan's prompt budget

    @property
    def decode_ms_per_token(self) -> float | None:
        return 1000.0 / self.decode_tokens_per_s if self.decode_tokens_per_s else None

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.prompt_tokens / (self.prefill_ms / 1000) if self.prefill_ms else None

    @classmethod
    def from_generation(cls, g: Generation, *, repeat: int = 0) -> Sample:
        app = {"cache_hit": getattr(g, "cache_hit", None), "prompt_tokens_saved": getattr(g, "prompt_tokens_saved", 0)}
        if not getattr(g, "streamed", True):
            # Beam search cannot use a streamer: only the end-to-end time is known.
            return cls(request_id=g.request_id, prompt_tokens=g.prompt_tokens, new_tokens=g.new_tokens, ttft_ms=None, prefill_ms=None,
                       e2e_ms=(g.t_done - g.t_submit) * 1000, decode_tokens_per_s=None, hit_cap=g.hit_cap, repeat=repeat, **app)
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
            repeat=repeat,
            itl_ms=tuple((b - a) * 1000 for a, b in zip(g.token_times, g.token_times[1:])),
            **app,
        )


@dataclass
class Measurement:
    """All samples of one measurement of one plan, plus per-repeat machine readings."""

    samples: list[Sample]
    repeats: list[dict[str, float]]  # per repeat: PER_REPEAT metrics and wall_s
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

    def pooled(self, metric: str) -> float | None:
        """A percentile metric (``itl_ms_p99``) over every request / token gap of every round."""
        base, q = metric.rsplit("_p", 1)
        if base == "itl_ms":
            vals = [gap for s in self.samples for gap in s.itl_ms]
        else:
            vals = [float(getattr(s, base)) for s in self.samples if getattr(s, base) is not None]
        return percentile(vals, float(q))

    def summary(self) -> dict[str, float | None]:
        """Median of every metric (percentiles pooled over all rounds), as trace.json stores it."""
        out: dict[str, float | None] = {m: _round(self.pooled(m) if m in PERCENTILE_METRICS else self.median(m)) for m in METRICS}
        out["hit_cap"] = sum(1 for s in self.samples if s.hit_cap) / max(1, len(self.samples))
        # Application-layer work (docs/metrics.md): share answered by the response cache, and
        # prompt tokens the prompt budget removed, per request on average.
        out["cache_hit_rate"] = round(sum(1 for s in self.samples if s.cache_hit) / max(1, len(self.samples)), 4)
        out["prompt_tokens_saved"] = round(sum(s.prompt_tokens_saved for s in self.samples) / max(1, len(self.samples)), 1)
        return out

    def spreads(self) -> dict[str, float]:
        return {m: round(self.spread(m), 4) for m in METRICS}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


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


# --------------------------------------------------------------------------- the measurement


class _Runner:
    """Serves the suite for one engine, one timed round at a time (the pieces measure() and
    measure_pair() share)."""

    def __init__(self, engine: Engine, workload: Workload, requests: Sequence[Request]):
        import torch

        self.engine = engine
        self.workload = workload
        self.requests = list(requests)
        self.device = str(engine.model.device)
        self.sync = torch.cuda.synchronize if self.device.startswith("cuda") else None
        machine = engine.machine
        self.capacity_mb = machine.device_memory_bytes(self.device) / 2**20 if machine is not None and machine.device_memory_bytes(self.device) else None
        self.samples: list[Sample] = []
        self.repeats: list[dict[str, float]] = []
        self.outputs: dict[str, list[int]] = {}
        self.texts: dict[str, str] = {}
        self.warmup_s = 0.0
        self.memory_source = "rss"
        self.gpu: dict[str, Any] = {}

    def warm_up(self) -> None:
        # The whole suite with a short budget, so every prompt shape has been through the kernels
        # (oneDNN primitive caches, allocator growth, torch.compile) before the clock runs.
        t0 = time.perf_counter()
        for _ in range(self.workload.warmup):
            _reset_response_cache(self.engine)
            self.engine.serve(self.requests, max_new_tokens=min(8, self.workload.max_new_tokens), seed=self.workload.seed, sync=self.sync)
        self.warmup_s += time.perf_counter() - t0

    def round(self) -> None:
        r = len(self.repeats)
        cpu0 = os.times()
        with MemoryWindow(self.device) as mem, GpuMonitor(self.device) as gpu:
            _reset_response_cache(self.engine)  # every round starts cold: hits come from repeats within the suite
            w0 = time.perf_counter()
            gens = self.engine.serve(self.requests, max_new_tokens=self.workload.max_new_tokens, seed=self.workload.seed, sync=self.sync)
            wall = time.perf_counter() - w0
        cpu1 = os.times()
        cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        samples = [Sample.from_generation(g, repeat=r) for g in gens]
        tokens = sum(g.new_tokens for g in gens)
        row: dict[str, Any] = {
            "throughput_tokens_per_s": tokens / wall,
            "peak_memory_mb": mem.peak_mb,
            "cpu_utilization": cpu_s / wall / _plan_threads(self.engine),
            "memory_headroom_mb": self.capacity_mb - mem.peak_mb if self.capacity_mb and mem.peak_mb is not None else None,
            "wall_s": wall,
        }
        round_m = Measurement(samples=samples, repeats=[], outputs={}, texts={})
        row.update({m: round_m.pooled(m) for m in PERCENTILE_METRICS})
        if mem.cuda_reserved_mb is not None:
            row["cuda_max_reserved_mb"] = mem.cuda_reserved_mb
        g = gpu.result()
        if g["energy_j"] is not None and tokens:
            g["energy_j_per_token"] = g["energy_j"] / tokens
        self.gpu = g
        self.repeats.append(row)
        self.samples.extend(samples)
        self.memory_source = mem.source
        if r == 0:
            self.outputs = {g.request_id: g.token_ids for g in gens}
            self.texts = {g.request_id: g.text for g in gens}

    def result(self) -> Measurement:
        extra: dict[str, Any] = {"gpu": self.gpu or {"status": "unavailable: not measured"}}
        reserved = [r["cuda_max_reserved_mb"] for r in self.repeats if "cuda_max_reserved_mb" in r]
        if reserved:
            extra["cuda_max_reserved_mb"] = max(reserved)
        if self.capacity_mb:
            extra["capacity_mb"] = round(self.capacity_mb, 1)
        return Measurement(samples=self.samples, repeats=self.repeats, outputs=self.outputs, texts=self.texts, warmup_s=self.warmup_s, memory_source=self.memory_source, extra=extra)


def _runner(engine: Engine, workload: Workload, requests: Sequence[Request]) -> Any:
    """The round runner for a workload: with a ``load`` profile, rounds run that load through a
    server (:class:`fractal_opt.load.LoadRunner`, same warm_up/round/result protocol); without
    one, the suite is served synchronously."""
    if getattr(workload, "load", None):
        from .load import LoadRunner

        return LoadRunner(engine, workload, requests)
    return _Runner(engine, workload, requests)


def measure(
    engine: Engine,
    workload: Workload,
    *,
    requests: Sequence[Request] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Measurement:
    """Warm up, then serve the suite ``workload.repeats`` times and collect every sample."""
    runner = _runner(engine, workload, requests if requests is not None else workload.requests())
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
) -> tuple[Measurement, Measurement]:
    """Measure two engines interleaved, round by round, so drift hits both alike.

    Rounds alternate the order A B, B A, A B, ... (each round serves the whole suite once per
    engine; alternating cancels a linear drift within a pair as well as between pairs). After
    ``workload.repeats`` rounds, rounds are added while the bootstrap interval of ``objective`` is
    not :func:`~fractal_opt.noise.settled`, up to ``workload.max_repeats``. ``previous`` may be the
    same engine as ``candidate`` (the A/A calibration).
    """
    from .noise import settled

    reqs = list(requests if requests is not None else workload.requests())
    a, b = _runner(previous, workload, reqs), _runner(candidate, workload, reqs)
    if warm_previous:
        a.warm_up()
    b.warm_up()
    budget = max(workload.repeats, getattr(workload, "max_repeats", None) or workload.repeats)
    for r in range(budget):
        if r >= workload.repeats:
            interval = paired_changes(a.result(), b.result(), [objective]).get(objective)
            if settled(interval, min_effect=min_effect):
                break
        if progress:
            progress(f"round {r + 1}/{workload.repeats}" + (f" (extended, at most {budget})" if r >= workload.repeats else ""))
        for runner in ((a, b) if r % 2 == 0 else (b, a)):
            runner.round()
    return a.result(), b.result()


def paired_changes(before: Measurement, after: Measurement, metrics: Sequence[str] | None = None) -> dict[str, Any]:
    """Per metric, the paired change and its bootstrap interval (:class:`~fractal_opt.noise.Interval`).

    Per-request metrics pair (request, round) samples; per-repeat metrics pair rounds. Pairs with
    a missing or non-positive value on either side are left out.
    """
    from .noise import paired_interval

    out: dict[str, Any] = {}
    for metric in metrics or list(METRICS):
        logs: dict[str, list[float]] = {}
        if metric in PER_REPEAT:
            for ra, rb in zip(before.repeats, after.repeats):
                va, vb = ra.get(metric), rb.get(metric)
                if va is not None and vb is not None and va > 0 and vb > 0:
                    logs.setdefault("rounds", []).append(math.log(vb / va))
        else:
            first = {(s.request_id, s.repeat): getattr(s, metric) for s in before.samples}
            for s in after.samples:
                va, vb = first.get((s.request_id, s.repeat)), getattr(s, metric)
                if va is not None and vb is not None and va > 0 and vb > 0:
                    logs.setdefault(s.request_id, []).append(math.log(vb / va))
        interval = paired_interval(logs)
        if interval is not None:
            out[metric] = interval
    return out


def _plan_threads(engine: Engine) -> int:
    """The intra-op threads the plan ran with (what cpu_utilization divides by)."""
    import torch

    threads = engine.plan.hardware.threads
    if isinstance(threads, int):
        return threads
    if threads == "auto" and engine.machine is not None:
        return engine.machine.physical_cores
    return max(1, torch.get_num_threads())


def _reset_response_cache(engine: Any) -> None:
    """Empty the engine's response cache, if it has one (test fakes may not)."""
    reset = getattr(engine, "reset_response_cache", None)
    if reset is not None:
        reset()
