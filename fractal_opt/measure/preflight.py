"""The pre-flight: will a plan's weights and KV cache fit in the device, before anything loads?

Pure arithmetic on the model's shape (:class:`~fractal_opt.measure.roofline.ModelShape`, read
from its config) and the plan: weights at the plan's dtype and weight bits, plus the KV cache the
plan will really allocate, which is not always what the requests use:

- a static cache (``kv_cache: static``, or a compiled decode step, which runs on one) is
  allocated whole for every sequence of the batch: ``context_cap`` tokens when the plan sets a
  cap, else the requests' prompt + new tokens;
- a paged cache with a set size (continuous batching's ``num_blocks``) holds
  ``num_blocks x page_size`` tokens, however few the requests;
- a dynamic cache grows to the requests' prompt + new tokens (at most ``context_cap``) per
  sequence; a quantized one stores ``kv_bits`` per value plus its scales; an offloaded one keeps
  two layers on the device (the one computing, the one being fetched).

The pipeline refuses a step whose numbers exceed the device (the reason names them and says how
the cache was sized) and decides from them whether two models can be measured side by side.

Example:
    >>> shape = ModelShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
    ...                    intermediate=1536, vocab=49152, tied_embeddings=True)
    >>> from fractal_opt.tower.plan import Plan
    >>> reason, numbers = preflight(Plan(source="x"), shape, context=1024, n_requests=4, capacity_bytes=16 * 10**9)
    >>> reason is None, numbers["batch"], numbers["kv_tokens"]
    (True, 1, 1024)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .roofline import ModelShape, dtype_bits, kv_bytes_per_token, quantized_kv_bytes_per_token, weight_bytes

if TYPE_CHECKING:
    from ..tower.plan import Plan

__all__ = ["batch_size", "kv_allocation", "preflight"]

# A quantized KV cache's default bits (transformers' QuantizedCache nbits) when the plan sets none.
_DEFAULT_KV_BITS = 4
# Layers an offloaded cache keeps on the device: the one computing and the next, prefetched.
_OFFLOADED_LAYERS = 2


def batch_size(plan: Plan, n_requests: int) -> int:
    """How many sequences the plan decodes at once over ``n_requests`` requests (1 when sequential)."""
    sched = plan.scheduling
    if sched.batching == "sequential":
        return 1
    size = sched.batch_size if sched.batching == "static" else (getattr(sched, "max_concurrency", None) or n_requests)
    return max(1, min(size, n_requests))


def kv_allocation(plan: Plan, *, context: int, batch: int) -> tuple[int, str]:
    """(tokens the plan's KV cache allocates in all, how that was sized) for requests of up to
    ``context`` tokens decoded ``batch`` at a time."""
    m, s = plan.model, plan.scheduling
    if m.kv_cache == "off":
        return 0, "no KV cache"
    if s.batching == "continuous" and s.cb_num_blocks is not None:
        return s.cb_num_blocks * s.cb_page_size, f"paged cache: {s.cb_num_blocks:,} blocks x {s.cb_page_size} tokens"
    if m.kv_cache == "static" or plan.hardware.compile is not None:
        why = "static cache" if m.kv_cache == "static" else "static cache (a compiled decode step needs one)"
        if m.context_cap is not None:
            return m.context_cap * batch, f"{why}: context_cap {m.context_cap:,} tokens x batch {batch}"
        return context * batch, f"{why}: {context:,} tokens x batch {batch}"
    per_sequence = min(context, m.context_cap) if m.context_cap is not None else context
    return per_sequence * batch, f"{per_sequence:,} tokens x batch {batch}"


def preflight(plan: Plan, shape: ModelShape, *, context: int, n_requests: int, capacity_bytes: int) -> tuple[str | None, dict[str, Any]]:
    """(reason to refuse or None, the numbers): the weights plus the KV cache the plan allocates
    (:func:`kv_allocation`) for requests of up to ``context`` tokens must fit in ``capacity_bytes``."""
    bits = dtype_bits(plan.hardware.dtype)
    w = weight_bytes(shape, dtype_bits=bits, weights_bits=plan.model.weight_bits)
    batch = batch_size(plan, n_requests)
    tokens, sizing = kv_allocation(plan, context=context, batch=batch)
    if plan.model.kv_cache == "quantized":
        per_token = quantized_kv_bytes_per_token(shape, kv_bits=plan.model.kv_bits or _DEFAULT_KV_BITS, scale_bits=bits)
        sizing += f", {plan.model.kv_bits or _DEFAULT_KV_BITS}-bit values"
    else:
        per_token = kv_bytes_per_token(shape, kv_bits=bits)
    if plan.model.kv_cache == "offloaded":
        per_token = per_token * min(_OFFLOADED_LAYERS, shape.layers) / shape.layers
        sizing += f", {min(_OFFLOADED_LAYERS, shape.layers)} of {shape.layers} layers on the device (offloaded)"
    kv = round(per_token * tokens)
    numbers = {"weight_bytes": w, "kv_bytes": kv, "kv_tokens": tokens, "kv_sizing": sizing, "context_tokens": context, "batch": batch,
               "capacity_bytes": capacity_bytes}
    if capacity_bytes and w + kv > capacity_bytes:
        gb = 1e9
        return (f"pre-flight: weights {w / gb:.3f} GB + KV cache {kv / gb:.3f} GB ({sizing}) = {(w + kv) / gb:.3f} GB "
                f"exceed the device's {capacity_bytes / gb:.3f} GB"), numbers
    return None, numbers
