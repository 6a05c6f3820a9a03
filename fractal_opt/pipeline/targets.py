"""Targets: the numbers a deployment must reach, the gap to each, and the limit that binds.

A recipe may name what it wants (``targets: {decode_tokens_per_s: 30, ttft_ms_p90: 800}``). The
baseline shows how far it is from each ("decode_tokens_per_s 7.9 vs 30: 3.8x short"), every
measured step shows what is left for the plan kept after it, the final report says which were
met (:mod:`fractal_opt.report.targets` writes it), and ``--stop-at-target`` ends a run once all are. A target no pass reached is explained by
the roofline of the final plan (``metrics["roofline"]``) against the machine's ceilings
(``trace.machine["limits"]``): how many bytes or FLOPs the target needs, and what this machine gives.

Directions come from the metric tables (:data:`fractal_opt.language.policy.ALL_METRICS`): higher is
better for tokens/s and accuracy, lower for latencies, memory and KL.

Example:
    >>> t = parse_targets({"decode_tokens_per_s": 30, "peak_memory_mb": 8000}, where="recipe: targets")
    >>> g = gaps(t, {"decode_tokens_per_s": 7.9, "peak_memory_mb": 900})
    >>> g["decode_tokens_per_s"]["text"], g["peak_memory_mb"]["met"]
    ('7.9 vs 30: 3.8x short', True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.text import fmt
from ..language.targets import Target, Targets, parse_targets

__all__ = ["Target", "Targets", "all_met", "binding_limit", "gaps", "note_targets", "parse_targets", "stop_reason"]


def _value(metrics: Mapping[str, Any], metric: str) -> float | None:
    v = metrics.get(metric)
    if v is None:
        v = (metrics.get("quality") or {}).get(metric)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def gaps(targets: Targets, metrics: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per target, how ``metrics`` (a step's or the final plan's) stand against it."""
    return {t.metric: t.gap(_value(metrics, t.metric)) for t in targets}


def all_met(targets_gaps: Mapping[str, Mapping[str, Any]]) -> bool:
    return bool(targets_gaps) and all(g.get("met") for g in targets_gaps.values())


# ---------------------------------------------------------------------------- the binding limit

def binding_limit(metric: str, target: float, metrics: Mapping[str, Any], limits: Mapping[str, Any] | None, *, dtype: str = "float32") -> str:
    """Why ``target`` is out of reach for a plan, with numbers: the roofline of the plan's
    measured step (``metrics["roofline"]``) against the machine's ceilings (``limits``)."""
    roof = metrics.get("roofline") or {}
    limits = limits or {}
    bandwidth = limits.get("bandwidth_bytes_per_s")
    flops = (limits.get("peak_flops") or {}).get(dtype) or (limits.get("peak_flops") or {}).get("float32")
    value = _value(metrics, metric)
    now = f"{fmt(value, whole=True)} now" if value is not None else "not measured"
    if metric in ("decode_tokens_per_s", "decode_ms_per_token", "throughput_tokens_per_s", "goodput_tokens_per_s", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99"):
        per_request = metric != "throughput_tokens_per_s" and metric != "goodput_tokens_per_s"
        rate = target if metric.endswith("tokens_per_s") else 1000.0 / target
        step_bytes = roof.get("bytes_per_decode_step") if per_request else roof.get("bytes_per_token")
        if not step_bytes or not bandwidth:
            return f"{metric}: {now}; no roofline numbers for this plan (no model config or no machine ceilings) to say which limit binds."
        needed = rate * step_bytes
        what = f"{fmt(rate, whole=True)} tokens/s" + ("" if metric.endswith("tokens_per_s") else f" ({metric} {fmt(target, whole=True)} ms)")
        head = (f"{what} needs {needed / 1e9:.1f} GB/s of weight and KV reads ({step_bytes / 1e9:.3f} GB per "
                f"{'decode step' if per_request else 'token at batch ' + str(roof.get('batch', 1))}, {dtype}); "
                f"this machine gives {bandwidth / 1e9:.1f} GB/s")
        if needed > bandwidth:
            fewer = "int8 or 4-bit weights, a GGUF runtime" if dtype in ("bfloat16", "float16") else "bfloat16, int8 weights, a GGUF runtime"
            if per_request:
                return head + f": fewer bytes per token ({fewer}) are the way there."
            return head + f": a larger batch (continuous batching, a concurrency ramp) or fewer bytes per token ({fewer}) are the way there."
        fraction = roof.get("bandwidth_fraction")
        used = f", {fraction:.0%} of it used now" if isinstance(fraction, int | float) else ""
        return (head + f"{used}: the bytes allow it, so overhead binds (Python, kernel launches, dequantization): "
                "compile, a GGUF runtime (llama.cpp) or fewer, larger steps (batching) are the way there.")
    if metric in ("ttft_ms", "prefill_ms") or metric.startswith("ttft_ms_p"):
        f_prefill = roof.get("prefill_flops")
        if not f_prefill or not flops:
            return f"{metric}: {now}; no roofline numbers for this plan to say which limit binds."
        best_ms = f_prefill / flops * 1000
        head = (f"the median prompt's prefill is {f_prefill / 1e9:.1f} GFLOP; this machine's "
                f"{flops / 1e9:.0f} GFLOP/s ({dtype}) makes it {best_ms:.0f} ms at best")
        if best_ms > target:
            return head + f", over the {fmt(target, whole=True)} ms target: shorter prompts (a prompt budget, a prefix cache) or faster matmuls (bfloat16 on hardware with bf16 units) are the way there."
        return head + f" ({now}): queueing and overhead bind, not compute: batching that does not hold new requests back, fewer concurrent clients, compile."
    if metric in ("peak_memory_mb", "weight_mb", "memory_headroom_mb"):
        weights = _value(metrics, "weight_mb")
        w = f"the weights alone are {weights:.0f} MB" if weights else "the weights' size is unknown"
        return f"{metric}: {now} against {fmt(target, whole=True)} MB; {w}: fewer bytes per weight (int8, 4-bit), KV-cache bits, a context cap and a smaller batch are the way there."
    return f"{metric}: {now} against {fmt(target, whole=True)}; no roofline rule for this metric, so no binding limit can be named."


# ---------------------------------------------------------------------------- the runner's hook

def note_targets(trace: Any, step: Any = None) -> None:
    """Store the gaps of the plan kept now (``trace.final["metrics"]``) in ``trace.final["targets"]``,
    each unmet one with its binding limit, and in ``step.metrics["targets"]`` when the step was
    measured (what is left after it). Nothing when the recipe names no targets."""
    targets = parse_targets(trace.recipe.get("targets"))
    final = trace.final
    if not targets or not final:
        return
    now = final.get("metrics") or {}
    left = gaps(targets, now)
    kept = next((s for s in reversed(trace.steps) if s.status == "kept"), trace.baseline)
    measured = {**now, "roofline": (kept.metrics.get("roofline") if kept is not None else None) or {}}
    dtype = ((final.get("plan") or {}).get("hardware") or {}).get("dtype") or "float32"
    if step is not None and step.metrics:
        step.metrics["targets"] = {m: dict(g) for m, g in left.items()}
    for metric, g in left.items():
        if not g["met"]:
            g["binding"] = binding_limit(metric, g["target"], measured, trace.machine.get("limits"), dtype=dtype)
    final["targets"] = left


def stop_reason(trace: Any) -> str | None:
    """``--stop-at-target``: why the remaining steps are skipped (every target met), else None."""
    left = (trace.final or {}).get("targets") or {}
    if not all_met(left):
        return None
    return "stop-at-target: every target is met (" + "; ".join(f"{m} {g['text']}" for m, g in left.items()) + ")"
