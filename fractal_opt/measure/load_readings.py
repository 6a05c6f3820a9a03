"""What one load round's records read as: the round's readings and counts, and each finished request
as the Generation a Sample is made from. Shared by every round source that serves through a load
(single requests, conversations, the capacity search)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .metrics import PERCENTILE_METRICS

if TYPE_CHECKING:
    from ..engine.protocol import Generation
    from .load import LoadRecord, LoadResult

__all__ = ["as_generation", "load_readings"]


def load_readings(result: LoadResult) -> tuple[dict[str, Any], dict[str, Any]]:
    """A load round's readings (percentiles as callers saw them, counts, goodput) and its counts."""
    summary = result.summary()
    counts = {k: summary[k] for k in ("requests", "done", "timeout", "cancelled", "rejected", "error", "output_tokens", "slo_met") if k in summary}
    readings: dict[str, Any] = {k: summary[k] for k in PERCENTILE_METRICS}  # as callers saw them (LoadResult.summary)
    readings["load"] = counts
    readings["goodput_tokens_per_s"] = summary.get("goodput_tokens_per_s")  # None unless the profile sets an SLO
    return readings, counts


def as_generation(rec: LoadRecord) -> Generation:
    """A load record as the Generation a Sample is made from (the caller replaces TTFT with its own)."""
    from ..engine.protocol import Generation

    return Generation(request_id=rec.id, text=rec.text, token_ids=rec.token_ids, prompt_tokens=rec.prompt_tokens, t_submit=rec.t_submit,
                      t_prefill_start=rec.t_start if rec.t_start is not None else rec.t_submit, token_times=rec.token_times,
                      hit_cap=len(rec.token_ids) >= rec.max_new_tokens, cache_hit=rec.cache_hit, prompt_tokens_saved=rec.prompt_tokens_saved)
