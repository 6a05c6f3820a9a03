"""The vllm runtime as the house reads it (:class:`~fractal_opt.engine.capabilities.Capabilities`)."""

from __future__ import annotations

from typing import Any

from ...core.errors import FractalOptError
from ...engine.capabilities import Capabilities, Idle

__all__ = ["CAPABILITIES", "available"]


def available(machine: Any) -> str | None:
    """Why no vLLM can be reached from here (no running server, no executable found), or None. Looks at paths only."""
    from .process import find_executable, find_url

    if find_url(None):
        return None
    try:
        find_executable(None)
    except FractalOptError as e:
        return str(e)
    return None


CAPABILITIES = Capabilities(
    name="vllm",
    summary="vLLM's OpenAI-compatible server as a child process in its own environment (or a running one)",
    engine="fractal_opt.runtimes.vllm.engine:VllmEngine",
    refuses="fractal_opt.runtimes.vllm.engine_args:REFUSALS",
    maps="fractal_opt.runtimes.vllm.engine_args:FIELDS",
    options=frozenset({"path", "url", "tensor_parallel", "pipeline_parallel"}),
    available=available,
    # vLLM reserves a share of a GPU's memory for its KV cache when it starts (0.9 by default), so
    # two servers cannot share one GPU; on the CPU it allocates a fixed KV space instead.
    whole_device="accelerator",
    batch_invariant=False,  # continuous batching: a request's kernels depend on the batch it joins
    token_prompts=True,  # every prompt arrives as the token ids fractal_opt rendered (weights/prompts.py)
    idle=Idle(threads="none in this process (an HTTP client per call)", children="a `vllm serve` process per cached plan (at most two)",
              memory="each server's weights and its KV-cache reservation, until it is stopped",
              pause="each `vllm serve` child's process group (server, engine core, workers) is stopped (SIGSTOP, SIGCONT after) during other engines' rounds",
              evict="evict_except / clear_cache stop the servers of other plans"),
    export_targets=("vllm",),
    # Its own: -tp / -pp over GPUs or, on the CPU build, over cores (each rank bound to its own);
    # replicas are its data-parallel ranks behind its own front end (--data-parallel-size).
    placements=frozenset({"tensor_parallel", "pipeline_parallel", "replicas"}),
    evict="fractal_opt.runtimes.vllm:evict_except",
    clear="fractal_opt.runtimes.vllm:clear_cache",
)
