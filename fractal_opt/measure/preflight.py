"""The pre-flight: will a plan's weights and KV cache fit in the device, before anything loads?

Pure arithmetic on the model's shape (:class:`~fractal_opt.measure.roofline.ModelShape`, read
from its config) and the plan: weights at the plan's dtype and weight bits, plus the KV cache of
``context`` tokens for every sequence of the plan's batch. The pipeline refuses a step whose
numbers exceed the device (the reason names them) and decides from them whether two models can
be measured side by side.

Example:
    >>> shape = ModelShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
    ...                    intermediate=1536, vocab=49152, tied_embeddings=True)
    >>> from fractal_opt.plan import Plan
    >>> reason, numbers = preflight(Plan(source="x"), shape, context=1024, n_requests=4, capacity_bytes=16 * 10**9)
    >>> reason is None, numbers["batch"]
    (True, 1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .roofline import ModelShape, dtype_bits, kv_bytes_per_token, weight_bytes

if TYPE_CHECKING:
    from ..plan import Plan

__all__ = ["batch_size", "preflight"]


def batch_size(plan: Plan, n_requests: int) -> int:
    """How many sequences the plan decodes at once over ``n_requests`` requests (1 when sequential)."""
    sched = plan.scheduling
    if sched.batching == "sequential":
        return 1
    size = sched.batch_size if sched.batching == "static" else (getattr(sched, "max_concurrency", None) or n_requests)
    return max(1, min(size, n_requests))


def preflight(plan: Plan, shape: ModelShape, *, context: int, n_requests: int, capacity_bytes: int) -> tuple[str | None, dict[str, Any]]:
    """(reason to refuse or None, the numbers): weights + KV cache for ``context`` tokens × the
    plan's batch must fit in ``capacity_bytes``."""
    bits = dtype_bits(plan.hardware.dtype)
    w = weight_bytes(shape, dtype_bits=bits, weights_bits=plan.model.weight_bits)
    batch = batch_size(plan, n_requests)
    kv = 0 if plan.model.kv_cache == "off" else kv_bytes_per_token(shape, kv_bits=bits) * context * batch
    numbers = {"weight_bytes": w, "kv_bytes": kv, "context_tokens": context, "batch": batch, "capacity_bytes": capacity_bytes}
    if capacity_bytes and w + kv > capacity_bytes:
        gb = 1e9
        return (f"pre-flight: weights {w / gb:.3f} GB + KV cache {kv / gb:.3f} GB ({context} tokens x batch {batch}) = {(w + kv) / gb:.3f} GB "
                f"exceed the device's {capacity_bytes / gb:.3f} GB"), numbers
    return None, numbers
