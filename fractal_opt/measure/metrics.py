"""The metrics of a measurement: what each number means and how samples become medians.

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
- ``throughput_tokens_per_s``: all output tokens of a round / its wall time, served as the plan
  schedules them (one by one, in batches, or under a load profile).
- ``peak_memory_mb``: peak resident set size during the measured work (Linux VmHWM, reset before
  the work; a sampler elsewhere), or CUDA max allocated on a GPU (:mod:`fractal_opt.measure.memory`).
- ``memory_headroom_mb``: device capacity minus ``peak_memory_mb``.
- ``cpu_utilization``: process CPU time / wall time / the plan's threads (1.0 = every thread busy).
- ``capacity``: the highest offered load meeting the load profile's SLOs (``load: {capacity: true}``,
  :mod:`fractal_opt.measure.capacity`), per round.
- ``cpu_s_per_1k_tokens`` / ``usd_per_m_tokens`` / ``joules_per_token``: the cost per token of a
  round (:mod:`fractal_opt.measure.cost`): CPU-seconds, the machine's price for the wall time when
  the recipe states it, energy where counters are readable.

The formulas of a round's machine readings (:func:`round_readings`) live here too, so every way
of producing a round (the suite, a load profile) reports them alike.

Example:
    >>> s = Sample(request_id="r", prompt_tokens=10, new_tokens=5, ttft_ms=50.0, prefill_ms=40.0,
    ...            e2e_ms=250.0, decode_tokens_per_s=20.0, hit_cap=True)
    >>> Measurement(samples=[s], repeats=[], outputs={}, texts={}).median("decode_ms_per_token")
    50.0
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core.machine import Machine
    from ..engine.protocol import Generation

__all__ = ["COST_METRICS", "METRICS", "PERCENTILE_METRICS", "PER_REPEAT", "Measurement", "Sample", "capacity_mb", "percentile", "round_readings"]

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
    "cpu_s_per_1k_tokens": False,
    "usd_per_m_tokens": False,
    "joules_per_token": False,
    "capacity": True,
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
PERCENTILES = (50, 90, 99)
# Percentiles are computed over the tokens/requests of each round (for paired comparisons) and
# pooled over all rounds (for the summary).
PERCENTILE_METRICS = tuple(f"{m}_p{q}" for m in ("ttft_ms", "itl_ms", "e2e_ms") for q in PERCENTILES)
COST_METRICS = ("cpu_s_per_1k_tokens", "usd_per_m_tokens", "joules_per_token")  # per round (fractal_opt.measure.cost)
PER_REPEAT = ("throughput_tokens_per_s", "goodput_tokens_per_s", "capacity", "peak_memory_mb", "cpu_utilization", "memory_headroom_mb", *COST_METRICS, *PERCENTILE_METRICS)


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


def capacity_mb(machine: Machine | None, device: str) -> float | None:
    """The memory capacity of ``device`` in MiB (None when the machine is unknown or reports none)."""
    if machine is None or not machine.device_memory_bytes(device):
        return None
    return machine.device_memory_bytes(device) / 2**20


def round_readings(*, output_tokens: int, wall_s: float, cpu_s: float, threads: int, peak_mb: float | None, capacity: float | None) -> dict[str, Any]:
    """A round's per-repeat machine readings: aggregate tokens/s, peak memory, CPU utilization
    (CPU seconds / wall seconds / threads) and headroom (capacity minus peak), with ``wall_s``.

    Example:
        >>> round_readings(output_tokens=100, wall_s=2.0, cpu_s=1.0, threads=2, peak_mb=300.0, capacity=1000.0)["cpu_utilization"]
        0.25
    """
    return {
        "throughput_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "peak_memory_mb": peak_mb,
        "cpu_utilization": cpu_s / wall_s / threads if wall_s > 0 else None,
        "memory_headroom_mb": capacity - peak_mb if capacity and peak_mb is not None else None,
        "wall_s": wall_s,
    }
