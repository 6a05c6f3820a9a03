"""One number of the final plan against the baseline, and how every report writes it.

A :class:`Figure` is one metric of the final confirmation at one offered load (:mod:`.reader`
finds it): the baseline's and the final plan's medians from the same rounds, the paired estimate
of the change with its 95% interval, the threshold the verdict used and the verdict. The words a
reader needs come with it: the change as a ratio when it is large ("5.78x"), else as a percentage,
its interval only when that bounds it (:func:`fractal_opt.core.text.interval_text`: "too few
rounds to bound" otherwise), and a status: ``confirmed`` (an objective that improved beyond
noise), ``better`` / ``worse beyond noise``, ``within noise`` or ``too few rounds to bound``.

Example:
    >>> f = Figure("decode_tokens_per_s", baseline=15.3, final=88.4, change=4.78, interval=(4.2, 5.41), band=0.28, verdict="better")
    >>> f.text(objective=True)
    'decode 15.3 -> 88.4 tokens/s per stream: 5.78x [95%: 5.20x, 6.41x], confirmed'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.text import UNBOUNDED, bounded, interval_text
from .svg import fmt_num, is_num

__all__ = ["NAMES", "Figure", "change_text", "name_of", "uses_ratio"]

# How a metric is named and in which unit its medians are written (trace.json's units).
NAMES: dict[str, tuple[str, str]] = {
    "decode_tokens_per_s": ("decode", "tokens/s per stream"),
    "throughput_tokens_per_s": ("throughput", "tokens/s"),
    "goodput_tokens_per_s": ("goodput", "tokens/s"),
    "ttft_ms": ("TTFT", "ms"),
    "ttft_ms_p50": ("TTFT p50", "ms"),
    "ttft_ms_p90": ("TTFT p90", "ms"),
    "ttft_ms_p99": ("TTFT p99", "ms"),
    "itl_ms_p50": ("ITL p50", "ms"),
    "itl_ms_p90": ("ITL p90", "ms"),
    "itl_ms_p99": ("ITL p99", "ms"),
    "e2e_ms": ("answer time", "ms"),
    "e2e_ms_p50": ("answer time p50", "ms"),
    "e2e_ms_p90": ("answer time p90", "ms"),
    "e2e_ms_p99": ("answer time p99", "ms"),
    "prefill_ms": ("prefill", "ms"),
    "capacity": ("capacity under the SLOs", ""),
    "cpu_s_per_1k_tokens": ("cost", "CPU-s per 1,000 tokens"),
    "usd_per_m_tokens": ("cost", "$ per 1,000 tokens"),
    "joules_per_token": ("energy", "J per token"),
    "weight_mb": ("weights", "MB"),
    "peak_memory_mb": ("peak memory", "MB"),
}
# Stored in another unit than the one written: $ per million tokens is written per 1,000.
_SCALE = {"usd_per_m_tokens": 1e-3}
# From +50% up (1.5x) or a ratio of 0.5x down, a change reads as "how many times": "5.78x", "0.44x".
_RATIO_FROM = 0.5


def name_of(metric: str) -> tuple[str, str]:
    """(name, unit) a report writes for ``metric``; the metric itself when it has no name here."""
    return NAMES.get(metric, (metric, ""))


def change_text(change: float) -> str:
    """``5.78x`` for a change of +50% or more (or a ratio of 0.5x or less), else ``+12.0%``."""
    ratio = 1 + change
    if change >= _RATIO_FROM or ratio <= 0.5:
        return f"{ratio:.2f}x"
    return f"{change:+.1%}"


def uses_ratio(change: float) -> bool:
    return change >= _RATIO_FROM or 1 + change <= 0.5


@dataclass(frozen=True)
class Figure:
    """One metric of the final plan against the baseline at one offered load (``clients``).

    ``path`` is where trace.json holds it under ``final`` (``confirmation.metrics.<metric>`` or
    ``confirmation.at_loads.<i>.metrics.<metric>``), so a page can tie each number to its source.
    """

    metric: str
    baseline: float | None
    final: float | None
    change: float | None  # the paired estimate (not the ratio of the medians), or a census figure's exact ratio
    interval: tuple[float, float] | None = None
    band: float | None = None
    verdict: str = ""  # better | worse | within noise
    clients: int | None = None
    path: str = ""
    census: bool = False  # an exact figure from the census (weights): no interval

    @classmethod
    def from_entry(cls, metric: str, entry: Mapping[str, Any], *, clients: int | None, path: str) -> Figure:
        """A confirmation's entry for ``metric`` (``confirmation.metrics.<metric>``)."""
        iv = entry.get("interval")
        interval = (float(iv[0]), float(iv[1])) if isinstance(iv, list | tuple) and len(iv) == 2 and all(is_num(x) for x in iv) else None
        census = entry.get("source") == "census"
        return cls(metric=metric, baseline=entry.get("baseline" if census else "baseline_median"), final=entry.get("final" if census else "final_median"),
                   change=entry.get("change"), interval=interval,
                   band=entry.get("band"), verdict=entry.get("verdict", ""), clients=clients, path=path, census=census)

    @property
    def bounded(self) -> bool:
        """Whether the interval bounds the change (a census figure is exact)."""
        if self.census:
            return True
        return self.interval is not None and is_num(self.change) and bounded(self.change, *self.interval)

    def status(self, *, objective: bool = False) -> str:
        """``confirmed`` / ``better beyond noise`` / ``worse beyond noise`` / ``within noise`` /
        ``too few rounds to bound``; an objective that improved beyond noise is ``confirmed``."""
        if not self.bounded:
            return "within noise" if self._inside_band() else UNBOUNDED
        if self.verdict == "better":
            return "confirmed" if objective else "better beyond noise"
        if self.verdict == "worse":
            return "worse beyond noise"
        return "within noise"

    def _inside_band(self) -> bool:
        """The whole interval lies inside the verdict's threshold: no change, whatever the estimate."""
        return self.interval is not None and is_num(self.band) and max(abs(self.interval[0]), abs(self.interval[1])) <= self.band

    def values(self) -> str:
        """``15.3 -> 88.4 tokens/s per stream`` (times of a second or more in seconds)."""
        b, a, unit = self.scaled()
        if self.metric == "usd_per_m_tokens":
            return f"${fmt_num(b)} -> ${fmt_num(a)} per 1,000 tokens"
        return f"{fmt_num(b)} -> {fmt_num(a)}" + (f" {unit}" if unit else "")

    def scaled(self) -> tuple[float | None, float | None, str]:
        """(baseline, final, unit) as written: $ per million tokens per 1,000, times of a second or more in seconds."""
        unit = name_of(self.metric)[1]
        scale = _SCALE.get(self.metric, 1.0)
        if unit == "ms" and max((abs(v) for v in (self.baseline, self.final) if is_num(v)), default=0.0) >= 1000:
            scale, unit = 1e-3, "s"
        b, a = (v * scale if is_num(v) else None for v in (self.baseline, self.final))
        return b, a, unit

    def change_words(self) -> str:
        """``5.78x [95%: 5.20x, 6.41x]``; the interval as :func:`~fractal_opt.core.text.interval_text`
        writes it (nothing when it does not bound the change: the status says so)."""
        if not is_num(self.change):
            return "–"
        head = change_text(self.change)
        if self.census:
            return f"{head} (census, exact)"
        if self.interval is None or not self.bounded:
            return head
        return f"{head} {interval_text(self.change, *self.interval, ratio=uses_ratio(self.change))}"

    def text(self, *, objective: bool = False, name: str | None = None) -> str:
        """``decode 15.3 -> 88.4 tokens/s per stream: 5.78x [95%: 5.20x, 6.41x], confirmed``."""
        status = "" if self.census else f", {self.status(objective=objective)}"
        return f"{name or name_of(self.metric)[0]} {self.values()}: {self.change_words()}{status}"
