"""Global torch knobs a plan sets for the duration of a call, restored afterwards, so a rolled-back
pass cannot leak into the next measurement: threads, matmul precision, native grouped-query SDPA."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from ...core.machine import Machine, resolve_device
from ...tower.plan import Plan

__all__ = ["native_gqa_applies", "no_grad", "runtime"]


# transformers' sdpa wrapper copies the key/value heads of grouped-query models (repeat_kv: 3x for
# SmolLM2) whenever an attention mask is present, because CUDA's fused kernels refuse masked GQA.
# Batched serving always has a mask (left padding; continuous batching's block-diagonal mask over
# the whole batch's cache), so on CPU that copy is most of the attention cost. torch's CPU SDPA
# takes grouped heads with a mask (enable_gqa) and computes the same numbers; this environment
# switch of transformers' (read at every attention call) turns it on. CPU only: on CUDA masked GQA
# falls back to the slow math kernel.
_FORCE_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"
_gqa_lock = threading.Lock()
_gqa_users = 0
_gqa_before: str | None = None


def native_gqa_applies(plan: Plan) -> bool:
    """True when ``runtime(plan)`` lets SDPA attend grouped-query heads natively under a mask."""
    hw = plan.hardware
    return hw.attention == "sdpa" and hw.device_map is None and resolve_device(hw.device) == "cpu"


@contextlib.contextmanager
def _native_gqa(enabled: bool) -> Iterator[None]:
    """Set transformers' force-GQA switch for the block (counted: servers may overlap)."""
    global _gqa_users, _gqa_before
    if not enabled:
        yield
        return
    with _gqa_lock:
        if _gqa_users == 0:
            _gqa_before = os.environ.get(_FORCE_GQA_ENV)
            os.environ[_FORCE_GQA_ENV] = "1"
        _gqa_users += 1
    try:
        yield
    finally:
        with _gqa_lock:
            _gqa_users -= 1
            if _gqa_users == 0:
                if _gqa_before is None:
                    os.environ.pop(_FORCE_GQA_ENV, None)
                else:
                    os.environ[_FORCE_GQA_ENV] = _gqa_before


@contextlib.contextmanager
def runtime(plan: Plan, machine: Machine | None = None) -> Iterator[None]:
    """Apply the plan's global torch settings for the duration of the block, then restore them.

    Threads and matmul precision as the plan says, and on CPU with sdpa attention, grouped-query
    heads attended natively under a mask (see ``_FORCE_GQA_ENV``; same numbers, no K/V copy).
    """
    import torch

    before = torch.get_num_threads()
    precision_before = torch.get_float32_matmul_precision()
    threads = plan.hardware.threads
    if threads == "auto":
        threads = (machine or Machine.probe()).physical_cores
    try:
        if isinstance(threads, int) and threads != before:
            torch.set_num_threads(threads)
        if plan.hardware.matmul_precision != precision_before:
            torch.set_float32_matmul_precision(plan.hardware.matmul_precision)  # TF32 on CUDA for "high"
        with _native_gqa(native_gqa_applies(plan)):
            yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
        if torch.get_float32_matmul_precision() != precision_before:
            torch.set_float32_matmul_precision(precision_before)


def no_grad():
    import torch

    # no_grad rather than inference_mode: some quantized tensor subclasses (quanto int4) fail
    # under inference_mode ("Cannot set version_counter for inference tensor").
    return torch.no_grad()
